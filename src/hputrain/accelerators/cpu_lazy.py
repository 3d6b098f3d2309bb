"""Lazy mode on the CPU: PyTorch's TorchScript lazy tensor backend standing in for Gaudi's.

The backend is a faithful dry run of a lazy-mode step (ops deferred into a graph, compiled once
per shape, run at mark_step), but it has gaps that Gaudi has not. Left alone, they would show up
as eager fallbacks in every script, or break it; this module routes around each where that is
simple, so that what `hputrain doctor` reports is the user's, not the backend's:

- unbind, split and chunk hand back tensors the backend has lost track of (the next op sees a
  plain CPU tensor); select and narrow give the same views and work. `torch.where(condition)`
  and `nonzero(as_tuple=True)` unbind nonzero's result: they select its columns instead (nonzero
  itself still falls back, as on Gaudi: its shape depends on the data).
- histc has no integer kernel on the CPU (transformers' grouped_mm experts count the tokens per
  expert with it, in int32 off the CPU): an integer input is counted as floats (exact below 2**24).
- grouped_mm (torch._grouped_mm, F.grouped_mm) has neither a lazy kernel nor an eager fallback
  (it fails on the lazy tensors' missing storage): a 2-D input by 3-D groups of weights is done as
  transformers' fallback does it where the kernel is missing, the offsets read back to the host and
  one matmul per group of the sizes they give.
- scaled_dot_product_attention has no kernel; composed of matmul, mask and softmax it stays in
  the graph (the mask inverted by `eq`, since logical_not falls back), a query with nothing to
  attend to giving zeros as torch's kernels do (not softmax's NaN).
- indexing by integer tensors (`mask[batch_idx, kv_idx]`, as transformers builds its attention
  masks; `hidden[window_index, :, :]`, as Qwen-VL's vision tower orders its windows) falls back;
  it is done here as an embedding lookup. Boolean indexing still falls back, as it does on Gaudi
  (its result's shape depends on the data).
- masked_scatter (how transformers' vision-language models put image features in place of image
  tokens) has no lazy kernel and cannot fall back (a view op inside it): it is done as a gather,
  each masked element taking the source element at its rank among the masked ones (a cumsum),
  which keeps the shapes static; Gaudi has a kernel for it.
- AdamW's lerp and clip_grad_norm_'s vector norm fall back to eager ops; both are written here in
  the backend's own ops (Gaudi has FusedAdamW and FusedClipNorm for the same work).
- a 0-dim zeros (torch.zeros, zeros_like, new_zeros) is the backend's uninitialised `empty`
  zeroed in the graph, and that empty enters the graph as a scalar input looked up by its value
  in the backend's data cache: whether its garbage equals another scalar of the graph decides
  whether the two share one input, and so the graph's hash. Left alone, a step that zeroes a
  scalar compiles again from time to time (it changed with PYTHONHASHSEED); the zero is made on
  the host and copied over instead, a fixed value as the trainer's own scalars are.
- torch has no autocast for the lazy device: even a disabled one (`torch.autocast("lazy",
  enabled=False)`, which PEFT's LoRA on parameters opens in every forward) fails. While the
  forward runs, a disabled one there does nothing (_DisabledAutocast); an enabled one is one line
  naming the code that opens it.

The gaps not routed around are listed in BACKEND_FALLBACKS; the doctor leaves them out of its
findings and says so.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..errors import InputError

# The backend's own fallbacks that Gaudi has not, by the name of their lazy counter (`aten::NAME`),
# with where they come from. Each is checked by a single-op test, which fails once torch fills
# the gap, so that the entry can go.
BACKEND_FALLBACKS = {
    "sin": "torch.sin has no lazy kernel (cos has one): every RoPE model computes both",
    "where.self": "torch.where has no lazy kernel",
    "logical_not.out": "logical_not has no lazy kernel",
    "bitwise_not": "`~tensor` has no lazy kernel",
    "logical_and.out": "logical_and has no lazy kernel (`&` on booleans has one); GRPO's masks meet it",
    "lerp.Scalar": "lerp has no lazy kernel: torch.optim.Adam and AdamW call it every step",
    "amax": "amax has no lazy kernel: GRPO's clip_ratio/low_min and high_max take it",
    "amin": "amin has no lazy kernel: GRPO's clip_ratio/low_min and high_max take it",
    "scatter.src": "scatter of a tensor of values has no lazy kernel: topk's backward, and so every "
                   "mixture-of-experts router's, takes it",
    "scatter.value": "scatter of one value has no lazy kernel: one_hot, and DeepSeek-V3's router's group "
                     "mask, take it",
    # torch's math attention (what nn.MultiheadAttention, and so nn.TransformerEncoderLayer, runs
    # off CUDA) zeroes the rows that attend to nothing in _safe_softmax, with these three
    "all.dim": "`tensor.all(dim)` has no lazy kernel: nn.MultiheadAttention's softmax takes it",
    "isneginf": "isneginf has no lazy kernel: nn.MultiheadAttention's softmax takes it",
    "where.self_out": "torch.where into an output tensor has no lazy kernel: nn.MultiheadAttention's "
                      "softmax writes its result with it",
}


class LazyBackendGaps(TorchFunctionMode):
    """Entered around the forward pass: replaces the view ops, attention, indexing and scalar
    zeros described above, and, while it is on, torch.autocast with _DisabledAutocast (a class
    cannot be replaced as a function is). A mode, not a context: a checkpointed block's
    recomputation in backward enters it again (distributed/activation_checkpointing.py)."""

    def __enter__(self):
        self._saved = [*getattr(self, "_saved", []), (torch.autocast, torch.amp.autocast)]
        torch.autocast = torch.amp.autocast = _DisabledAutocast
        return super().__enter__()

    def __exit__(self, *exc):
        torch.autocast, torch.amp.autocast = self._saved.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        replacement = _REPLACEMENTS.get(func)
        return (replacement or func)(*args, **kwargs)


@contextlib.contextmanager
def lazy_forward():
    """The forward pass on the lazy backend: its gaps routed around (LazyBackendGaps), a disabled
    `torch.autocast` on the lazy device taken as the nothing it asks for (_DisabledAutocast), and
    the one gap that cannot be, an enabled autocast there, said in one line naming the code that
    opens it instead of torch's "unsupported scalarType"."""
    try:
        with LazyBackendGaps():
            yield
    except RuntimeError as error:
        opener = _autocast_opener(error)
        if opener is None:
            raise
        raise InputError(f"lazy mode on the CPU cannot run this model: {opener} opens torch.autocast "
                         "on the lazy device, which torch has no autocast for (Gaudi's lazy mode "
                         "has): use --execution-mode eager to train it on the CPU") from None


