"""Precision plugins, and op-list autocast on every device.

The base plugin does nothing; each subclass overrides only what it changes (STYLE.md, rule 5). The
trainer always enters `precision.forward_context()` around the forward pass and calls
`precision.convert_module(model)` once; full precision is a no-op object, never an `if`.

Op lists are Optimum for Intel Gaudi's (autocast_bf16_ops / autocast_fp32_ops, formerly
hmp_bf16_ops / hmp_fp32_ops). Gaudi's runtime applies them itself; on other devices
`hputrain.autocast` applies them, so a list tuned on one device runs the same on another.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..config.names import AUTO
from ..config.sections import PrecisionSettings
from ..errors import InputError, did_you_mean

T = torch.Tensor

# Op names as Gaudi config files spell them -> the Python callables that reach that op, both the
# functional forms (torch.mm, F.linear, which nn.Linear calls) and the operators (`a + b` arrives
# as Tensor.add, `a / b` as Tensor.div, `x += y` as Tensor.add_, `a @ b` as Tensor.matmul).
OPS: dict[str, tuple] = {
    "add": (torch.add, T.add, T.__add__, T.__radd__),
    "iadd": (T.add_, T.__iadd__),
    "sub": (torch.sub, T.sub, T.__sub__),
    "rsub": (torch.rsub, T.__rsub__),
    "mul": (torch.mul, T.mul, T.__mul__, T.__rmul__),
    "imul": (T.mul_, T.__imul__),
    "div": (torch.div, T.div, torch.divide),
    "truediv": (T.div, T.__truediv__, T.__rtruediv__, torch.true_divide),
    "pow": (torch.pow, T.pow, T.__pow__),
    "matmul": (torch.matmul, T.matmul, T.__matmul__),
    "mm": (torch.mm, T.mm),
    "bmm": (torch.bmm, T.bmm),
    "addmm": (torch.addmm, T.addmm),
    "baddbmm": (torch.baddbmm, T.baddbmm),
    "linear": (F.linear,),
    "conv1d": (F.conv1d, torch.conv1d),
    "conv2d": (F.conv2d, torch.conv2d),
    "embedding": (F.embedding,),
    "layer_norm": (F.layer_norm, torch.layer_norm),
    "group_norm": (F.group_norm, torch.group_norm),
    "batch_norm": (F.batch_norm, torch.batch_norm),
    "softmax": (F.softmax, torch.softmax, T.softmax),
    "log_softmax": (F.log_softmax, torch.log_softmax, T.log_softmax),
    "logsumexp": (torch.logsumexp, T.logsumexp),
    "gelu": (F.gelu,),
    "silu": (F.silu,),
    "relu": (F.relu, torch.relu, T.relu),
    "tanh": (torch.tanh, T.tanh),
    "sigmoid": (torch.sigmoid, T.sigmoid),
    "softplus": (F.softplus,),
    "dropout": (F.dropout,),
    "exp": (torch.exp, T.exp),
    "log": (torch.log, T.log),
    "sqrt": (torch.sqrt, T.sqrt),
    "rsqrt": (torch.rsqrt, T.rsqrt),
    "sum": (torch.sum, T.sum),
    "mean": (torch.mean, T.mean),
    "cumsum": (torch.cumsum, T.cumsum),
    "nll_loss": (F.nll_loss,),
    "cross_entropy": (F.cross_entropy,),
    "mse_loss": (F.mse_loss,),
    "scaled_dot_product_attention": (F.scaled_dot_product_attention,),
}
_IN_PLACE = {T.add_, T.__iadd__, T.mul_, T.__imul__}


def op_table(bf16_ops=None, fp32_ops=None, dtype=torch.bfloat16) -> dict:
    """callable -> the dtype its inputs are cast to. Unknown names and a name in both lists are
    errors that say so."""
    table, owner = {}, {}
    for names, target in ((bf16_ops or [], dtype), (fp32_ops or [], torch.float32)):
        for name in names:
            if name not in OPS:
                raise InputError(f"unknown op {name!r} in an autocast op list{did_you_mean(name, OPS)}")
            for func in OPS[name]:
                if table.get(func, target) != target:
                    raise InputError(f"op lists disagree: {owner[func]!r} and {name!r} both cover "
                                     f"{getattr(func, '__name__', func)} with different dtypes")
                table[func], owner[func] = target, name
    return table


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


class _OpLists(TorchFunctionMode):
    """Runs each listed op with its floating-point inputs cast to the listed dtype (recorded by
    autograd, so gradients reach the parameters in their own dtype) and torch.autocast paused,
    so that the listed dtype is what the op computes and returns. In-place ops cast only their
    other operands: the tensor they update keeps its dtype."""

    def __init__(self, table: dict, device_type: str) -> None:
        super().__init__()
        self.table, self.device_type = table, device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = self.table.get(func)
        if target is None:
            return func(*args, **kwargs)
        if func in _IN_PLACE:
            args = (args[0], *_cast(args[1:], target))
        else:
            args = _cast(args, target)
        kwargs = {k: _cast(v, target) for k, v in kwargs.items()}
        with torch.autocast(self.device_type, enabled=False):
            return func(*args, **kwargs)


def autocast(device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16, bf16_ops=None,
             fp32_ops=None) -> contextlib.AbstractContextManager:
    """torch.autocast, plus op lists: every op in `bf16_ops` runs in `dtype` and every op in
    `fp32_ops` in float32, whatever torch.autocast would choose; ops in neither list follow
    torch.autocast. Op names are those of Gaudi config files (see OPS)."""
    return _autocast_with(op_table(bf16_ops, fp32_ops, dtype), device_type, dtype)


@contextlib.contextmanager
def _autocast_with(table: dict, device_type: str, dtype: torch.dtype):
    with torch.autocast(device_type=device_type, dtype=dtype):
        if not table:
            yield
            return
        with _OpLists(table, device_type):
            yield


# -- the plugins -------------------------------------------------------------------------------------

class Precision:
    """Full precision: parameters, activations and gradients in float32."""

    compute_dtype = torch.float32
    name = "32-true"
    #: One line for the user at start, or None: bf16 asked for where it is not native.
    notice: str | None = None

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Change the module's layers for this precision (fp8 replaces Linear layers)."""
        return module

    def describe(self) -> str:
        """What the run header names this precision by: its compute dtype."""
        return str(self.compute_dtype).removeprefix("torch.")

    def convert_frozen(self, module: torch.nn.Module, like_trained: bool = False) -> torch.nn.Module:
        """A module that only runs forward beside the trained one (DPO's reference): converted
        as the trained one is, without gradients, in eval mode. `like_trained`: stored in the
        trained one's dtype too, so that its forward takes the same numerical path (GRPO's
        reference, whose KL to the policy is then exactly 0 at the start, as in TRL)."""
        return self.convert_module(module).requires_grad_(False).eval()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class BF16Autocast(Precision):
    """bfloat16 mixed precision through torch.autocast: fp32 master weights and optimizer state,
    matrix products in bfloat16."""

    compute_dtype = torch.bfloat16
    name = "bf16-mixed"

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def forward_context(self):
        return torch.autocast(device_type=self.device_type, dtype=torch.bfloat16)

    def convert_frozen(self, module, like_trained: bool = False):
        """Stored in bfloat16 unless `like_trained`: nothing trains it, so no float32 master is
        needed, and autocast would otherwise cast every weight again at each forward (and hold
        twice the memory)."""
        frozen = super().convert_frozen(module)
        return frozen if like_trained else frozen.to(torch.bfloat16)


