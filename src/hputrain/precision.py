"""Precision plugins. The base does nothing; each subclass overrides only what it changes.

The trainer always calls `precision.forward_context()` around the forward pass and
`precision.compute_dtype` for throughput figures; full precision is a disabled no-op, never an `if`.
"""
from __future__ import annotations

import contextlib

import torch

from .config import AcceleratorConfig, TrainingArguments


class Precision:
    """Full precision: parameters, activations and gradients in float32."""

    compute_dtype = torch.float32

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __repr__(self) -> str:
        return type(self).__name__


class BF16Autocast(Precision):
    """bfloat16 mixed precision through torch.autocast: fp32 master weights and optimizer state,
    matrix products in bfloat16."""

    compute_dtype = torch.bfloat16

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def forward_context(self):
        return torch.autocast(device_type=self.device_type, dtype=torch.bfloat16)


def select_precision(args: TrainingArguments, config: AcceleratorConfig, accelerator) -> Precision:
    """bf16 when TrainingArguments.bf16 or the accelerator config asks for mixed precision."""
    if args.bf16 or config.mixed_precision:
        return BF16Autocast(accelerator.autocast_device_type)
    return Precision()