class _DisabledAutocast(torch.autocast):
    """torch.autocast, whose disabled form on the lazy device does nothing. torch has no autocast
    for the lazy device, so even `autocast("lazy", enabled=False)`, which asks for nothing (no
    autocast is on there), fails with "unsupported scalarType". PEFT's LoRA on parameters
    (target_parameters: LoRA on the experts) opens one in every forward, around its fold of the
    adapters into the weight (peft/tuners/lora/layer.py's _LoraFactorsProxy), and transformers
    before 5.0 in every rotary embedding."""

    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        self._nothing = device_type == "lazy" and not enabled
        if not self._nothing:
            super().__init__(device_type, dtype, enabled, cache_enabled)

    def __enter__(self):
        return self if self._nothing else super().__enter__()

    def __exit__(self, *exc):
        return False if self._nothing else super().__exit__(*exc)


def _autocast_opener(error: BaseException) -> str | None:
    """The code that opened the torch.autocast `error` was raised in (a library's path from its
    package, or the file's name, and the line), or None where it was not raised in autocast."""
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    names = [f.f_code.co_filename.replace("\\", "/") for f in frames]
    if not names or not names[-1].endswith("amp/autocast_mode.py"):
        return None
    callers = [(name, f) for name, f in zip(names, frames)
               if not name.endswith(("amp/autocast_mode.py", "accelerators/cpu_lazy.py"))]
    if not callers:
        return "the model"
    name, frame = callers[-1]
    where = name.split("site-packages/")[-1] if "site-packages/" in name else name.rsplit("/", 1)[-1]
    return f"{where}:{frame.f_lineno}"


def _unbind(tensor, dim=0):
    return tuple(tensor.select(dim, i) for i in range(tensor.size(dim)))


def _split(tensor, split_size_or_sections, dim=0):
    size = tensor.size(dim)
    if isinstance(split_size_or_sections, int):
        sections = [min(split_size_or_sections, size - start)
                    for start in range(0, size, split_size_or_sections)]
    else:
        sections = list(split_size_or_sections)
    starts = [sum(sections[:i]) for i in range(len(sections))]
    return tuple(tensor.narrow(dim, start, length) for start, length in zip(starts, sections))


