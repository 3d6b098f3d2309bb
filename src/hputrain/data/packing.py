"""Packing tokenized examples into blocks without cross-talk, and the attention mask that keeps
each example to itself.

`pack` puts whole examples ({"input_ids", "labels"}, from sft.py) into blocks of block_size
tokens by best-fit decreasing, which leaves little padding. Every block is four int64 tensors of
block_size, so every batch of blocks is [batch, block_size] and lazy mode and graphs see one shape:

  input_ids     the examples one after another, then pad_token_id
  labels        the examples' labels, -100 on each example's first token and on the padding
  position_ids  0, 1, ... restarting at each example (and at the padding)
  seq_lens      the examples' lengths, then zeros (segment_ids and block_causal_mask read it)

An example longer than a block is cut to its first block_size tokens and counted; one with nothing
left to learn after the cut is left out and counted. `unpacked` is the packing=False path: one
example per row, padded by PadToBuckets to a few lengths.

`pack` and `unpacked` take lists and make every block at once (the Python API's small data sets).
`pack_ragged` and `unpacked_ragged` give the same blocks and rows from examples kept flat in
int32 arrays (token_store.Ragged, memory-mapped from the recipe's cache) and hold only the
packing plan: each block is built by `fill_block` when it is read, so a data set costs a few
bytes an example per rank instead of 32 bytes a token, and the ranks of a node share the tokens.

Restarting positions alone do not keep attention inside an example. transformers (5.x) derives a
block-diagonal mask from position_ids only when it gets no attention_mask and no KV cache; a
causal LM's forward in training mode still builds a cache when use_cache is left at the config's
default (True), and then every token attends to the examples before it in its block. Pass
`block_causal_mask(seq_lens, dtype=...)` as attention_mask: a 4-D mask is used as it is, on the
eager and sdpa paths, whatever use_cache says.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError
from .batching import PadToBuckets
from .token_store import Ragged

IGNORE_INDEX = -100
"""Label of a token the loss leaves out."""


@dataclass
class PackingStats:
    """What packing (or padding) did to a list of examples."""

    examples: int = 0
    """Examples in the blocks (or rows)."""
    blocks: int = 0
    """Blocks (or rows) made."""
    truncated: int = 0
    """Examples longer than a block, cut to its length."""
    labels_cut: int = 0
    """Learned tokens (labels other than -100) of the cut examples that the cut left out."""
    nothing_to_learn: int = 0
    """Examples left out because the cut removed every learned token."""
    tokens: int = 0
    """Example tokens in the blocks."""
    padding: int = 0
    """Padding tokens in the blocks (unpacked: none until batches are padded)."""

    @property
    def padding_fraction(self) -> float:
        total = self.tokens + self.padding
        return self.padding / total if total else 0.0

    def add(self, other: PackingStats) -> None:
        """Count `other`'s (another split's) in these: every count, a subclass's too, but the
        ones that describe the shape both share (`SHARED`)."""
        for f in dataclasses.fields(self):
            if f.name not in self.SHARED:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    SHARED = ()
    """Fields both splits have alike (not summed by `add`)."""


def truncate(examples: list[dict], max_length: int) -> tuple[list[dict], PackingStats]:
    """The examples cut to at most max_length tokens (keeping the start), those with no learned
    token left out; the stats count both."""
    if not isinstance(max_length, int) or max_length < 1:
        raise InputError(f"the block size or maximum length must be a whole number of at least 1, "
                         f"got {max_length!r}")
    stats, kept = PackingStats(), []
    for example in examples:
        if len(example["input_ids"]) > max_length:
            stats.truncated += 1
            stats.labels_cut += sum(label != IGNORE_INDEX for label in example["labels"][max_length:])
            example = {"input_ids": example["input_ids"][:max_length],
                       "labels": example["labels"][:max_length]}
        if all(label == IGNORE_INDEX for label in example["labels"][1:]):
            stats.nothing_to_learn += 1
            continue
        kept.append(example)
    stats.examples = len(kept)
    stats.tokens = sum(len(e["input_ids"]) for e in kept)
    return kept, stats


def best_fit_decreasing(lengths: list[int], capacity: int, counts: list[int] | None = None,
                        slots: int = 0, order: list[int] | None = None) -> list[list[int]]:
    """Bins of indices into `lengths`, each bin's lengths summing to at most `capacity`: longest
    first, each into the open bin it fills the most (among equals, the one that has had that room
    longest), or else a new bin.
    With `counts` (each item's images), a bin also holds items of at most `slots` counts in all:
    an item goes into the open bin it fills the most among those with the slots it needs (among
    equal rooms, the one with the fewest slots left). `order`: the order in which the items are
    placed, instead of longest first.
    Bins come in the order they were opened, their indices in the order they were placed."""
    if any(n < 1 or n > capacity for n in lengths):
        raise ValueError(f"every length must be between 1 and the capacity {capacity}")
    if counts is None:
        counts = [0] * len(lengths)
    elif len(counts) != len(lengths) or any(c < 0 or c > slots for c in counts):
        raise ValueError(f"every count must be between 0 and the slots {slots}")
    if order is None:
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    free: list[int] = []
    open_bins = [_OpenBins(capacity) for _ in range(slots + 1)]  # by the slots a bin has left
    for i in order:
        b = _best_open(open_bins, lengths[i], counts[i])
        if b is None:
            b = len(bins)
            bins.append([])
            room.append(capacity)
            free.append(slots)
        bins[b].append(i)
        room[b] -= lengths[i]
        free[b] -= counts[i]
        if room[b] > 0:
            open_bins[free[b]].put(room[b], b)
    return bins


def _best_open(open_bins: list[_OpenBins], length: int, count: int) -> int | None:
    """The open bin (taken out of `open_bins`, indexed by slots left) with the least room of at
    least `length` among those with at least `count` slots left, or None."""
    best = None
    for slots_left in range(count, len(open_bins)):
        room = open_bins[slots_left].least_at_least(length)
        if room is not None and (best is None or room < best[0]):
            best = (room, slots_left)
    return None if best is None else open_bins[best[1]].take(best[0])


class _OpenBins:
    """Open bins by the room they have left: the one with the least room of at least n is found
    in O(log capacity) (a count per room size in a binary tree, searched left to right)."""

    def __init__(self, capacity: int) -> None:
        self.size = 1 << capacity.bit_length()  # leaves 0..size-1 hold rooms 0..capacity
        self.count = [0] * (2 * self.size)
        self.bins: dict[int, deque[int]] = {}

    def put(self, room: int, b: int) -> None:
        self.bins.setdefault(room, deque()).append(b)
        node = room + self.size
        while node:
            self.count[node] += 1
            node //= 2

    def least_at_least(self, n: int) -> int | None:
        """The least room of at least n that an open bin has, or None."""
        node = n + self.size
        if not self.count[node]:
            # Up until a right sibling holds a bin: the least room >= n is in its subtree.
            while node > 1 and (node % 2 or not self.count[node + 1]):
                node //= 2
            if node == 1:
                return None
            node += 1
            while node < self.size:  # down to its leftmost leaf with a bin
                node = 2 * node if self.count[2 * node] else 2 * node + 1
        return node - self.size

    def take(self, room: int) -> int:
        """The bin that has had `room` longest, taken out."""
        b = self.bins[room].popleft()
        node = room + self.size
        while node:
            self.count[node] -= 1
            node //= 2
        return b


def pack(examples: list[dict], block_size: int, pad_token_id: int = 0) -> tuple[list[dict], PackingStats]:
    """The examples ({"input_ids", "labels"} lists) in blocks of block_size tokens (see the module
    docstring), and what was cut, left out and padded."""
    kept, stats = truncate(examples, block_size)
    lengths = [len(e["input_ids"]) for e in kept]
    blocks = [fill_block([(kept[i]["input_ids"], kept[i]["labels"]) for i in members], block_size,
                         pad_token_id) for members in best_fit_decreasing(lengths, block_size)]
    stats.blocks = len(blocks)
    stats.padding = stats.blocks * block_size - stats.tokens
    return blocks, stats


def fill_block(examples, block_size: int, pad_token_id: int) -> dict:
    """One block (the four tensors of the module docstring) of (input_ids, labels) pairs, lists or
    int arrays, whose lengths sum to at most block_size."""
    input_ids = torch.full((block_size,), pad_token_id, dtype=torch.long)
    labels = torch.full((block_size,), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(block_size, dtype=torch.long)
    seq_lens = torch.zeros(block_size, dtype=torch.long)
    at = 0
    for k, (ids, example_labels) in enumerate(examples):
        n = len(ids)
        input_ids[at:at + n] = _long(ids)
        labels[at:at + n] = _long(example_labels)
        labels[at] = IGNORE_INDEX  # nothing in this example predicts its first token
        position_ids[at:at + n] = torch.arange(n)
        seq_lens[k] = n
        at += n
    position_ids[at:] = torch.arange(block_size - at)  # the padding is a sequence of its own
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "seq_lens": seq_lens}


def _long(values) -> torch.Tensor:
    """Token ids (a list, or an int32 array that may be a read-only memory map) as int64."""
    if isinstance(values, list):
        return torch.tensor(values, dtype=torch.long)
    return torch.from_numpy(np.array(values, dtype=np.int64))


def unpacked(examples: list[dict], max_length: int, pad_token_id: int = 0, buckets: int | None = 4,
             pad_to_multiple_of: int | None = None) -> tuple[list[dict], PadToBuckets, PackingStats]:
    """packing=False: one example per row ({"input_ids", "labels"} tensors, cut to max_length),
    and the collator that pads each batch to the smallest of `buckets` lengths up to max_length
    (labels with -100, so the loss is the unpadded one without an attention mask)."""
    kept, stats = truncate(examples, max_length)
    rows = [{"input_ids": torch.tensor(e["input_ids"]), "labels": torch.tensor(e["labels"])}
            for e in kept]
    stats.blocks = len(rows)
    return rows, PadToBuckets(pad_token_id, pad_to_multiple_of, buckets, max_length), stats


# -- blocks and rows built when read, from memory-mapped examples ---------------------------------

def first_learned(labels) -> int:
    """The index (at least 1) of an example's first learned label, or its length when none is:
    what `truncate` needs to know of an example to keep or drop it at any cut."""
    learned = np.flatnonzero(np.asarray(labels[1:]) != IGNORE_INDEX)
    return int(learned[0]) + 1 if len(learned) else len(labels)


def truncate_ragged(labels: Ragged, learned_from: np.ndarray, select: np.ndarray,
                    max_length: int) -> tuple[np.ndarray, np.ndarray, PackingStats]:
    """`truncate` of the selected examples kept flat (token_store.Ragged): (the examples kept,
    their lengths after the cut, the stats); `learned_from` is each example's `first_learned`."""
    if not isinstance(max_length, int) or max_length < 1:
        raise InputError(f"the block size or maximum length must be a whole number of at least 1, "
                         f"got {max_length!r}")
    select = np.asarray(select, dtype=np.int64)
    lengths = np.diff(labels.offsets)[select]
    cut = np.minimum(lengths, max_length)
    stats = PackingStats(truncated=int(np.count_nonzero(lengths > max_length)))
    for i in select[lengths > max_length].tolist():  # few: count what the cut leaves out
        stats.labels_cut += int(np.count_nonzero(labels[i][max_length:] != IGNORE_INDEX))
    keep = np.asarray(learned_from)[select] < cut
    stats.nothing_to_learn = int(np.count_nonzero(~keep))
    stats.examples = int(np.count_nonzero(keep))
    stats.tokens = int(cut[keep].sum())
    return select[keep], cut[keep], stats


class PackedBlocks(torch.utils.data.Dataset):
    """`pack`'s blocks, each built when it is read from the examples' token arrays (memory-mapped:
    the ranks of a node share them); what is held is the packing plan, a few bytes an example."""

    def __init__(self, ids: Ragged, labels: Ragged, members: Ragged, lengths: np.ndarray,
                 block_size: int, pad_token_id: int) -> None:
        self.ids, self.labels = ids, labels
        self.members = members
        """The examples (indices into ids and labels) of each block, in `pack`'s order."""
        self.lengths = lengths
        """Each member's length after the cut, aligned with members.values."""
        self.block_size, self.pad_token_id = block_size, pad_token_id

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        index %= len(self)
        start, end = self.members.offsets[index], self.members.offsets[index + 1]
        examples = [(self.ids[i][:n], self.labels[i][:n]) for i, n in
                    zip(self.members.values[start:end].tolist(), self.lengths[start:end].tolist())]
        return fill_block(examples, self.block_size, self.pad_token_id)

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def pack_ragged(ids: Ragged, labels: Ragged, learned_from: np.ndarray, select: np.ndarray,
                block_size: int, pad_token_id: int = 0) -> tuple[PackedBlocks, PackingStats]:
    """`pack` of the selected examples kept flat: the same blocks, built when read."""
    kept, cut, stats = truncate_ragged(labels, learned_from, select, block_size)
    bins = best_fit_decreasing(cut.tolist(), block_size)
    order = np.asarray([j for members in bins for j in members], dtype=np.int64)
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(members) for members in bins], out=offsets[1:])
    stats.blocks = len(bins)
    stats.padding = stats.blocks * block_size - stats.tokens
    members = Ragged(kept[order], offsets)
    return PackedBlocks(ids, labels, members, cut[order], block_size, pad_token_id), stats


