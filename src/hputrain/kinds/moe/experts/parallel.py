"""The expert-parallel experts forward, registered in transformers' ExpertsInterface as
distributed.expert_parallel.EXPERT_PARALLEL (that module splits the experts and sets it).

Each experts module holds L = E/N of the model's E experts (its ExpertShard says which); the router
stays whole on every rank. For T tokens routed to k experts each (sizes.py has the arithmetic):

1. dispatch: each (token, expert) pair whose expert lives on peer p takes the next row of p's
   block in the send buffer, in pair order (a running count per peer, on the device). Each block
   has C = min(⌈f·T·k/N⌉, T·min(k, L)) rows (f: `expert_capacity_factor`, 1.25 unless set), T
   the largest of the group's token counts, so the buffer (N·C rows) is f times the pairs a rank
   receives on average, whatever the routing. Empty rows carry the local expert id L: an empty
   slot, which every implementation skips (or computes with weight 0: see `_local_experts`).
2. the sizes, agreed once a forward of the whole model (kinds/moe/expert_parallel.py's
   `OnceAForward`, which runs the forward of the module holding every MoE layer), not once a layer: T by
   one all-reduce of one host integer on the group's Gloo ranks (no device sync) at the first MoE
   layer; the same C for every layer. Pairs past a block's C go to a row after the buffer, never
   sent, and set a flag on the device. After the model's forward, one all-reduce of that flag over
   every rank and one read back: none set (the usual case), the output stands; one set, the whole
   forward runs again on the exact path below, counted and said on stderr (the first, then every
   tenfold), so nothing is dropped. At f ≥ N·min(k, L)/k no routing can overflow: no flag, no
   read. The exact path (a forward run again, a decode step with a cache, experts called outside a
   model's forward) agrees per layer: one all-reduce of two numbers (the group's largest T and
   the most pairs a rank sends a peer) read back, and pairs past C go in a second exchange of O
   rows a peer (the overflow rounded up to a power of two, a few shapes). A recompute in backward
   reuses its forward's sizes. A group of one rank exchanges nothing and reads nothing.
3. all-to-all (torch.distributed on the group's backend: Gloo, NCCL, HCCL), differentiable: its
   backward is the reverse all-to-all.
4. the local experts on the received rows, by the experts implementation the model had (the
   static-shape one, transformers' grouped_mm, eager), each row to one expert, weight 1.
5. all-to-all back, then on the source rank each pair's row is picked, weighted by the router
   and summed over k, as transformers' implementations do: the router's gradient stays local.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..expert_parallel import EXPERT_PARALLEL, OVERFLOWS, SHARD_ATTRIBUTE, note_overflow
from .forward import NAME, ExpertWeights, accelerator_of, combine, local_experts, route
from .grouped import autocast_on
from .sizes import CAPACITY_FACTOR, holds_any_routing, peer_capacity, worst_per_peer


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


def dispatch_slots(top_k_index: torch.Tensor, local_experts: int, ranks: int):
    """Each (token, choice) pair's peer and its place among the pairs this rank sends that peer
    (in pair order), both (T, k), and how many pairs go to each peer (N,): comparisons and a
    running sum on the device (no one_hot, which reads the largest class back on some devices,
    and no division, which the lazy backends run eagerly)."""
    experts = top_k_index.long()
    bounds = torch.arange(1, ranks, device=experts.device) * local_experts
    peer = (experts.unsqueeze(-1) >= bounds).sum(-1)  # (T, k)
    chosen = (peer.reshape(-1, 1) == torch.arange(ranks, device=experts.device)).long()  # (T·k, N)
    place = ((chosen.cumsum(0) - chosen) * chosen).sum(1).view_as(peer)
    return peer, place, chosen.sum(0)


class _Decision:
    """One layer's exchange sizes (C, O), kept for its recompute in backward. `checked`: sized by
    the forward's agreement, pairs past C go to the spare row after the buffer (and the forward
    runs again: OnceAForward)."""

    def __init__(self, capacity: int, overflow: int, checked: bool = False) -> None:
        self.capacity, self.overflow, self.checked = capacity, overflow, checked


def _sizes(self, shard, tokens: int, k: int, place: torch.Tensor, counts: torch.Tensor) -> _Decision:
    """The exchange's rows per peer: agreed once a forward (OnceAForward) inside a model's forward,
    else by the group here (C from its largest token count, O: 0 unless some rank has more than C
    pairs for a peer). A recompute in backward (activation checkpointing) reuses its forward's:
    the same inputs, and no collective the others skip."""
    kept = getattr(self, "_hputrain_exchange", None)
    if kept is not None and torch._C._current_graph_task_id() != -1:
        return kept
    once = shard.once_a_forward
    if once is not None and once.attempting:
        decision = _decide(once, shard, tokens, k, place)
    else:
        most_tokens, most_rows = _agree(tokens, counts.max(), shard.group)
        capacity = peer_capacity(most_tokens, k, shard.num_experts, shard.size, _factor(once))
        over = max(0, most_rows - capacity)
        if over:
            worst = worst_per_peer(most_tokens, k, shard.num_experts, shard.size) - capacity
            over = min(worst, max(8, 1 << (over - 1).bit_length()))
            note_overflow("exchanges", shard.rank, f"a second exchange of {over} rows a peer carried them")
        decision = _Decision(capacity, over)
    self._hputrain_exchange = decision
    return decision


def _agree(tokens: int, most_rows: torch.Tensor, group) -> tuple[int, int]:
    """(the largest token count, the most pairs one rank sends one peer) over the group: one
    all-reduce of two numbers on the group's device, read back."""
    both = torch.stack([most_rows.new_tensor(tokens), most_rows]).long()
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    most_tokens, most_rows = both.tolist()
    return int(most_tokens), int(most_rows)


