"""The names settings take: schedules, strategies, execution modes, device kinds, optimizers,
trackers, precision spellings. A leaf: imports nothing of hputrain but errors."""
from __future__ import annotations

from ..errors import InputError

SCHEDULES = ("linear", "cosine", "constant")
STRATEGIES = ("auto", "single", "ddp", "fast_ddp", "fsdp")
# fsdp, in Hugging Face's spelling: how the model state is sharded.
FSDP_MODES = ("full_shard", "shard_grad_op", "hybrid_shard")
EXECUTION_MODES = ("auto", "eager", "lazy", "compile")
ACCELERATOR_NAMES = ("auto", "hpu", "cuda", "mps", "cpu")
# optim: whether it asks for the device's fused AdamW (None: the device's default).
OPTIMIZERS = {"auto": None, "adamw_torch": False, "adamw_torch_fused": True, "adamw_hpu": True}
REPORT_TARGETS = ("tensorboard", "mlflow", "wandb", "all", "none")
# eval_strategy, save_strategy, logging_strategy (Hugging Face's): when something happens.
INTERVAL_STRATEGIES = ("steps", "epoch", "no")

# Precision spellings users bring from Lightning, the Hugging Face Trainer and Accelerate.
_BF16 = {"bf16", "bf16-mixed", "bf16_mixed", "bfloat16", "true"}
_FP32 = {"32", "32-true", "fp32", "float32", "no", "false"}
AUTO = "auto"


def parse_precision(value) -> str:
    """"bf16-mixed", "32-true" or "auto" from a bool or any common spelling; anything else is an
    error (bf16 is never silently dropped)."""
    spelling = str(value).strip().lower()
    if value is True or spelling in _BF16:
        return "bf16-mixed"
    if value is False or value is None or spelling in _FP32:
        return "32-true"
    if spelling == AUTO:
        return AUTO
    raise InputError(f"unknown precision {value!r}: use bf16-mixed (bf16, bfloat16), 32-true (32, fp32) "
                     "or auto (bf16 where the device runs it natively)"
                     + ("; fp16 is not supported, use bf16" if "16" in spelling else ""))
