"""The dropless experts' forward in three steps, with no shape that depends on the routing:

1. `route`: the T·k (token, expert) pairs sorted by expert into a fixed (T·k,) order, with each
   expert's count and the end of its rows (`offsets`) as device tensors: no histc, no host read.
2. `local_experts`: the experts on the sorted buffer, one grouped matrix product per projection
   (grouped.py). Expert parallelism runs this step alone, on the rows its ranks exchanged.
3. `combine`: the rows back in pair order, weighted by the router and summed over each token's k.

`experts_forward` composes them under transformers' ExpertsInterface contract, reading the
experts module's attributes as transformers' own implementations do (gate_up_proj or up_proj,
down_proj, their biases, has_gate, has_bias, is_transposed, _apply_gate, act_fn,
post_expert_norm). Every token reaches its top-k experts, so the numbers are transformers' eager
ones.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

from .grouped import expert_of_rows, grouped_mm

NAME = "hputrain"  # our name in transformers' ExpertsInterface


@dataclass(frozen=True)
class Routing:
    """One batch's (token, expert) pairs sorted by expert; S = T·k rows whatever the routing."""

    order: torch.Tensor
    """(S,) the pair (token·k + slot) in each sorted row."""
    restore: torch.Tensor
    """(S,) the sorted row of each pair (the inverse of `order`)."""
    tokens: torch.Tensor
    """(S,) the token of each sorted row."""
    counts: torch.Tensor
    """(E,) how many pairs each expert got (the load metrics' and expert parallelism's counts)."""
    offsets: torch.Tensor
    """(E,) where each expert's rows end: the running sum of `counts`."""


def route(top_k_index: torch.Tensor, num_experts: int) -> Routing:
    """The pairs of `top_k_index` (T, k) sorted by expert, stably (a token's pairs in slot order).
    An expert number of `num_experts` or more (a sentinel) sorts to the end, counted by no expert."""
    tokens, k = top_k_index.shape
    pairs = tokens * k
    experts = top_k_index.reshape(-1).long()
    index = torch.arange(pairs, device=experts.device)
    # unique keys make any sort stable (the lazy backend's own stable sort falls back to eager)
    order = torch.sort(experts * pairs + index).indices
    restore = torch.sort(order).indices
    token_of_pair = torch.arange(tokens, device=experts.device).unsqueeze(-1).expand(tokens, k).reshape(-1)
    # counts by comparison with every expert number: histc takes no integers on the CPU, and
    # bincount's size would depend on the data
    counts = (experts.unsqueeze(-1) == torch.arange(num_experts, device=experts.device)).sum(0)
    return Routing(order=order, restore=restore, tokens=token_of_pair.gather(0, order),
                   counts=counts, offsets=torch.cumsum(counts, 0))


@dataclass(frozen=True)
class ExpertWeights:
    """An experts module's matrices as (E, in, out), and what runs between and after them."""

    up: torch.Tensor
    """(E, hidden, 2·intermediate) gate and up together, or (E, hidden, intermediate) up alone."""
    down: torch.Tensor
    """(E, intermediate, hidden)."""
    activate: Callable[[torch.Tensor], torch.Tensor]
    """The gate (the module's `_apply_gate`: concatenated or interleaved) or the activation."""
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    post_norm: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of(cls, module: torch.nn.Module) -> ExpertWeights:
        """The weights of a module decorated with transformers' `use_experts_implementation`."""
        gated, biased, transposed, post_norm = _layout(module)
        up_name = "gate_up_proj" if gated else "up_proj"

        def as_in_out(weight):
            return weight if transposed else weight.transpose(-2, -1)

        return cls(up=as_in_out(getattr(module, up_name)), down=as_in_out(module.down_proj),
                   activate=module._apply_gate if gated else module.act_fn,
                   up_bias=getattr(module, f"{up_name}_bias") if biased else None,
                   down_bias=module.down_proj_bias if biased else None,
                   post_norm=module.post_expert_norm if post_norm else None)

    @property
    def num_experts(self) -> int:
        return self.up.size(0)

    def local(self, first: int, stop: int) -> ExpertWeights:
        """Experts first..stop-1 alone (an expert-parallel rank's own)."""
        part = slice(first, stop)
        return replace(self, up=self.up[part], down=self.down[part],
                       up_bias=None if self.up_bias is None else self.up_bias[part],
                       down_bias=None if self.down_bias is None else self.down_bias[part])


def _layout(module) -> tuple[bool, bool, bool, bool]:
    """has_gate, has_bias, is_transposed, has_post_expert_norm, with the defaults of
    `use_experts_implementation` for the flags an older transformers does not set."""
    return (getattr(module, "has_gate", True), getattr(module, "has_bias", False),
            getattr(module, "is_transposed", False), getattr(module, "has_post_expert_norm", False))