def _largest(tokens: int, host_group) -> int:
    """The group's largest token count: one all-reduce of a host integer on its Gloo ranks."""
    count = torch.tensor([tokens])
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=host_group)
    return int(count)


def _decide(once, shard, tokens: int, k: int, place: torch.Tensor) -> _Decision:
    """Inside a model's forward (the body's OnceAForward attempting): C from the token count the
    group agreed at this forward's first MoE layer, the same for every layer; pairs past it set
    the forward's flag (unless no routing can overflow)."""
    once.rank = shard.rank
    if once.tokens is None:
        once.tokens, once.own = _largest(tokens, shard.host_group), tokens
    elif tokens != once.own:
        raise RuntimeError(f"expert parallelism: the MoE layers of one forward saw {once.own} and "
                           f"{tokens} tokens; their exchange is sized once a forward")
    factor = _factor(once)
    capacity = peer_capacity(once.tokens, k, shard.num_experts, shard.size, factor)
    # the same answer on every rank of every group (k, E, N and f are the run's): the flag's
    # all-reduce is made by all or by none
    checked = not holds_any_routing(k, shard.num_experts, shard.size, factor)
    if checked:
        once.flag_past((place >= capacity).any())
    return _Decision(capacity, 0, checked)


def _factor(once) -> float:
    return CAPACITY_FACTOR if once is None or once.factor is None else once.factor


def overflow_exchanges() -> int:
    """How many second exchanges this process has run (the exact path: module docstring, step 2)."""
    return OVERFLOWS["exchanges"]


