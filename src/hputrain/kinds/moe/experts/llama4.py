"""Llama 4's text MoE, which does not go through transformers' ExpertsInterface.

transformers' Llama4TextMoe runs every expert on every token (E times the arithmetic of top-k),
each token's input scaled by its router score before the expert (zero for the experts it did not
pick), and sums. Its experts module takes pre-arranged rows, not (tokens, index, weights), so the
interface cannot reach it. Instead the MoE block is swapped, as the kernels swap RMSNorm modules,
for `StaticLlama4TextMoe`: it holds the *same* router, experts and shared expert under the same
names (state dicts and `save_pretrained` output unchanged) and runs only the top-k pairs through
the static route -> grouped experts -> combine path. An expert given a zero input returns zero
(no biases; act(0)·0 = 0), so leaving out the experts a token did not pick changes no number.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .forward import ExpertWeights, accelerator_of, combine, local_experts, route


def is_llama4_moe(module: nn.Module) -> bool:
    """transformers' Llama4TextMoe (by class name and its parts, so that transformers need not be
    imported to ask)."""
    return (type(module).__name__ == "Llama4TextMoe" and hasattr(module, "router")
            and hasattr(module, "experts") and hasattr(module, "shared_expert"))


def llama4_weights(experts: nn.Module) -> ExpertWeights:
    """Llama4TextExperts' matrices, stored (E, in, out) with [gate; up] concatenated."""

    def activate(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return up * experts.act_fn(gate)

    return ExpertWeights(up=experts.gate_up_proj, down=experts.down_proj, activate=activate)


class StaticLlama4TextMoe(nn.Module):
    """Stands in for a Llama4TextMoe: the same children, top-k pairs only, static shapes."""

    def __init__(self, original: nn.Module, shared) -> None:
        super().__init__()
        self.top_k, self.hidden_dim = original.top_k, original.hidden_dim
        self.num_experts = original.num_experts
        self.experts, self.router, self.shared_expert = original.experts, original.router, original.shared_expert
        self._hputrain_kernels = shared
        self._forward_pre_hooks.update(original._forward_pre_hooks)
        self._forward_hooks.update(original._forward_hooks)

    def forward(self, hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, self.hidden_dim)
        scores, router_logits = self.router(hidden)  # scores: sigmoid of the top-k logits, else 0
        top_k_index = torch.topk(router_logits, self.top_k, dim=1).indices  # the router's own choice
        routing = route(top_k_index, self.num_experts)
        pair_scores = scores.gather(1, top_k_index).reshape(-1, 1)
        x_sorted = F.embedding(routing.tokens, hidden) * F.embedding(routing.order, pair_scores)
        routed = local_experts(llama4_weights(self.experts), x_sorted, routing.offsets, accelerator_of(self))
        out = self.shared_expert(hidden)
        return out + combine(routed, routing, None, self.top_k).to(out.dtype), router_logits


def swap_llama4_moes(model: nn.Module, shared) -> int:
    """Replace every Llama4TextMoe in `model` by a StaticLlama4TextMoe; return how many."""
    swaps = [name for name, module in model.named_modules() if is_llama4_moe(module)]
    for name in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, StaticLlama4TextMoe(getattr(parent, child), shared))
    return len(swaps)
