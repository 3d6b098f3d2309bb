"""Mixture-of-experts layers with static shapes, through transformers' ExpertsInterface.

- forward.py: the dropless experts' forward (route -> local experts -> combine), registered with
  transformers as "hputrain" and selected by execution/kernels.py where the model runs
  transformers' default experts implementation.
- grouped.py: the grouped matrix product the experts run on (the device's kernel, or a
  fixed-shape form).
- llama4.py: Llama 4's MoE block, which the interface does not reach, swapped module for module.
"""
from __future__ import annotations

from torch import nn

from .forward import NAME, ExpertWeights, Routing, combine, experts_forward, local_experts, route
from .grouped import fixed_shape_grouped_mm, grouped_mm
from .llama4 import swap_llama4_moes

__all__ = ["NAME", "ExpertWeights", "Routing", "combine", "experts_forward", "fixed_shape_grouped_mm",
           "grouped_mm", "local_experts", "register", "route", "use_static_experts"]

DEFAULT = "grouped_mm"  # transformers' default experts implementation (5.x)


def register() -> None:
    """Register the static experts with transformers (idempotent: a name maps to one function)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, experts_forward)


def use_static_experts(model: nn.Module, shared) -> int:
    """Select the static experts on a transformers model whose experts run transformers' default
    implementation (a user's explicit "eager", "batched_mm", ... is kept), or swap Llama 4's MoE
    blocks (its experts ignore the setting: `fused_kernels=False` keeps transformers' blocks); `shared` (kernels._Kernels) gives them the accelerator. Return how many experts
    modules now run static shapes."""
    config = getattr(model, "config", None)
    if not hasattr(model, "set_experts_implementation"):
        return 0  # not a transformers model (or one from before the interface)
    if not model._can_set_experts_implementation():
        # a model whose experts ignore the interface (Llama 4's): its blocks are swapped
        return swap_llama4_moes(model, shared)
    if getattr(config, "_experts_implementation", None) != DEFAULT:
        return 0
    register()
    model.set_experts_implementation(NAME)
    count = 0
    for module in model.modules():
        if _runs_static(module):
            module._hputrain_kernels = shared
            count += 1
    return count


def _runs_static(module: nn.Module) -> bool:
    """An experts module of transformers' `use_experts_implementation` now dispatching to ours."""
    config = getattr(module, "config", None)
    return (hasattr(module, "has_gate") and hasattr(module, "is_transposed")
            and getattr(config, "_experts_implementation", None) == NAME)
