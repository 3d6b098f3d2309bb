"""Context parallelism: the sequence dimension split across a group of processes.

Each rank of a context-parallel (cp) group holds a contiguous slice of every sequence, with its
global positions. Attention all-gathers keys and values across the group (the gradient flows back
to the rank that owns each slice), applies the causal mask with global positions, and returns the
local slice. Everything else in a transformer (embeddings, MLPs, norms, the loss) is per position
and needs nothing; so activations per rank fall to about 1/cp.

`context_parallel_attention` is usable from any model and any process group; `ContextParallel`
is the trainer's piece, on the mesh's "cp" dimension (ProcessGroup.cp_group): it slices batches
and, during the forward pass, makes the group known to attention. An attention function that
asks for it (`active_group`, `attend_in_group`: hputrain's attention for Hugging Face models in
kernels.py) calls the context-parallel attention itself, with the device's kernel; any other
model's causal `F.scaled_dot_product_attention` calls are intercepted and routed there.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from ..errors import InputError


class _Active:
    """The cp group of the forward pass under way (None outside one), and whether the attention
    now running handles it itself (so that its own SDPA call is not intercepted a second time).
    Plain attributes, not ContextVars: torch.compile traces through attribute reads (a guard on
    the value) but breaks its graph at every ContextVar.get."""

    group = None
    handled = False


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim -2 (the sequence of a (batch, heads, seq, dim) tensor). Backward: the
    gradient of the full tensor is summed over the group, and each rank keeps its own slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        ctx.size, ctx.rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        # all_reduce, then slice: Gloo has no reduce_scatter, and the result is the same.
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=-2)[ctx.rank].contiguous(), None


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    return _GatherSequence.apply(local, group)


def _torch_attention(q, k, v, mask, scale, dropout_p):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)


def context_parallel_attention(q, k, v, group, dropout_p: float = 0.0, scale: float | None = None,
                               attend=_torch_attention):
    """Causal attention of this rank's query slice over the whole sequence.

    q, k, v: (batch, heads, local_len, head_dim), rank r of the group holding positions
    [r * local_len, (r + 1) * local_len). Returns (batch, heads, local_len, head_dim), equal to the
    matching slice of unsplit causal attention. `attend(q, k, v, mask, scale, dropout_p)` is the
    kernel that attends over the gathered keys (a boolean mask, True where a key is visible).

    The gathered keys and values, and the (local_len × keys) probabilities of a masked attention
    (which cannot use the fused kernels `is_causal` gets), would be kept for backward on every
    layer: as large as without the split. So the gather and the attention are recomputed in backward
    (activation checkpointing): a rank keeps only its own q, k, v slices, at the price of one more
    all-gather per layer in backward.
    """
    return checkpoint(_attend_over_gathered, q, k, v, group, dropout_p, scale, attend, use_reentrant=False)


def _attend_over_gathered(q, k, v, group, dropout_p: float, scale: float | None, attend):
    rank, local_len = dist.get_rank(group), q.size(-2)
    visible = (rank + 1) * local_len  # later keys are all masked for this rank's queries
    keys = gather_sequence(k, group)[..., :visible, :]
    values = gather_sequence(v, group)[..., :visible, :]
    query_pos = torch.arange(local_len, device=q.device) + rank * local_len
    allowed = torch.arange(visible, device=q.device)[None, :] <= query_pos[:, None]
    return attend(q, keys, values, allowed, scale, dropout_p)


def active_group():
    """The context-parallel group of the forward pass under way, or None."""
    return _Active.group


def attend_in_group(q, k, v, dropout_p: float, scale: float | None, attend):
    """`context_parallel_attention` in the active group, for an attention function that handles
    context parallelism itself with its own kernel `attend` (see context_parallel_attention)."""
    _Active.handled = True
    try:
        return context_parallel_attention(q, k, v, _Active.group, dropout_p, scale, attend)
    finally:
        _Active.handled = False


class _RouteCausalAttention(TorchFunctionMode):
    """Sends causal scaled_dot_product_attention calls to context_parallel_attention."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not _Active.handled:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **rest):
        if not is_causal or attn_mask is not None or rest.get("enable_gqa"):
            raise InputError("context parallelism supports causal self-attention "
                             "(scaled_dot_product_attention with is_causal=True and no mask)")
        return context_parallel_attention(q, k, v, self.group, dropout_p, scale)


class NoContextParallel:
    """context_parallel_size 1: whole sequences, attention as written."""

    def shard(self, batch):
        return batch

    def forward_context(self):
        return contextlib.nullcontext()


class ContextParallel(NoContextParallel):
    """The trainer's side: which slice of each sequence this rank trains on, and the forward
    context that makes attention see the whole sequence. The sequence dimension is dim 1 of every
    batch tensor with at least two dimensions."""

    def __init__(self, group, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def shard(self, batch: dict) -> dict:
        if not isinstance(batch, dict):
            raise InputError("context parallelism needs dict batches (input_ids, labels, ...)")
        length = batch["input_ids"].size(1)
        if length % self.size:
            raise InputError(f"sequence length {length} is not divisible by context_parallel_size "
                             f"{self.size}: pad sequences to a multiple of it")
        local = length // self.size
        start = self.rank * local
        sharded = {key: value[:, start:start + local] if _is_sequence(value, length) else value
                   for key, value in batch.items()}
        # (batch, local) as Hugging Face models take them (the built-in GPT broadcasts any shape)
        positions = torch.arange(start, start + local, device=batch["input_ids"].device)
        sharded["position_ids"] = positions.expand(batch["input_ids"].size(0), -1).contiguous()
        return sharded

    @contextlib.contextmanager
    def forward_context(self):
        outer, _Active.group = _Active.group, self.group
        try:
            with _RouteCausalAttention(self.group):
                yield
        finally:
            _Active.group = outer


def _is_sequence(value, length: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == length


def context_parallel_of(group, inputs: frozenset[str] | None) -> NoContextParallel:
    """The context parallelism of a run on `group` (its cp_size, cp_group, cp_rank): none when
    the size is 1; else one line when the model's forward (its keyword `inputs`) takes no
    position_ids (each rank holds a slice of the sequence at an offset)."""
    if group.cp_size == 1:
        return NoContextParallel()
    if inputs is not None and "position_ids" not in inputs:
        raise InputError("context parallelism needs a model whose forward takes position_ids "
                         "(each rank holds a slice of the sequence at an offset)")
    return ContextParallel(group.cp_group, group.cp_rank, group.cp_size)
