"""The stand-in's `habana_frameworks.torch.hpex`: CPU equivalents of the fused ops that most of
Intel's example scripts import, computing what Gaudi's compute, in ops that the CPU lazy backend
keeps in its graph (standin.py puts them in place; docs/doctor.md lists them for users):

- `hpex.optimizers.FusedAdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
  bias_correction=True)`: AdamW with decoupled weight decay, the update torch.optim.AdamW makes
  with the same eps (Gaudi's default eps is 1e-6, torch's 1e-8). Gaudi's calls mark_step before
  its update and after it, in lazy mode: so does this one, and the doctor ends the step's graph
  there (`ENDS_STEP`, rehearsal/doctor/loop.py).
- `hpex.normalization.FusedClipNorm(parameters, max_norm).clip_norm(parameters)`: the gradients
  scaled in place to a total 2-norm of at most max_norm, and that norm before clipping returned,
  as torch.nn.utils.clip_grad_norm_ does; a mark_step before and after, as Gaudi's.
- `hpex.kernels.FusedSDPA.apply(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
  scale=None, softmax_mode="None", recompute_mode=None, valid_sequence_lengths=None,
  padding_side="left")`: torch's scaled_dot_product_attention. softmax_mode "fast" (Gaudi's
  faster, approximate softmax) and recompute_mode (memory, not values) compute the same here;
  valid_sequence_lengths is not covered.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..accelerators import cpu_lazy

ENDS_STEP = "_hputrain_ends_step"
"""The attribute, True on the stand-in's FusedAdamW, that says its step ends the lazy step's graph
(a mark_step after the update), as Gaudi's does."""


def hpex_members(mark_step: Callable[[], None], not_covered: str) -> dict[str, dict[str, object]]:
    """The members of the hpex modules, by module name; `mark_step` is the runtime's (htcore's),
    `not_covered` the start of the error for what the stand-in lacks."""

    class FusedAdamW(cpu_lazy.AdamW):
        __doc__ = f"Gaudi's FusedAdamW on the CPU ({__name__})."

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                     bias_correction=True, moments_dtype=None):
            if moments_dtype is not None:
                raise NotImplementedError(f"{not_covered} FusedAdamW's moments_dtype (moments kept in another dtype)")
            super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             bias_correction=bias_correction)

        def step(self, closure=None):
            mark_step()
            loss = super().step(closure)
            mark_step()
            return loss

    setattr(FusedAdamW, ENDS_STEP, True)

    class FusedClipNorm:
        __doc__ = f"Gaudi's FusedClipNorm on the CPU ({__name__})."

        def __init__(self, parameters, max_norm) -> None:
            self.max_norm = float(max_norm)
            self.norm_type = 2.0

        def clip_norm(self, parameters) -> torch.Tensor:
            parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            if not any(p.grad is not None for p in parameters):
                return torch.tensor(0.0)
            mark_step()
            with torch.no_grad():
                total = cpu_lazy.clip_grad_norm(parameters, self.max_norm)
            mark_step()
            return total

    class FusedSDPA:
        __doc__ = f"Gaudi's FusedSDPA on the CPU ({__name__})."

        @staticmethod
        def apply(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, softmax_mode="None",
                  recompute_mode=None, valid_sequence_lengths=None, padding_side="left"):
            if valid_sequence_lengths is not None:
                raise NotImplementedError(f"{not_covered} FusedSDPA's valid_sequence_lengths")
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                                  is_causal=is_causal, scale=scale)

    return {"habana_frameworks.torch.hpex.optimizers": {"FusedAdamW": FusedAdamW},
            "habana_frameworks.torch.hpex.normalization": {"FusedClipNorm": FusedClipNorm},
            "habana_frameworks.torch.hpex.kernels": {"FusedSDPA": FusedSDPA}}
