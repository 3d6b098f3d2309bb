"""A model's extra losses and metrics beside its method's, through one interface the loop calls
alike for every model: `ModelExtras`, whose hooks do nothing (a dense decoder's), or what the
model's kind gives (models/kind.py's `extras` hook: a mixture of experts' router,
kinds/moe/router.py)."""
from __future__ import annotations

import contextlib

import torch

from ..models.kind import kinds_of


def token_mask(batch) -> torch.Tensor | None:
    """The real tokens of a device batch, [batch, length] as 1.0 / 0.0: a packed block's examples
    (`seq_lens`, padding after them), else a 2-D padding mask; None (every token) otherwise."""
    if not isinstance(batch, dict):
        return None
    seq_lens = batch.get("seq_lens")
    if isinstance(seq_lens, torch.Tensor) and isinstance(batch.get("input_ids"), torch.Tensor):
        length = batch["input_ids"].shape[-1]
        rows = seq_lens if seq_lens.dim() > 1 else seq_lens[None]
        positions = torch.arange(length, device=rows.device)
        return (positions[None, :] < rows.sum(-1, keepdim=True)).float()
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.float()
    return None


class ModelExtras:
    """Extra losses and metrics of a model: here none, every hook does nothing (the loop calls them
    all alike)."""

    trained = False
    forward_kwargs: dict = {}
    line = ""
    """The run header's words on them (a router's balancing; "" for none)."""

    def recording(self, mask: torch.Tensor | None = None):
        return contextlib.nullcontext()

    def step_done(self) -> None:
        """After each optimizer step (the bias update of DeepSeek-V3's balancing)."""

    def add_aux_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def metrics(self, group, prefix: str = "") -> dict:
        return {}

    def evaluating(self):
        return contextlib.nullcontext()

    def uncounted(self, inner=None):
        return inner if inner is not None else contextlib.nullcontext()


def model_extras(model: torch.nn.Module, args, group, inputs: frozenset[str] | None,
                 device: torch.device | None = None) -> ModelExtras:
    """What the model's kinds give (the first that gives any), else ModelExtras."""
    from ..data.batching import base_model

    config = getattr(base_model(model), "config", None)
    for kind in kinds_of(config):
        if (extras := kind.extras(model, args, group, inputs, device)) is not None:
            return extras
    return ModelExtras()