def local_experts(weights: ExpertWeights, x_sorted: torch.Tensor, offsets: torch.Tensor,
                  accelerator=None, padded: bool = False) -> torch.Tensor:
    """The experts on rows sorted by expert: `x_sorted` (S, hidden), `offsets` (E,) the end of
    each expert's rows -> (S, hidden), the grouped products on `accelerator`'s kernel (None: the
    fixed-shape form). `padded`: rows may lie past offsets[-1] (expert parallelism's empty
    slots); they come out zero, and nothing of them reaches a gradient."""
    layouts: dict = {}  # both projections share the offsets, so the fixed-shape form's tiles
    mm = partial(grouped_mm, accelerator=accelerator, layouts=layouts)
    empty = expert = None
    if padded:
        # torch's grouped_mm leaves the rows past the last offset uninitialised, in its output and
        # in backward's input gradient: they are zeroed after each product and its bias (as
        # transformers' integrations/moe.py does), so that no garbage reaches the activation's
        # backward, a bias's gradient (each row's bias is its expert's) or the next product
        empty = (torch.arange(x_sorted.size(0), device=x_sorted.device) >= offsets[-1]).unsqueeze(1)
        x_sorted = x_sorted.masked_fill(empty, 0.0)
    if weights.up_bias is not None or weights.down_bias is not None:
        # the bias of each row's expert, looked up as an embedding (the lazy backends index that
        # way); padding rows borrow the last expert's, and are zeroed
        expert = expert_of_rows(offsets, x_sorted.size(0)).clamp(max=weights.num_experts - 1)
    hidden = mm(x_sorted, weights.up, offsets)
    if weights.up_bias is not None:
        hidden = hidden + F.embedding(expert, weights.up_bias)
    hidden = weights.activate(_zeroed(hidden, empty))
    out = mm(hidden, weights.down, offsets)
    if weights.down_bias is not None:
        out = out + F.embedding(expert, weights.down_bias)
    out = _zeroed(out, empty)
    if weights.post_norm is not None:
        out = weights.post_norm(out)
    return out


def _zeroed(rows: torch.Tensor, empty: torch.Tensor | None) -> torch.Tensor:
    return rows if empty is None else rows.masked_fill(empty, 0.0)


def combine(out_sorted: torch.Tensor, routing: Routing, top_k_weights: torch.Tensor | None,
            slots: int) -> torch.Tensor:
    """The sorted rows back in pair order, each weighted by its router weight (None: by one),
    summed over each token's `slots` (k) pairs -> (T, hidden)."""
    out = F.embedding(routing.restore, out_sorted)
    out = out.view(-1, slots, out.size(-1))
    if top_k_weights is not None:
        out = out * top_k_weights.unsqueeze(-1)
    return out.sum(1)


def accelerator_of(module: torch.nn.Module):
    """The accelerator whose kernels `module` runs (kernels.substitute gave it), or None."""
    shared = getattr(module, "_hputrain_kernels", None)
    return shared.accelerator if shared is not None else None


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ExpertsInterface contract: (T, hidden) states, (T, k) expert numbers and
    router weights -> (T, hidden)."""
    if getattr(self, "_is_expert_parallel", False):
        # transformers' own expert parallelism (its "ep" plan) sends sentinel experts: its own
        # implementation masks them
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    accelerator = accelerator_of(self)
    if accelerator is not None and (fused := _fused(self, accelerator, hidden_states, top_k_index,
                                                    top_k_weights)) is not None:
        return fused
    routing = route(top_k_index, self.num_experts)
    out = local_experts(ExpertWeights.of(self), F.embedding(routing.tokens, hidden_states),
                        routing.offsets, accelerator)
    return combine(out, routing, top_k_weights, top_k_index.size(-1)).to(hidden_states.dtype)


# transformers' activations the device's fused MoE ops take, by class name
_FUSED_ACTIVATIONS = {"SiLUActivation": "silu", "SiLU": "silu", "ReLU": "relu"}


def _fused(module, accelerator, hidden_states, top_k_index, top_k_weights) -> torch.Tensor | None:
    """The device's fused experts op (Gaudi's mixture_of_experts), where the module is the plain
    kind it computes (a concatenated [gate; up] with the default gate, no biases, no post norm,
    weights as (out, in)) and no gradient is asked for: the op has no backward. None otherwise."""
    from transformers.integrations.moe import _default_apply_gate

    activation = _FUSED_ACTIVATIONS.get(type(getattr(module, "act_fn", None)).__name__)
    gated, biased, transposed, post_norm = _layout(module)
    plain = (activation is not None and gated and getattr(module, "is_concatenated", True)
             and not biased and not post_norm and not transposed
             and getattr(type(module)._apply_gate, "__wrapped__", type(module)._apply_gate) is _default_apply_gate)
    wants_grad = torch.is_grad_enabled() and (
        hidden_states.requires_grad or top_k_weights.requires_grad
        or module.gate_up_proj.requires_grad or module.down_proj.requires_grad)
    if not plain or wants_grad:
        return None
    return accelerator.fused_experts(hidden_states, top_k_index, top_k_weights,
                                     module.gate_up_proj, module.down_proj, activation)