class OpListAutocast(BF16Autocast):
    """bf16 autocast with Gaudi-style op lists, applied by hputrain (see `autocast`)."""

    def __init__(self, device_type: str, bf16_ops=None, fp32_ops=None) -> None:
        super().__init__(device_type)
        self.table = op_table(bf16_ops, fp32_ops)  # checked now: a bad name fails before training

    def forward_context(self):
        return _autocast_with(self.table, self.device_type, torch.bfloat16)


class Fp8Mixed(Precision):
    """fp8 matrix products in the eligible Linear layers (see fp8.py), inside a bf16 plugin that
    runs everything else; master weights stay float32."""

    compute_dtype = torch.float8_e4m3fn
    name = "fp8-mixed"

    def __init__(self, bf16: BF16Autocast, accelerator, recipe) -> None:
        self.bf16, self.accelerator, self.recipe = bf16, accelerator, recipe
        self.layers: list[str] = []  # the converted layers' names

    def forward_context(self):
        stack = contextlib.ExitStack()
        stack.enter_context(self.bf16.forward_context())
        stack.enter_context(self.accelerator.fp8_context(self.recipe))
        return stack

    def describe(self) -> str:
        """The dtype, and where the device has no fp8 matrix units that fp8 is emulated there:
        tens of times slower than bf16 on some CPUs, which the header alone would not tell."""
        if self.accelerator.native_fp8():
            return super().describe()
        from .fp8 import emulated

        return f"{super().describe()} ({emulated(self.accelerator.name)})"

    def convert_module(self, module):
        from .fp8 import RULE, convert_to_fp8

        self.layers = convert_to_fp8(module, self.recipe, self.accelerator)
        if not self.layers:  # never train in another precision than the one asked for
            raise InputError(f"fp8=True, but no layer of {type(module).__name__} qualifies: fp8 "
                             f"takes {RULE}")
        return module