def expert_parallel_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output for (T, H) `hidden_states` routed to `top_k_index` (T, k, global
    expert ids) with `top_k_weights`, computed with the experts spread over the group."""
    shard = getattr(self, SHARD_ATTRIBUTE)
    tokens, hidden = hidden_states.shape
    k, local, ranks = top_k_index.shape[-1], shard.local_experts, shard.size
    peer, place, counts = dispatch_slots(top_k_index, local, ranks)
    if ranks == 1:  # a group of one: nothing to exchange, nothing to agree on
        sizes = _Decision(tokens * k, 0)
    else:
        sizes = _sizes(self, shard, tokens, k, place, counts)
    capacity, over = sizes.capacity, sizes.overflow
    first = (place < capacity).long()
    total = ranks * (capacity + over)
    # each pair's row: in the first buffer (N·C rows), else in the second (after it), or, sized
    # once a forward, the spare row after the buffer (never sent; the forward runs again)
    past = total if sizes.checked else ranks * capacity + peer * over + place - capacity
    rows = (first * (peer * capacity + place) + (1 - first) * past).reshape(-1)
    spare = int(sizes.checked)
    # each pair written to its own row: an add into zeros (scatter_add, which the lazy backends
    # hold in their graph and whose backward keeps only the rows, not the pairs as index_copy's)
    pairs = hidden_states.unsqueeze(1).expand(tokens, k, hidden).reshape(tokens * k, hidden)
    pairs = pairs.to(_sent_dtype(shard, hidden_states))
    send = pairs.new_zeros(total + spare, hidden).scatter_add(0, rows.unsqueeze(1).expand(-1, hidden), pairs)
    ids = torch.full((total + spare,), local, dtype=torch.long, device=hidden_states.device)
    ids = ids.scatter_add(0, rows, (top_k_index.long() - (peer + 1) * local).reshape(-1))
    blocks = [capacity] * ranks + [over] * ranks * (over > 0)
    received, received_ids = _swap(send, blocks, shard), _swap(ids, blocks, shard, False)
    computed = _local_experts(self, shard, received, received_ids)
    back = _swap(computed, blocks, shard)
    per_pair = F.embedding(rows.clamp(max=total - 1) if spare else rows, back).view(tokens, k, hidden)
    weighted = per_pair * top_k_weights.unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def _sent_dtype(shard, hidden_states: torch.Tensor) -> torch.dtype:
    """The dtype the pairs travel in: under autocast, the one hputrain's experts compute in
    (bf16: half the bytes of a float32 residual stream; each pair is cast before the sum of its
    token's gradients, as one process casts each row), else the hidden states' own."""
    device = hidden_states.device.type
    if shard.inner == NAME and autocast_on(device):
        return torch.get_autocast_dtype(device)
    return hidden_states.dtype


def _swap(tensor: torch.Tensor, blocks: list[int], shard, differentiable: bool = True) -> torch.Tensor:
    """Block i of `tensor` (the first exchange's N blocks, then the second's, if any) to peer i
    mod N, and the peers' blocks for this rank in their place: one all-to-all per exchange, of
    the same sizes on every rank (agreed), so that what is sent equals what is received. A group
    of one rank keeps its tensor."""
    ranks = shard.size
    if ranks == 1:
        return tensor
    out = []
    for first in range(0, len(blocks), ranks):
        sizes = blocks[first:first + ranks]
        part = tensor.narrow(0, sum(blocks[:first]), sum(sizes))
        if differentiable:
            out.append(_AllToAll.apply(part, sizes, sizes, shard.group))
        else:
            out.append(_exchange(part, sizes, sizes, shard.group))
    return out[0] if len(out) == 1 else torch.cat(out)


def _local_experts(self, shard, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each received row through its local expert (`ids`; the value local_experts: an empty
    slot, whose output is zero), by the implementation the model had: hputrain's static-shape
    steps (forward.py: sort, grouped product, unsort), else transformers' function. Its
    grouped_mm and batched_mm take ids past the experts as expert-parallel sentinels; its eager
    loops (GPT-OSS's among them) do not (one_hot over the local experts): they get empty slots on
    the last local expert with routing weight 0."""
    empty = ids >= shard.local_experts
    if shard.inner == NAME:
        routing = route(ids.unsqueeze(1), shard.local_experts)
        out = local_experts(ExpertWeights.of(self), F.embedding(routing.tokens, rows), routing.offsets,
                            accelerator_of(self), padded=True)
        out = combine(out, routing, None, 1)
    else:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        eager = type(self).forward.__wrapped__  # use_experts_implementation's wrapped forward
        compute = ALL_EXPERTS_FUNCTIONS.get_interface(shard.inner, eager)
        weights = rows.new_ones(ids.shape[0], 1)
        if shard.inner not in _TAKE_SENTINELS:
            ids, weights = ids.clamp(max=shard.local_experts - 1), (~empty).to(rows.dtype).unsqueeze(1)
        out = compute(self, rows, ids.unsqueeze(1), weights)
    return out.masked_fill(empty.unsqueeze(1), 0.0)


#: transformers' experts functions that skip expert-parallel sentinel ids themselves
_TAKE_SENTINELS = ("grouped_mm", "batched_mm")


def register() -> None:
    """Make the expert-parallel forward known to transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERT_PARALLEL, expert_parallel_forward)
