"""The device's fused kernels in Hugging Face models, through public extension points.

Optimum for Intel Gaudi gets FusedSDPA and FusedRMSNorm into Llama and the rest by copying and
patching transformers' modeling files, which pins one transformers minor version per release.
This module reaches the same kernels without touching those files:

- attention: an attention function registered with transformers' `AttentionInterface` (public
  since 4.48) under the name "hputrain", with `sdpa`'s mask format (`AttentionMaskInterface`), and
  selected on the model in place of its default "sdpa". It calls the accelerator's kernel
  (FusedSDPA on Gaudi, torch's SDPA elsewhere), or the context-parallel attention when a
  context-parallel group is active. What the kernel cannot do falls back to transformers' own
  sdpa function, counted ("attention: fallback").
- RMSNorm: modules shaped like transformers' `*RMSNorm` (a 1-d `weight` and an epsilon) whose
  output equals `weight * rms_norm(x)` are swapped for `FusedRMSNorm`, which holds the *same*
  Parameter under the same name, so state dicts and `save_pretrained` output are unchanged. Gemma's
  `(1 + weight)` norms fail that check and are left alone.
- rotary embeddings: transformers 5.x applies them in each modeling file's apply_rotary_pos_emb,
  reachable only through the optional Hub `kernels` package; see docs/kernels.md.
- experts (mixture of experts): a dropless experts function with static shapes registered with
  transformers' `ExpertsInterface` (public since 5.0) as "hputrain" and selected in place of its
  default "grouped_mm", and Llama 4's MoE blocks, which the interface does not reach, swapped for
  modules holding the same Parameters (kinds/moe/experts/).

The choice made here is transformers' default only: a model whose attention implementation is
anything but "sdpa" (a user's explicit "eager", "flash_attention_2", ...) keeps it, and one whose
experts implementation is anything but "grouped_mm" keeps that.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import context_parallel
from ..errors import InputError
from ..models.kind import registered

ATTENTION = "hputrain"  # our name in transformers' AttentionInterface
FALLBACK = "attention: fallback"  # the summary's count of calls sent to transformers' sdpa


class _Kernels:
    """What the substituted modules of one model share: the accelerator whose kernels they call,
    and the summary that counts attention fallbacks. A deep copy of the model shares it too (the
    device is not copied with the model)."""

    def __init__(self, accelerator, summary: dict[str, int]) -> None:
        self.accelerator, self.summary = accelerator, summary

    def __deepcopy__(self, memo):
        return self

    def attend(self, q, k, v, mask, scale, dropout_p):
        """The device's attention over context-parallel gathered keys (context_parallel.py)."""
        return self.accelerator.scaled_dot_product_attention(q, k, v, mask, False, scale, dropout_p)


def substitute(model: nn.Module, accelerator, fused_kernels) -> dict[str, int]:
    """Swap in the device's kernels where `fused_kernels` asks ("auto": where the accelerator
    prefers them); return what was substituted, {"attention: fused_sdpa": 16, ...}."""
    if fused_kernels is False or (fused_kernels == "auto" and not accelerator.prefers_fused_kernels()):
        return {}
    # a Hugging Face model means transformers is imported already; never import it (seconds) for
    # a model that is not one
    offered = available(accelerator, import_transformers=False)
    summary: dict[str, int] = {}
    shared = _Kernels(accelerator, summary)
    if offered["attention"] and (count := _use_attention(model, shared)):
        summary[f"attention: {offered['attention']}"] = count
    if offered["rms_norm"] and (count := _swap_rms_norms(model, shared)):
        summary[f"rms_norm: {offered['rms_norm']}"] = count
    for kind in registered():  # the kinds' kernels: a mixture of experts' static experts
        summary.update(kind.substitute_kernels(model, offered, shared))
    return summary


def available(accelerator, import_transformers: bool = True) -> dict[str, str | None]:
    """The kernels the device offers for Hugging Face models, by substitution (None: none), for
    `hputrain env`. Attention needs transformers' AttentionInterface (looked for only where
    transformers is already imported, unless `import_transformers`), the experts its
    ExpertsInterface."""
    offered = dict(accelerator.fused_kernels())
    if not import_transformers and "transformers" not in sys.modules:
        return offered | {"attention": None, "experts": None}
    try:
        from transformers import AttentionInterface  # noqa: F401
    except ImportError:
        offered["attention"] = None
    try:
        from transformers.integrations.moe import ExpertsInterface  # noqa: F401
    except ImportError:
        offered["experts"] = None
    return offered


def describe(summary: dict[str, int]) -> str:
    """One line for the run header: "attention: fused_sdpa ×16, rms_norm: fused ×33, experts:
    static ×2"."""
    return ", ".join(f"{name} ×{count}" for name, count in summary.items()) or "none"