def select_precision(settings: PrecisionSettings, config, accelerator) -> Precision:
    """The plugin for TrainingArguments.bf16 / precision / fp8 and the accelerator config
    (use_torch_autocast or the legacy use_habana_mixed_precision, with their op lists). fp8 runs
    inside bf16. precision="auto" means bf16 where the accelerator runs it natively. bf16 asked
    for where it is slow still runs in bf16, with a `notice` saying so."""
    if settings.fp8:
        from .fp8 import Fp8Recipe

        if not accelerator.supports_fp8():
            raise InputError(f"fp8 was asked for, but {accelerator.device_name()} ({accelerator.name}) "
                             f"cannot run fp8 matrix products in execution_mode="
                             f"{accelerator.execution_mode!r}")
        recipe = Fp8Recipe(settings.fp8_scaling, settings.fp8_amax_history_len, settings.minimize_memory)
        plugin = Fp8Mixed(_bf16_plugin(config, accelerator), accelerator, recipe)
    elif settings.bf16 or config.mixed_precision:  # TrainingArguments folds `precision` into bf16
        plugin = _bf16_plugin(config, accelerator)
    else:  # bf16 not asked for: float32, or with precision="auto" bf16 where it is native
        native = settings.precision == AUTO and accelerator.native_bf16()
        return _bf16_plugin(config, accelerator) if native else Precision()
    plugin.notice = bf16_notice(accelerator)  # bf16 was asked for: say so where it is slow
    return plugin


def bf16_notice(accelerator) -> str | None:
    """The line printed at start when bf16 is asked for where the device runs it slowly."""
    shortfall = accelerator.bf16_shortfall()
    if shortfall is None:
        return None
    return f"{shortfall}: use precision='auto' or fp32 (training continues in bf16, as asked)"


def _bf16_plugin(config, accelerator) -> BF16Autocast:
    if not accelerator.supports_bf16():
        raise InputError(f"bf16 was asked for, but {accelerator.device_name()} ({accelerator.name}) "
                         "cannot run bfloat16 autocast")
    lists = config.autocast_bf16_ops or config.autocast_fp32_ops
    if lists and not accelerator.applies_autocast_op_lists:
        return OpListAutocast(accelerator.autocast_device_type, config.autocast_bf16_ops,
                              config.autocast_fp32_ops)
    return BF16Autocast(accelerator.autocast_device_type)
