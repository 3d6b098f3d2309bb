"""What a training step's loss is the mean of: every counted token of the global batch.

A step's global batch is cut into micro-batches (gradient accumulation) and into one slice per
process. If each micro-batch's mean loss were simply averaged, a micro-batch with few counted
tokens (ragged rows, padding labelled -100) would weigh as much as a full one, and `batch 2 ×
accumulation 2` would train differently from `batch 4`. Instead the step's loss is

    sum over every counted token of the global batch / number of those tokens,

the same however the batch is split. The count is taken on the host from the labels before they
reach the device (no device sync), summed across processes, and then:

- a model that takes the count itself (transformers' loss kwargs: `num_items_in_batch`, for
  losses that honour it) returns sum / count directly;
- any other model returns its mean over the micro-batch's own counted tokens, and that mean is
  weighted by the micro-batch's share of the global count.

Counted tokens are labels other than -100, after the shift a causal LM's loss makes (position 0
of each row is never a target there). The built-in GPT takes labels already shifted.
"""
from __future__ import annotations

import inspect

import torch

from ..data.batching import base_model

IGNORE_INDEX = -100


class TokenCount:
    """Counts, for one model, the tokens its loss averages over, and knows whether the model takes
    that count as `num_items_in_batch`. A model under PEFT's adapters is asked through its base
    model (data.batching.base_model), so adapters change neither the count nor how it is passed."""

    def __init__(self, model: torch.nn.Module) -> None:
        model = base_model(model)
        self.shifts_labels = _loss_shifts_labels(model)
        self.takes_item_count = _takes_item_count(model)

    def __call__(self, batch) -> int:
        """Tokens the loss of `batch` (a host batch) averages over. Without labels: the tokens of
        the attention mask, else of input_ids, else one per sample."""
        if not isinstance(batch, dict):
            return batch_size(batch)
        labels = batch.get("shift_labels")
        if not isinstance(labels, torch.Tensor):
            labels = batch.get("labels")
            if isinstance(labels, torch.Tensor) and self.shifts_labels and labels.dim() >= 2:
                labels = labels[..., 1:]
        if isinstance(labels, torch.Tensor):
            return int((labels != IGNORE_INDEX).sum())
        for key in ("attention_mask", "input_ids"):
            value = batch.get(key)
            if isinstance(value, torch.Tensor):
                return int(value.sum()) if key == "attention_mask" else value.numel()
        return batch_size(batch)

    def samples(self, batch) -> int:
        """Throughput's samples in `batch`: its rows (a method whose rows pair up, such as DPO's
        chosen and rejected, counts pairs)."""
        return batch_size(batch)

    def seen(self, batches: list, counts: list[int]) -> int:
        """The tokens a step's throughput counts: the counted ones (a method whose loss counts
        other units, such as DPO's pairs, says otherwise)."""
        return sum(counts)


def batch_size(batch) -> int:
    """Samples in a batch: the first dimension of its first tensor (text columns are lists)."""
    values = batch.values() if isinstance(batch, dict) else (
        batch if isinstance(batch, (list, tuple)) else [batch])
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    first = next(iter(values), None)
    return len(first) if isinstance(first, (list, tuple)) else 1


def _transformers_causal_loss():
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:
        return None
    return ForCausalLMLoss


def _loss_function(model: torch.nn.Module):
    """A transformers model's loss function (None for other models, or when it has none)."""
    if not hasattr(type(model), "loss_function"):
        return None
    try:
        return model.loss_function
    except Exception:  # a model whose loss_function property cannot answer
        return None


def _loss_shifts_labels(model: torch.nn.Module) -> bool:
    """Whether the model's loss shifts labels by one (decoder-only transformers causal LMs).
    Encoder-decoder models feed right-shifted decoder inputs and score every label unshifted."""
    causal = _transformers_causal_loss()
    config = getattr(model, "config", None)
    return (causal is not None and _loss_function(model) is causal
            and not getattr(config, "is_encoder_decoder", False))


def _takes_item_count(model: torch.nn.Module) -> bool:
    """Whether `num_items_in_batch` reaches a loss that divides by it: a model that says so
    (`accepts_loss_kwargs`), or a decoder-only causal LM whose forward passes **kwargs on to
    transformers' causal loss. Models that would swallow the keyword and still return a mean
    (T5, sequence classifiers) are weighted instead."""
    declared = getattr(model, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    params = inspect.signature(model.forward).parameters.values()
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return takes_kwargs and _loss_shifts_labels(model)