def _chunk(tensor, chunks, dim=0):
    return _split(tensor, -(-tensor.size(dim) // chunks), dim)


def _where(condition, *values, **kwargs):
    """`torch.where(condition)` as nonzero's columns, selected; with values, torch.where."""
    if values or kwargs or condition.device.type != "lazy":
        return torch.where(condition, *values, **kwargs)
    found = torch.nonzero(condition)
    return tuple(found.select(1, i) for i in range(found.size(1)))


def _nonzero(tensor, *, as_tuple=False, **kwargs):
    return _where(tensor) if as_tuple and not kwargs else torch.nonzero(tensor, as_tuple=as_tuple, **kwargs)


def _histc(tensor, *args, **kwargs):
    if tensor.device.type != "lazy" or tensor.is_floating_point() or "out" in kwargs:
        return torch.histc(tensor, *args, **kwargs)
    return torch.histc(tensor.float(), *args, **kwargs).to(tensor.dtype)


def _grouped_mm(func):
    """`func` (a grouped matmul) whose (S, K) input by (G, K, N) weights on the lazy device is one
    matmul per group, of the rows `offs` gives each (read back: the shapes follow the data)."""
    def grouped(mat_a, mat_b, *args, offs=None, bias=None, out_dtype=None):
        if (mat_a.device.type != "lazy" or args or offs is None or bias is not None
                or mat_a.dim() != 2 or mat_b.dim() != 3):
            return func(mat_a, mat_b, *args, offs=offs, bias=bias, out_dtype=out_dtype)
        pieces, start = [], 0
        for group, end in enumerate(offs.tolist()):
            if end > start:
                pieces.append(mat_a.narrow(0, start, end - start) @ mat_b.select(0, group))
            start = end
        if start < mat_a.size(0) or not pieces:  # rows past the last offset: zeros (the kernel's unset)
            pieces.append(mat_a.new_zeros(mat_a.size(0) - start, mat_b.size(-1)))
        out = torch.cat(pieces)
        return out if out_dtype is None else out.to(out_dtype)
    return grouped


def _composed_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False):
    if enable_gqa and k.size(-3) != q.size(-3):
        repeat = q.size(-3) // k.size(-3)
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    scale = scale if scale is not None else q.size(-1) ** -0.5
    scores = (q @ k.transpose(-2, -1)) * scale
    if is_causal:
        length, source = q.size(-2), k.size(-2)
        future = torch.ones(length, source, dtype=torch.bool, device=q.device).triu(source - length + 1)
        scores = scores.masked_fill(future, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(attn_mask.eq(False), float("-inf"))
                  if attn_mask.dtype == torch.bool else scores + attn_mask)
    # a query that may attend to nothing (a left-padded prompt's padding) gets zeros, as torch's
    # own kernels give it: softmax over a row of -inf would be NaN, which the next layer's keys
    # and values carry into every position (0 x NaN); `max` stays in the graph, `amax` does not
    dead = scores.detach().max(dim=-1, keepdim=True).values.eq(float("-inf"))
    probs = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return probs @ v


def _getitem(tensor, index):
    """`tensor[i, j, ...]` with integer tensors i, j, ... (broadcast against each other) as one
    row lookup in the indexed dimensions flattened; any other index as before."""
    indices = index if isinstance(index, tuple) else (index,)
    while len(indices) > 1 and isinstance(indices[-1], slice) and indices[-1] == slice(None):
        indices = indices[:-1]  # tensor[i, :, :] is tensor[i]
    integer = (torch.int8, torch.int16, torch.int32, torch.int64)  # uint8 and bool index as masks
    if len(indices) > tensor.dim() or not all(isinstance(i, torch.Tensor) and i.dtype in integer
                                              for i in indices):
        return torch.Tensor.__getitem__(tensor, index)
    sizes = tensor.shape[:len(indices)]
    linear = None  # not a torch.zeros(()) start: see _host_zero
    for i, size in zip(indices, sizes):
        i = i.to(tensor.device).remainder(size)  # negative: from the end
        linear = i if linear is None else linear * size + i
    rest = tensor.shape[len(indices):]
    # an embedding lookup, whose backward the backend has (index_select's, index_add, it has not)
    rows = F.embedding(linear.reshape(-1), tensor.reshape(sizes.numel(), -1))
    return rows.reshape(*linear.shape, *rest)


def _masked_scatter(tensor, mask, source):
    """`tensor.masked_scatter(mask, source)` on the lazy device: each element where `mask`
    (broadcast to tensor's shape) is True takes source's element at its rank among them, in
    row-major order, as the op does; the rest of source is never read."""
    if tensor.device.type != "lazy":
        return torch.Tensor.masked_scatter(tensor, mask, source)
    mask = mask.expand(tensor.shape)
    rank = (mask.reshape(-1).long().cumsum(0) - 1).clamp(min=0)
    values = F.embedding(rank, source.reshape(-1, 1)).reshape(tensor.shape)
    return tensor.masked_fill(mask, 0) + values.masked_fill(mask.eq(False), 0)


def _host_zero(func):
    """`func` (a zeros factory) whose 0-dim result on the lazy device is a zero copied from the
    host rather than the backend's zeroed garbage (see the module's docstring)."""
    def zeros(*args, **kwargs):
        result = func(*args, **kwargs)
        if result.dim() or result.device.type != "lazy" or "out" in kwargs:
            return result
        zero = torch.zeros((), dtype=result.dtype).to(result.device)
        return zero.requires_grad_() if result.requires_grad else zero
    return zeros


_REPLACEMENTS = {
    torch.zeros: _host_zero(torch.zeros), torch.zeros_like: _host_zero(torch.zeros_like),
    torch.Tensor.new_zeros: _host_zero(torch.Tensor.new_zeros),
    torch.unbind: _unbind, torch.Tensor.unbind: _unbind,
    torch.split: _split, torch.Tensor.split: _split,
    torch.chunk: _chunk, torch.Tensor.chunk: _chunk,
    torch.where: _where, torch.nonzero: _nonzero, torch.Tensor.nonzero: _nonzero,
    torch.histc: _histc, torch.Tensor.histc: _histc,
    **{f: _grouped_mm(f) for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f},
    F.scaled_dot_product_attention: _composed_attention,
    torch.Tensor.__getitem__: _getitem,
    torch.masked_scatter: _masked_scatter, torch.Tensor.masked_scatter: _masked_scatter,
}


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) in ops the lazy backend has: the same
    update as torch.optim.AdamW, checked against it in the tests. `bias_correction=False` (an
    option of Gaudi's FusedAdamW) leaves the moments uncorrected."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 bias_correction=True):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "bias_correction": bias_correction})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1  # a host int: the graph sees the bias corrections as constants
                step, grad = state["step"], param.grad
                bias1, bias2 = ((1 - beta1**step, 1 - beta2**step) if group.get("bias_correction", True)
                                else (1.0, 1.0))
                param.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (state["exp_avg_sq"] / bias2).sqrt_().add_(group["eps"])
                param.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias1)
        return loss


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ (2-norm, in place) in ops the lazy backend has; returns the total norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.stack([g.detach().pow(2).sum() for g in grads]).sum().sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.detach().mul_(scale)
    return total


