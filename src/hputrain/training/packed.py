"""Packed batches on their way into the model: attention kept inside each example.

A packed block (data/packing.py) carries `seq_lens`, the lengths of the examples it holds. Just
before the model is called, on the device, they become the additive block-causal mask passed as
`attention_mask` (the block's `position_ids`, restarting at each example, go in as they are), and
`seq_lens` itself never reaches the model.

Why here and not in a collator: the mask must be in the dtype the attention computes in (eager
attention adds it to the scores; a float32 mask added to bfloat16 scores under autocast promotes
them to float32, and a bfloat16 minimum built on the host would be wrong for a float32 model).
That dtype is known only to the Trainer (its precision plugin and the model), not to the data
workers; and a [batch, 1, S, S] float mask is S times larger than the lengths it comes from, so
building it on the device also saves the host-to-device copy. Everything here is device ops on
tensors of static shape (cumsum, scatter, comparisons): nothing is read back to the host, so in
lazy mode the step's graph is the same every step.
"""
from __future__ import annotations

import torch

from ..data.packing import block_causal_mask
from ..errors import InputError

SEQ_LENS = "seq_lens"
"""The batch key of a packed block's example lengths."""

PACKING_KEYS = frozenset({SEQ_LENS})
"""Batch keys the model never takes but the Trainer keeps in batches (see `model_inputs`)."""


class PackedInputs:
    """Turns a packed batch into the model's inputs (see the module docstring); other batches pass
    through unchanged."""

    def __init__(self, model: torch.nn.Module, precision, inputs: frozenset[str] | None) -> None:
        self.dtype = mask_dtype(model, precision)
        self.inputs = inputs

    def __call__(self, batch: dict) -> dict:
        if SEQ_LENS not in batch:
            return batch
        if self.inputs is not None and not {"attention_mask", "position_ids"} <= self.inputs:
            raise InputError("packed blocks need a model whose forward takes attention_mask and "
                             "position_ids (to keep attention inside each example): train with "
                             "--no-packing")
        batch = dict(batch)
        seq_lens = batch.pop(SEQ_LENS)
        batch["attention_mask"] = block_causal_mask(seq_lens, batch["input_ids"].shape[-1], self.dtype)
        return batch


def mask_dtype(model: torch.nn.Module, precision) -> torch.dtype:
    """The dtype attention scores are computed in: the autocast dtype under bf16 (or fp16)
    autocast, else the model's floating-point parameter dtype."""
    if precision.compute_dtype in (torch.bfloat16, torch.float16):
        return precision.compute_dtype
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32