class UnpackedRows(torch.utils.data.Dataset):
    """`unpacked`'s rows, each built when it is read from the examples' token arrays."""

    def __init__(self, ids: Ragged, labels: Ragged, kept: np.ndarray, lengths: np.ndarray) -> None:
        self.ids, self.labels, self.kept, self.lengths = ids, labels, kept, lengths

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, index: int) -> dict:
        i, n = int(self.kept[index]), int(self.lengths[index])
        return {"input_ids": _long(self.ids[i][:n]), "labels": _long(self.labels[i][:n])}

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def unpacked_ragged(ids: Ragged, labels: Ragged, learned_from: np.ndarray, select: np.ndarray,
                    max_length: int, pad_token_id: int = 0, buckets: int | None = 4,
                    pad_to_multiple_of: int | None = None):
    """`unpacked` of the selected examples kept flat: the same rows, built when read, and the
    collator."""
    kept, cut, stats = truncate_ragged(labels, learned_from, select, max_length)
    stats.blocks = len(kept)
    return (UnpackedRows(ids, labels, kept, cut),
            PadToBuckets(pad_token_id, pad_to_multiple_of, buckets, max_length), stats)


def segment_ids(seq_lens: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """Which example each token of a block belongs to: [..., block_size] ids, increasing, one per
    example and one more for the padding after them. `seq_lens` is [..., k] example lengths
    (zeros allowed, as `pack` pads them); block_size defaults to k. Static shapes, no host read."""
    block_size = seq_lens.shape[-1] if block_size is None else block_size
    ends = seq_lens.cumsum(-1).clamp(max=block_size)
    # A token's segment is the number of examples that end at or before it.
    marks = torch.zeros(*seq_lens.shape[:-1], block_size + 1, dtype=seq_lens.dtype, device=seq_lens.device)
    marks.scatter_add_(-1, ends, torch.ones_like(ends))
    return marks[..., :block_size].cumsum(-1)


def block_causal_mask(seq_lens: torch.Tensor, block_size: int | None = None,
                      dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """The attention mask of packed blocks: [batch, 1, block_size, block_size], a token seeing the
    tokens at or before it in its own example only (padding sees padding).

    `seq_lens` is [batch, k] or [k] (see `segment_ids`). dtype bool: True where attention is
    allowed (sdpa); a float dtype: 0 there and the dtype's minimum elsewhere, added to the scores
    (eager and sdpa; use the model's compute dtype). transformers uses a 4-D mask as it is given.
    """
    segments = segment_ids(seq_lens if seq_lens.dim() > 1 else seq_lens[None], block_size)
    size = segments.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=segments.device).tril()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal
    allowed = allowed[:, None]
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)