# -- what `hputrain doctor` watches ------------------------------------------------------------------

# Tensor methods that bring a value back to the host.
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu,
          torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__index__, torch.Tensor.__repr__, torch.Tensor.__format__}


class HostReads(TorchFunctionMode):
    """Counts reads of lazy tensors back to the host while `in_step` is set, by where they happen:
    `locate(name)` is called inside the read (name: the method, e.g. "item") and its answer, any
    hashable value, is the key of `where`."""

    def __init__(self, locate) -> None:
        super().__init__()
        self.locate = locate
        self.in_step = False
        self.count = 0
        self.where: dict = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reads = func in _READS or (func is torch.Tensor.to and _to_host(args, kwargs))
        if self.in_step and reads and any(_is_lazy(a) for a in args):
            self.count += 1
            place = self.locate(getattr(func, "__name__", str(func)))
            self.where[place] = self.where.get(place, 0) + 1
        return func(*args, **kwargs)


def _is_lazy(value) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "lazy"


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def lazy_counters() -> dict[str, int]:
    """The lazy backend's counters: UncachedCompile (graphs compiled), aten::OP (ops run eagerly
    because no graph could hold them; aten::_local_scalar_dense is a value read back)."""
    from torch._lazy import metrics

    return {name: metrics.counter_value(name) for name in metrics.counter_names()}
