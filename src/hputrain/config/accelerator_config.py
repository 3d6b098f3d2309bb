"""AcceleratorConfig: device-specific tuning, read from Optimum for Intel Gaudi's GaudiConfig
JSON files as published (see fields.py for the shared validation helpers)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .fields import check, check_choice, checked_values, read_mapping

# Keys that published GaudiConfig files carry as provenance, with no effect on a run.
_GAUDI_METADATA_KEYS = ("optimum_version", "transformers_version", "_name_or_path")


@dataclass(kw_only=True)
class AcceleratorConfig:
    """Device-specific tuning, read from GaudiConfig JSON files as published (current and legacy).
    On devices other than Gaudi, the mixed-precision lists still apply; the fused kernels map to
    the device's own."""

    use_fused_adam: bool | None = None
    """Use the device's fused AdamW (Gaudi FusedAdamW); unset means the device default."""
    use_fused_clip_norm: bool | None = None
    """Use the device's fused gradient clipping (Gaudi FusedClipNorm); unset means the default."""
    use_torch_autocast: bool = False
    """Mixed precision with torch.autocast and the op lists below."""
    autocast_bf16_ops: list[str] | None = None
    """Ops that run in bfloat16 under autocast."""
    autocast_fp32_ops: list[str] | None = None
    """Ops that stay in float32 under autocast."""
    use_dynamic_shapes: bool = False
    """Gaudi: allow dynamic shapes in graphs."""
    use_habana_mixed_precision: bool = False
    """Legacy Habana Mixed Precision; mapped onto autocast with the hmp op lists."""
    hmp_opt_level: str = "O1"
    """Legacy HMP optimisation level (recorded; O1 is the only level with op lists)."""
    hmp_is_verbose: bool = False
    """Legacy HMP verbosity (recorded, no effect)."""
    hmp_bf16_ops: list[str] | None = None
    """Legacy name of autocast_bf16_ops."""
    hmp_fp32_ops: list[str] | None = None
    """Legacy name of autocast_fp32_ops."""
    log_device_mem_alloc: bool = False
    """Legacy: log device memory (hputrain logs memory every logging step regardless)."""

    def __post_init__(self) -> None:
        check(not (self.use_habana_mixed_precision and self.use_torch_autocast),
               "use_habana_mixed_precision and use_torch_autocast cannot both be true")
        check_choice("hmp_opt_level", self.hmp_opt_level, ("O1", "O2"))
        if self.use_habana_mixed_precision:
            # Legacy HMP lists become the autocast lists, unless the file gives those too.
            self.autocast_bf16_ops = self.autocast_bf16_ops or self.hmp_bf16_ops
            self.autocast_fp32_ops = self.autocast_fp32_ops or self.hmp_fp32_ops

    @property
    def mixed_precision(self) -> bool:
        """Whether this config asks for bf16 mixed precision (current or legacy spelling)."""
        return self.use_torch_autocast or self.use_habana_mixed_precision

    @classmethod
    def from_file(cls, path: str | Path) -> "AcceleratorConfig":
        return cls(**checked_values(cls, read_mapping(path), f"accelerator config {path}",
                                    ignore=_GAUDI_METADATA_KEYS))