# -- attention -----------------------------------------------------------------------------------
def register() -> None:
    """Register hputrain's attention with transformers (idempotent: a name maps to one function)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attention)
    # the same masks as sdpa: boolean (True attends), or None where `is_causal` says it all
    AttentionMaskInterface.register(ATTENTION, AttentionMaskInterface()["sdpa"])


def _use_attention(model: nn.Module, shared: _Kernels) -> int:
    """Select hputrain's attention on a transformers model that runs the default "sdpa"; return
    how many attention modules now call it."""
    config = getattr(model, "config", None)
    if not hasattr(model, "set_attn_implementation") or getattr(config, "_attn_implementation", None) != "sdpa":
        return 0  # not a transformers model, or one whose attention the user chose
    register()
    model.set_attn_implementation(ATTENTION)
    modules = [m for m in model.modules() if _is_attention(m)]
    for module in modules:
        module._hputrain_kernels = shared
    return len(modules)


def _is_attention(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return (type(module).__name__.endswith("Attention")
            and getattr(config, "_attn_implementation", None) == ATTENTION)


def _kernel_cannot(query, attention_mask, kwargs) -> bool:
    """What the device's kernel does not do, and transformers' sdpa function does (or warns
    about): attention weights, position biases, soft-capping, paged caches, non-tensor masks."""
    return (bool(kwargs.get("output_attentions")) or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("cache") is not None
            or (attention_mask is not None and not isinstance(attention_mask, torch.Tensor))
            or query.dim() != 4)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
              sliding_window=None, is_causal=None, **kwargs):
    """transformers' attention contract: (batch, heads, seq, dim) query, key and value (key and
    value with the model's key/value heads) in, ((batch, seq, heads, dim) output, None) out.
    A sliding window arrives in `attention_mask`, which sdpa's mask function builds with it."""
    shared = getattr(module, "_hputrain_kernels", None)
    group = context_parallel.active_group()
    if shared is None or _kernel_cannot(query, attention_mask, kwargs):
        if group is not None:
            raise InputError("context parallelism: this model's attention needs transformers' own "
                             "sdpa path (attention weights, position biases or a paged cache), "
                             "which sees only this rank's slice; set context_parallel_size=1")
        if shared is not None:
            shared.summary[FALLBACK] = shared.summary.get(FALLBACK, 0) + 1
        sdpa = _transformers_sdpa()
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                    sliding_window=sliding_window, is_causal=is_causal, **kwargs)
    q_len = query.size(2)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # as transformers' sdpa: causal by flag only without a mask, and not for one query (decoding)
    causal = bool(causal) and q_len > 1 and attention_mask is None
    if causal and key.size(2) > q_len:  # an empty static cache's prefill: the rest is masked anyway
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    if group is not None:
        if not causal:
            raise InputError("context parallelism supports causal self-attention without padding: "
                             "drop the attention_mask (or pad nothing) with context_parallel_size > 1")
        output = context_parallel.attend_in_group(query, key, value, dropout, scaling, shared.attend)
    else:
        output = shared.accelerator.scaled_dot_product_attention(query, key, value, attention_mask,
                                                                 causal, scaling, dropout)
    return output.transpose(1, 2).contiguous(), None


def _transformers_sdpa():
    from transformers import AttentionInterface

    return AttentionInterface()["sdpa"]


# -- RMSNorm -------------------------------------------------------------------------------------
class FusedRMSNorm(nn.Module):
    """Stands in for a transformers `*RMSNorm`: the same `weight` Parameter under the same name
    (state dict keys unchanged), its forward through the accelerator's fused RMSNorm."""

    def __init__(self, original: nn.Module, eps: float, shared: _Kernels) -> None:
        super().__init__()
        self.weight = original.weight
        self.eps = eps
        self.replaces = type(original).__name__
        self._shared = shared
        # hooks someone put on the original (rare before the trainer wraps the model) still run
        self._forward_pre_hooks.update(original._forward_pre_hooks)
        self._forward_hooks.update(original._forward_hooks)

    @property
    def variance_epsilon(self) -> float:
        """transformers' name of the epsilon, for code that reads it."""
        return self.eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._shared.accelerator.rms_norm(hidden_states, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, replaces={self.replaces}"


def _swap_rms_norms(model: nn.Module, shared: _Kernels) -> int:
    swaps = [(name, module, eps) for name, module in model.named_modules()
             if (eps := _rms_norm_epsilon(module)) is not None and _computes_like_fused(module, eps)]
    for name, module, eps in swaps:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, FusedRMSNorm(module, eps, shared))
    return len(swaps)


def _rms_norm_epsilon(module: nn.Module) -> float | None:
    """The epsilon of a module shaped like transformers' RMSNorm (its class name, one 1-d
    `weight` as its only parameter, `variance_epsilon` or `eps`), or None."""
    if isinstance(module, FusedRMSNorm) or not type(module).__name__.endswith("RMSNorm"):
        return None
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or len(list(module.parameters())) != 1:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) else None


def _computes_like_fused(module: nn.Module, eps: float) -> bool:
    """Whether the module computes `weight * rms_norm(x)`, checked once on a random weight and
    input on the CPU (the module's own weight may be on the meta device, or all ones, where a
    Gemma-style `(1 + weight)` norm could not be told apart)."""
    size = module.weight.numel()
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, size, generator=generator), torch.randn(size, generator=generator)
    try:
        with torch.no_grad():
            theirs = torch.func.functional_call(module, {"weight": weight}, (x,))
    except Exception:  # noqa: BLE001  (a norm that needs more arguments, or buffers elsewhere)
        return False
    ours = weight * F.rms_norm(x, (size,), eps=eps)
    return (isinstance(theirs, torch.Tensor) and theirs.shape == ours.shape
            and torch.allclose(theirs, ours, rtol=1e-4, atol=1e-5))
