"""fp8 training for Linear layers on any device with fp8 matrix products (torch._scaled_mm).

Each converted layer computes its three matrix products in fp8 with one scale per tensor:

    forward   y  = x  @ W.T    x, W in E4M3
    backward  dx = dy @ W      dy in E5M2 (gradients need range more than precision), W in E4M3
              dW = dy.T @ x    dy in E5M2, x in E4M3

Outputs come back in bfloat16 (dW in float32); the weights stay float32 masters, updated by the
optimizer as usual. A scale maps a tensor's largest magnitude (its amax) onto the format's
largest finite value. With delayed scaling the scale comes from the amaxes of earlier forward
passes (the largest in a history of `amax_history_len`), so casting needs no look at the tensor
first; the first pass, with an empty history, uses its own amax. Dynamic scaling uses the current
amax.

Which layers convert (`fp8_layer_names`): every nn.Linear except
  - the first and the last Linear of the model, in module order (the layers nearest the input and
    the output are the most sensitive to rounding; in a language model the last is the output
    head, often tied to the embedding);
  - layers with a dimension not a multiple of 16 (fp8 kernels need it) or below 64 (the product
    is too small for fp8 to pay for its casts).

Between forward and backward a layer keeps the fp8 input and the weight: as the bfloat16 copy
that bf16 autocast would keep (cast to fp8 again in backward), or, with minimize_memory, as the
fp8 weight itself (one byte per element instead of two). The fp8 values are the same either way,
so minimize_memory changes memory, not results.

The scaling state (amax histories and current scales) is each layer's extra state: it travels in
`state_dict()` under `<layer>._extra_state`, and checkpoints keep it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.activation_checkpointing import recomputing
from ..errors import InputError

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# Rows of a layer's scaling state.
INPUT, WEIGHT, GRAD = 0, 1, 2
_MULTIPLE, _SMALLEST = 16, 64
RULE = (f"nn.Linear layers other than the first and the last, with both dimensions multiples of "
        f"{_MULTIPLE} and at least {_SMALLEST}")


@dataclass(frozen=True)
class Fp8Recipe:
    """How fp8 layers scale and what they keep; TrainingArguments validates the values."""

    scaling: str = "delayed"
    """delayed (scales from the amax history) or dynamic (from the current amax)."""
    amax_history_len: int = 16
    """Forward passes of amax history that delayed scaling takes the largest from."""
    minimize_memory: bool = False
    """Keep the fp8 weight for backward instead of a bfloat16 copy."""


def emulated(device: str) -> str:
    """What fp8 is on `device`, one without fp8 matrix units (accelerators' `native_fp8`): the
    products run in wider types, slower than bf16 (docs/devices.md has the figures), so the run
    rehearses an fp8 run's numerics (formats, scales, skip rule, checkpoints) for a device that
    has them."""
    from ..accelerators.registry import fp8_targets

    *others, last = fp8_targets()
    return (f"emulated: the {device} has no fp8 matrix units, so it runs many times slower than "
            f"bf16, see docs/devices.md; a correctness rehearsal of fp8 on {', '.join(others)} "
            f"or {last}")


def _eligible(layer: nn.Linear) -> bool:
    dims = (layer.in_features, layer.out_features)
    return all(d % _MULTIPLE == 0 and d >= _SMALLEST for d in dims)


def fp8_layer_names(model: nn.Module) -> list[str]:
    """The names of the Linear layers that compute in fp8, by the rule in this module's docstring."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    return [name for name, layer in linears[1:-1] if _eligible(layer)]


def replace_layers(model: nn.Module, names: list[str], make) -> None:
    """Put `make(layer)` in place of each named layer of `model`."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, make(getattr(parent, child)))


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe, accelerator=None) -> list[str]:
    """Replace the eligible Linear layers of `model` by the accelerator's fp8 layer (Gaudi's
    Transformer Engine), else by Fp8Linear layers sharing their parameters (tied weights stay
    tied); return their names."""
    device_layer = accelerator.fp8_linear(recipe) if accelerator is not None else None
    names = fp8_layer_names(model)
    replace_layers(model, names, device_layer or (lambda layer: Fp8Linear.from_linear(layer, recipe)))
    return names


# -- scaling -----------------------------------------------------------------------------------

def _amax(t: torch.Tensor) -> torch.Tensor:
    return t.detach().abs().amax().float()


def _quantize(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t * scale in fp8, saturated to the format's range (a cast alone would give NaN). The product
    stays in t's dtype (a 0-dim scale does not promote it): a bf16 tensor needs no fp32 copy."""
    limit = torch.finfo(dtype).max
    return (t * scale).clamp_(-limit, limit).to(dtype)


