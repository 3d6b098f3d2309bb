"""The expert-parallel experts forward, registered in transformers' ExpertsInterface as
distributed.expert_parallel.EXPERT_PARALLEL (that module splits the experts and sets it).

Each experts module holds E/N of the model's E experts (its ExpertShard says which); the router
stays whole on every rank. For T tokens routed to k experts each:

1. dispatch: the T·k (token, expert) pairs are written into a send buffer of N·C rows, C = T·m
   per peer, m = min(k, E/N): a token can pick at most m distinct experts of one peer, so the
   pair (t, j) whose expert lives on peer p goes to row p·C + t·m + (how many of t's earlier
   choices also went to p). The buffer's shape depends on T alone, never on the routing; its
   empty rows carry the local expert id E/N (an empty slot, which transformers' implementations
   skip as an expert-parallel sentinel).
2. all-to-all (torch.distributed on the group's backend: Gloo, NCCL, HCCL), differentiable: its
   backward is the reverse all-to-all.
3. the local experts on the received rows, by the experts implementation the model had (H1's
   static-shape one, transformers' grouped_mm, eager), each row to one expert, weight 1.
4. all-to-all back, then on the source rank each pair's row is picked, weighted by the router and
   summed over k, as transformers' implementations do: the router's gradient stays local.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...distributed.expert_parallel import EXPERT_PARALLEL, SHARD_ATTRIBUTE
from .forward import NAME, ExpertWeights, accelerator_of, combine, local_experts, route


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with the given split sizes; backward sends the gradients
    the other way."""

    @staticmethod
    def forward(ctx, tensor, send_sizes, receive_sizes, group):
        ctx.sizes, ctx.group = (send_sizes, receive_sizes), group
        return _exchange(tensor, send_sizes, receive_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        send_sizes, receive_sizes = ctx.sizes
        return _exchange(grad, receive_sizes, send_sizes, ctx.group), None, None, None


def _exchange(tensor: torch.Tensor, send_sizes: list[int], receive_sizes: list[int], group) -> torch.Tensor:
    out = tensor.new_empty((sum(receive_sizes), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), receive_sizes, send_sizes, group=group)
    return out


def dispatch_slots(top_k_index: torch.Tensor, local_experts: int, ranks: int) -> tuple[torch.Tensor, int]:
    """(the send-buffer row of each (token, choice) pair, shape (T, k); the rows per peer C).
    The buffer has ranks·C rows whatever the routing; distinct pairs get distinct rows."""
    tokens, k = top_k_index.shape
    per_token = min(k, local_experts)
    capacity = tokens * per_token
    peer = torch.div(top_k_index, local_experts, rounding_mode="floor")
    chosen = F.one_hot(peer, ranks)  # (T, k, N)
    earlier = (chosen.cumsum(1) - chosen).gather(2, peer.unsqueeze(-1)).squeeze(-1)
    token = torch.arange(tokens, device=top_k_index.device).unsqueeze(1)
    return peer * capacity + token * per_token + earlier, capacity


def expert_parallel_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for (T, H) `hidden_states` routed to `top_k_index` (T, k, global
    expert ids) with `top_k_weights`, computed with the experts spread over the group."""
    shard = getattr(self, SHARD_ATTRIBUTE)
    tokens, hidden = hidden_states.shape
    k, local = top_k_index.shape[-1], shard.local_experts
    slots, capacity = dispatch_slots(top_k_index, local, shard.size)
    rows = slots.reshape(-1)
    pairs = hidden_states.unsqueeze(1).expand(tokens, k, hidden).reshape(tokens * k, hidden)
    send = hidden_states.new_zeros(shard.size * capacity, hidden).index_copy(0, rows, pairs)
    ids = torch.full((shard.size * capacity,), local, dtype=torch.long, device=hidden_states.device)
    ids = ids.index_copy(0, rows, torch.remainder(top_k_index, local).reshape(-1).long())
    send_sizes = [capacity] * shard.size
    receive_sizes = [count * min(k, local) for count in _token_counts(tokens, shard.host_group)]
    received = _AllToAll.apply(send, send_sizes, receive_sizes, shard.group)
    received_ids = _exchange(ids, send_sizes, receive_sizes, shard.group)
    computed = _local_experts(self, shard, received, received_ids)
    back = _AllToAll.apply(computed, receive_sizes, send_sizes, shard.group)
    per_pair = back.index_select(0, rows).view(tokens, k, hidden)
    weighted = per_pair * top_k_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def _token_counts(tokens: int, host_group) -> list[int]:
    """Every rank's token count in the expert-parallel group (a small Gloo all-gather on the
    host): the rows each sends and receives. Equal ranks' batches give equal counts."""
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(host_group))]
    dist.all_gather(counts, torch.tensor([tokens], dtype=torch.int64), group=host_group)
    return [int(count) for count in counts]


def _local_experts(self, shard, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each received row through its local expert (`ids`; the value local_experts: an empty
    slot, whose output is zero), by the implementation the model had: hputrain's static-shape
    steps (forward.py: sort, grouped product, unsort), else transformers' function, which takes
    ids past its experts as expert-parallel sentinels."""
    if shard.inner == NAME:
        routing = route(ids.unsqueeze(1), shard.local_experts)
        out = local_experts(ExpertWeights.of(self), F.embedding(routing.tokens, rows), routing.offsets,
                            accelerator_of(self))
        out = combine(out, routing, None, 1)
    else:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        eager = type(self).forward.__wrapped__  # use_experts_implementation's wrapped forward
        compute = ALL_EXPERTS_FUNCTIONS.get_interface(shard.inner, eager)
        out = compute(self, rows, ids.unsqueeze(1), rows.new_ones(ids.shape[0], 1))
    return out.masked_fill((ids >= shard.local_experts).unsqueeze(1), 0.0)


def register() -> None:
    """Make the expert-parallel forward known to transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERT_PARALLEL, expert_parallel_forward)
