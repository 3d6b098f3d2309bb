"""Apple silicon GPUs through torch.mps."""
from __future__ import annotations

import torch

from .base import GB, Accelerator


class MPSAccelerator(Accelerator):
    name = "mps"
    autocast_device_type = "mps"

    def is_available(self) -> bool:
        return torch.backends.mps.is_available()

    def device_count(self) -> int:
        return 1 if self.is_available() else 0

    def setup(self, local_rank: int = 0) -> torch.device:
        return torch.device("mps")

    def dist_backend(self) -> str:
        return "gloo"

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def memory_stats(self) -> dict[str, float]:
        allocated = torch.mps.current_allocated_memory()
        return {
            "memory_allocated_gb": allocated / GB,
            # torch.mps keeps no peak; the driver's total is the closest upper bound it reports.
            "max_memory_allocated_gb": torch.mps.driver_allocated_memory() / GB,
            "total_memory_available_gb": torch.mps.recommended_max_memory() / GB,
        }

    def native_fp8(self) -> bool:
        return False  # torch's MPS backend has no fp8 matrix product (supports_fp8 is False too)

    def rng_state(self) -> torch.Tensor:
        return torch.mps.get_rng_state()

    def set_rng_state(self, state) -> None:
        if state is not None:
            torch.mps.set_rng_state(state)