class _Scaler:
    """Picks and records the scale of one tensor kind (INPUT, WEIGHT or GRAD) of one layer."""

    def __init__(self, layer: "Fp8Linear", kind: int, dtype: torch.dtype) -> None:
        self.layer, self.kind, self.dtype = layer, kind, dtype

    def __call__(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(t in fp8, its scale). In training the amax joins the history; in eval it does not,
        nor in activation checkpointing's recompute, which reuses the forward's scale."""
        if recomputing():
            scale = self.layer.scale[self.kind].clone()
            return _quantize(t, scale, self.dtype), scale
        layer, now = self.layer, _amax(t)
        history = layer.amax_history[self.kind]
        if layer.recipe.scaling == "dynamic":
            reference = now
        else:  # delayed: the largest amax seen in the history, or the current one at the start
            past = history.max()
            reference = torch.where(past > 0, past, now)
        limit = torch.finfo(self.dtype).max
        scale = torch.where(reference > 0, limit / reference, torch.ones_like(reference))
        if layer.training:
            history.copy_(torch.cat([now.reshape(1), history[:-1]]))  # newest first
            layer.scale[self.kind] = scale
        return _quantize(t, scale, self.dtype), scale


def _scaled_mm(a8, b8, scale_a, scale_b, out_dtype):
    """a @ b from fp8 operands and their scales. `b8` is read column-major, as fp8 kernels want."""
    return torch._scaled_mm(a8, b8.t().contiguous().t(), scale_a=scale_a.reciprocal(),
                            scale_b=scale_b.reciprocal(), out_dtype=out_dtype)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of 16 (fp8 kernels need it of every dimension); zeros add
    nothing to any of the three products."""
    extra = -t.shape[0] % _MULTIPLE
    return F.pad(t, (0, 0, 0, extra)) if extra else t


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, layer):
        rows = x.shape[0]
        x8, x_scale = layer.scale_input(_pad_rows(x))
        w_wide = weight.to(torch.bfloat16)
        w8, w_scale = layer.scale_weight(w_wide)
        out = _scaled_mm(x8, w8.t(), x_scale, w_scale, torch.bfloat16)[:rows]
        kept = w8 if layer.recipe.minimize_memory else w_wide
        ctx.save_for_backward(x8, kept, x_scale, w_scale)
        ctx.layer, ctx.rows, ctx.x_dtype = layer, rows, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x8, kept, x_scale, w_scale = ctx.saved_tensors
        layer = ctx.layer
        w8 = kept if kept.dtype == E4M3 else _quantize(kept, w_scale, E4M3)
        g8, g_scale = layer.scale_grad(_pad_rows(grad_out))
        grad_x = _scaled_mm(g8, w8, g_scale, w_scale, torch.bfloat16)[:ctx.rows].to(ctx.x_dtype)
        grad_w = _scaled_mm(g8.t().contiguous(), x8, g_scale, x_scale, torch.float32)
        return grad_x, grad_w, None


class Fp8Linear(nn.Module):
    """A Linear layer whose matrix products run in fp8 (see the module docstring). It holds the
    same `weight` and `bias` parameters as the nn.Linear it replaces."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Fp8Recipe | None = None, device=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.recipe = recipe or Fp8Recipe()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)  # nn.Linear's initialisation
        history = torch.zeros(3, self.recipe.amax_history_len, device=device)
        self.register_buffer("amax_history", history, persistent=False)
        self.register_buffer("scale", torch.ones(3, device=device), persistent=False)
        self.scale_input = _Scaler(self, INPUT, E4M3)
        self.scale_weight = _Scaler(self, WEIGHT, E4M3)
        self.scale_grad = _Scaler(self, GRAD, E5M2)

    @classmethod
    def from_linear(cls, layer: nn.Linear, recipe: Fp8Recipe) -> "Fp8Linear":
        fp8 = cls(layer.in_features, layer.out_features, layer.bias is not None, recipe, device="meta")
        fp8.weight, fp8.bias = layer.weight, layer.bias  # the same Parameter objects
        device = layer.weight.device
        fp8.amax_history = torch.zeros_like(fp8.amax_history, device=device)
        fp8.scale = torch.ones_like(fp8.scale, device=device)
        return fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        out = _Fp8Matmul.apply(x.reshape(-1, self.in_features), self.weight, self)
        out = out.reshape(*lead, self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    # The scaling state goes into state_dict() as "<name>._extra_state".
    def get_extra_state(self) -> dict:
        return {"amax_history": self.amax_history.detach().cpu().clone(),
                "scale": self.scale.detach().cpu().clone()}

    def set_extra_state(self, state: dict) -> None:
        _check_extra_state(state, tuple(self.amax_history.shape))
        self.amax_history.copy_(state["amax_history"])
        self.scale.copy_(state["scale"])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scaling={self.recipe.scaling}, "
                f"minimize_memory={self.recipe.minimize_memory}")


def _check_extra_state(state, history_shape: tuple) -> None:
    """Raise InputError unless `state` is what `get_extra_state` writes for a layer whose amax
    history has `history_shape`: those two keys, finite float tensors of the layer's shapes,
    amaxes >= 0 and scales > 0."""
    if not isinstance(state, dict) or set(state) != {"amax_history", "scale"}:
        found = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise InputError(f"fp8 scaling state must hold amax_history and scale, not {found}")
    history, scale = state["amax_history"], state["scale"]
    for name, value in state.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise InputError(f"fp8 scaling state's {name} must be a float tensor, not "
                             f"{getattr(value, 'dtype', type(value).__name__)}")
    if tuple(history.shape) != history_shape:
        raise InputError(f"fp8 scaling state has an amax history of shape {tuple(history.shape)}, "
                         f"this layer {history_shape} (fp8_amax_history_len differs)")
    if tuple(scale.shape) != (3,):
        raise InputError(f"fp8 scaling state has scales of shape {tuple(scale.shape)}, not (3,)")
    if not (history.isfinite().all() and (history >= 0).all()
            and scale.isfinite().all() and (scale > 0).all()):
        raise InputError("fp8 scaling state holds amaxes below 0 or scales not above 0, or "
                         "values that are not finite")

