"""NVIDIA GPUs through torch.cuda."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import GB, Accelerator, torch_grouped_mm

MIB = 2**20
MEMORY_BYTES = {"h100": 81559 * MIB, "h200": 143771 * MIB, "a100": 81920 * MIB}
"""Each GPU's memory as nvidia-smi reports it (H100 SXM 80 GB, H200 141 GB, A100 80 GB): the
targets of `hputrain plan`."""
# Dense peak FLOP/s per GPU (tensor cores, no sparsity), matched on a substring of the name.
_PEAK_FLOPS = {
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12,
             torch.float8_e4m3fn: 1979e12},
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12, torch.float32: 494e12,
             torch.float8_e4m3fn: 1979e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 156e12},
    "L4": {torch.bfloat16: 121e12, torch.float16: 121e12, torch.float32: 60e12,
           torch.float8_e4m3fn: 242e12},
}
CAPABILITY = {"h100": (9, 0), "h200": (9, 0), "a100": (8, 0)}
"""Each planned GPU's compute capability (what `hputrain plan` asks of a target without one)."""
_FP8_FROM = (8, 9)  # Ada (8.9) and Hopper (9.0) have fp8 tensor cores; torch._scaled_mm needs them


def has_fp8_units(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability has fp8 tensor cores."""
    return tuple(capability) >= _FP8_FROM


def published_peak_flops(name: str, dtype: torch.dtype) -> float | None:
    """A GPU's dense peak FLOP/s for `dtype`, matched on a substring of its name ("NVIDIA H100
    80GB HBM3", or a plan target's "h100"); None when not known."""
    for key, table in _PEAK_FLOPS.items():
        if key in name.upper():
            return table.get(dtype)
    return None


class CUDAAccelerator(Accelerator):
    name = "cuda"
    autocast_device_type = "cuda"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_name(self) -> str:
        return torch.cuda.get_device_name()

    def setup(self, local_rank: int = 0) -> torch.device:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device

    def dist_backend(self) -> str:
        return "nccl"

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def pins_memory(self) -> bool:
        return True

    def memory_stats(self) -> dict[str, float]:
        _, total = torch.cuda.mem_get_info()
        return {
            "memory_allocated_gb": torch.cuda.memory_allocated() / GB,
            "max_memory_allocated_gb": torch.cuda.max_memory_allocated() / GB,
            "total_memory_available_gb": total / GB,
        }

    def profiler_activities(self) -> list:
        return [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]

    def profiler_records_memory(self) -> bool:
        return True

    def supports_bf16(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def native_bf16(self) -> bool:
        return torch.cuda.is_bf16_supported(including_emulation=False)  # Ampere (8.0) and later

    def bf16_facts(self) -> dict:
        major, minor = torch.cuda.get_device_capability()
        return {"native_bf16": self.native_bf16(), "compute_capability": f"{major}.{minor}"}

    def bf16_shortfall(self) -> str | None:
        if self.native_bf16():
            return None
        major, minor = torch.cuda.get_device_capability()
        return (f"bf16 on {self.device_name()} is emulated (compute capability {major}.{minor}; "
                "native from 8.0)")

    def supports_fp8(self) -> bool:
        return self.native_fp8()  # torch._scaled_mm runs on fp8 tensor cores only

    def native_fp8(self) -> bool:
        return has_fp8_units(torch.cuda.get_device_capability())

    def peak_flops(self, dtype: torch.dtype) -> float | None:
        return published_peak_flops(self.device_name(), dtype)

    def wrap_graph_inference(self, module):
        # "reduce-overhead" records CUDA graphs of the compiled module and replays them.
        return torch.compile(module, mode="reduce-overhead", dynamic=False)

    def wrap_graph_training(self, module):
        # torch.compile records CUDA graphs of forward and backward where it can prove it safe
        # (static shapes, no CPU sync) and runs the rest eagerly.
        return torch.compile(module, mode="reduce-overhead")

    def grouped_mm_kernel(self, x, weight):
        # torch's CUDA grouped GEMM: Ampere (8.0) and later, every operand and stride on 16 bytes;
        # bf16, and fp32 and fp16 where F.grouped_mm exists (torch 2.10 and later: fp32 measured
        # exact on an H200 with torch 2.11)
        dtypes = (torch.bfloat16, torch.float16, torch.float32) if hasattr(F, "grouped_mm") else (torch.bfloat16,)
        if (x.dtype not in dtypes or torch.cuda.get_device_capability(x.device) < (8, 0)
                or not (_aligned(x) and _aligned(weight))):
            return None
        return torch_grouped_mm(x, weight)

    def rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state) -> None:
        if state is not None:
            torch.cuda.set_rng_state(state)


def _aligned(tensor: torch.Tensor, boundary: int = 16) -> bool:
    """Whether the tensor's start and its strides other than 1 fall on `boundary` bytes (under
    torch.compile the strides alone: a traced tensor has no address, and inductor's buffers start
    aligned)."""
    size = tensor.element_size()
    return ((torch.compiler.is_compiling() or tensor.data_ptr() % boundary == 0)
            and all(stride == 1 or stride * size % boundary == 0 for stride in tensor.stride()))
