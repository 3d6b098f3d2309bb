"""Encoded image examples (encode.ImageExample) in blocks of fixed shapes: S tokens and K image
slots, the contract between the data and the training forward.

A block (one item of `ImageBlocks`) is a dict of tensors:

  input_ids      [S]       the examples one after another (image tokens expanded), then pad id
  labels         [S]       learned tokens only: -100 on image tokens, on each example's first
                           token and on the padding
  position_ids   [S], or [3, S] for Qwen's multimodal RoPE: restarting at each example (Qwen:
                 transformers' get_rope_index of that example alone), the padding 0, 1, ...
  seq_lens       [S]       the examples' lengths, then zeros (packing.block_causal_mask reads it)
  pixel_values   [K, C, H, W] (one image size), or Qwen's patches [K * P, D]: P the slot's
                 patches, an image's own first (its bucket's), then blank ones (zeros)
  image_grid_thw [K, 3]    Qwen only: each slot's image's (t, h, w) patch grid
  image_count    []        the real images; the slots after them hold a blank image

`pack_images` puts whole examples into blocks by best-fit decreasing on tokens with at most K
images a block (`fill_slots`: packing.best_fit_decreasing in the better of two orders); an
example longer than S is cut after its last image (`cut_examples`, counted as text SFT counts
its cuts); `unpacked_images` gives one example a block, padded
to the smallest of a few lengths. Both hold only the plan: a block, its pixel values included, is
made when it is read (in the DataLoader's workers). `ImageCollator` stacks blocks into a batch
whose image slots are ordered real images first (see its docstring).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from ....errors import InputError
from ....data import packing
from ....data.batching import bucket_lengths
from ....data.packing import IGNORE_INDEX
from ....data.token_store import Ragged
from .buckets import MAX_DISTORTION, RATIO_LIMIT
from .encode import check_fits

BLANK_SLOTS = 0.25
"""More than this share of a run's image slots blank is warned of (BlockStats.warnings)."""

IMAGE_COUNT = "image_count"
"""A block's key of its real images' count, which ImageCollator reads (and drops)."""

LENGTH_BUCKETS = 4
"""Unpacked (--no-packing): the block lengths an example is padded to (the smallest that holds
it), spaced evenly up to the block size."""


@dataclass
class BlockStats(packing.PackingStats):
    """What packing did to the image examples: PackingStats' counts (truncated: cut to the block
    size after their last image), and the images and their slots."""

    rows: int = 0
    """Rows read (every split)."""
    images: int = 0
    """Real images in the blocks."""
    slots: int = 0
    """Image slots per block (K)."""
    padding_slots: int = 0
    """Slots holding a blank image."""
    most_images: int = 0
    """The most images of one example (the least K may be)."""
    fullest: str = ""
    """The row of that example."""
    distorted: int = 0
    """Examples with an image whose aspect ratio its bucket changes by more than
    buckets.MAX_DISTORTION."""
    most_distorted: float = 0.0
    """The most an image's aspect ratio is changed (Buckets.distortion)."""
    distorted_row: str = ""
    """The row of that image."""
    crowded: int = 0
    """Examples with more images than a block holds on average (rounded up)."""
    slots_given: bool = False
    """K is --image-slots (else the default: loading.choose_slots)."""

    @property
    def padding_slot_fraction(self) -> float:
        total = self.images + self.padding_slots
        return self.padding_slots / total if total else 0.0

    SHARED = ("slots", "slots_given", "most_images", "fullest", "most_distorted", "distorted_row")
    """add() sums the rest: the splits' blocks have one K; the most of either is kept."""

    def warnings(self, packed: bool = True) -> list[str]:
        """What the run's header warns of: more than BLANK_SLOTS of the image slots blank (each
        runs the vision tower as a real image does), what set K and what would lower it
        (`packed`: whether the blocks were packed); images whose bucket changes their aspect
        ratio by more than MAX_DISTORTION."""
        said = []
        if self.padding_slot_fraction > BLANK_SLOTS:
            said.append(self._blank_slots(packed))
        if self.distorted:
            said.append(f"{_counted(self.distorted, 'example')} {'has' if self.distorted == 1 else 'have'} "
                        f"an image whose pixel bucket changes its aspect ratio by more than "
                        f"{MAX_DISTORTION:.0%} (the most: {self.most_distorted:.0%}, {self.distorted_row}): "
                        "give --image-buckets with a size of that shape (at most "
                        f"{RATIO_LIMIT:g}:1), or crop such images")
        return said

    def _blank_slots(self, packed: bool) -> str:
        mean = self.images / self.blocks if self.blocks else 0.0
        enough = max(1, math.ceil(mean), self.most_images)
        if self.slots > enough:
            why = "--image-slots" if self.slots_given else "the mean images a block of a packing by tokens alone"
            fix = (f"--image-slots {enough} would do (the most images of one example: "
                   f"{self.most_images})")
        else:
            why = "--image-slots, " if self.slots_given else ""
            why += f"the {self.most_images} images of one example, {self.fullest}"
            fix = (f"leave out or split the {_counted(self.crowded, 'example')} with more than "
                   f"{_counted(max(1, math.ceil(mean)), 'image')}, and K can come down with them")
            if not packed:
                fix += "; or pack (leave out --no-packing): a block's slots then hold several examples' images"
        return (f"{self.padding_slot_fraction:.0%} of the image slots are blank images, each run through "
                f"the vision tower as a real one: {self.slots} slots a block (set by {why}) for "
                f"{mean:.1f} images a block on average; {fix}")

    def add(self, other: BlockStats) -> None:
        super().add(other)
        if other.most_images > self.most_images:
            self.most_images, self.fullest = other.most_images, other.fullest
        if other.most_distorted > self.most_distorted:
            self.most_distorted, self.distorted_row = other.most_distorted, other.distorted_row


# -- what is kept of the examples -------------------------------------------------------------------

@dataclass
class Kept:
    """What the cut keeps of some examples: their indices, lengths after the cut and images."""

    indices: np.ndarray
    lengths: np.ndarray
    counts: np.ndarray
    stats: BlockStats
    fullest: str = ""
    """The row of the example with the most images (how errors name it)."""

    @property
    def most(self) -> int:
        """The most images of one example."""
        return int(self.counts.max()) if len(self.counts) else 0


def cut_examples(examples, select, block_size: int) -> Kept:
    """The selected examples kept: an example longer than the block is cut to block_size tokens,
    which must leave its images whole (else one line naming its row: encode.check_fits); one with
    nothing left to learn is left out (counted)."""
    if not isinstance(block_size, int) or block_size < 1:
        raise InputError(f"the block size must be a whole number of at least 1, got {block_size!r}")
    stats, kept, lengths, counts = BlockStats(), [], [], []
    for i in np.asarray(select, dtype=np.int64).tolist():
        ids, labels = examples[i].input_ids, examples[i].labels
        _count_distortion(stats, examples[i])
        n = min(len(ids), block_size)
        if len(ids) > block_size:
            check_fits(examples[i], block_size)
            stats.truncated += 1
            stats.labels_cut += int(np.count_nonzero(np.asarray(labels[block_size:]) != IGNORE_INDEX))
        if packing.first_learned(labels) >= n:
            stats.nothing_to_learn += 1
            continue
        kept.append(i)
        lengths.append(n)
        counts.append(len(examples[i].images))
    stats.examples, stats.tokens, stats.images = len(kept), sum(lengths), sum(counts)
    fullest = getattr(examples[kept[int(np.argmax(counts))]], "where", "") if kept else ""
    stats.most_images, stats.fullest = (max(counts), fullest) if kept else (0, "")
    return Kept(np.asarray(kept, dtype=np.int64), np.asarray(lengths, dtype=np.int64),
                np.asarray(counts, dtype=np.int64), stats, fullest)


def _count_distortion(stats: BlockStats, example) -> None:
    """Counts `example` in `stats` when its bucket changes an image's aspect ratio by more than
    MAX_DISTORTION (the most such change, and its row, kept)."""
    distortion = getattr(example, "distortion", 0.0)
    if distortion > MAX_DISTORTION + 1e-6:  # (float32 in the cache)
        stats.distorted += 1
    if distortion > stats.most_distorted:
        stats.most_distorted, stats.distorted_row = distortion, getattr(example, "where", "")


def default_slots(counts: list[int], lengths: list[int], block_size: int, most: int) -> int:
    """K when --image-slots is not given: the mean images per block of a packing by tokens alone,
    rounded up, and at least `most` (the most images of one example) and 1."""
    blocks = len(packing.best_fit_decreasing(lengths, block_size)) if lengths else 0
    mean = math.ceil(sum(counts) / blocks) if blocks else 0
    return max(1, mean, most)


def check_slots(slots: int, *kept: Kept) -> None:
    """--image-slots K must be at least 1 and hold the example with the most images (of `kept`)."""
    if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
        raise InputError(f"--image-slots must be a whole number of at least 1, got {slots!r}")
    fullest = max(kept, key=lambda k: k.most, default=None)
    if fullest is not None and fullest.most > slots:
        where = f" ({fullest.fullest})" if fullest.fullest else ""
        raise InputError(f"--image-slots {slots} is fewer than the {fullest.most} images of one "
                         f"example{where}: give --image-slots {fullest.most} or more, or leave it out")


# -- the plan: which examples each block holds ------------------------------------------------------

class ImageBlocks(torch.utils.data.Dataset):
    """Blocks of image examples, each made when it is read (see the module docstring); what is
    held is the plan: the examples of each block, their lengths after the cut, each block's
    length."""

    def __init__(self, layout: BlockLayout, examples, members: Ragged, lengths: np.ndarray,
                 sizes: np.ndarray) -> None:
        self.layout, self.examples = layout, examples
        self.members = members
        """The examples (indices into `examples`) of each block, in order."""
        self.lengths = lengths
        """Each member's length after the cut, aligned with members.values."""
        self.sizes = sizes
        """Each block's length (S packed; unpacked, its length bucket)."""

    def __len__(self) -> int:
        return len(self.members)

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        index %= len(self)
        start, end = self.members.offsets[index], self.members.offsets[index + 1]
        parts = [(self.examples[i], n) for i, n in
                 zip(self.members.values[start:end].tolist(), self.lengths[start:end].tolist())]
        return self.layout.block(parts, int(self.sizes[index]))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def images(self, index: int) -> int:
        """The real images of block `index` (without making it)."""
        start, end = self.members.offsets[index], self.members.offsets[index + 1]
        return sum(len(self.examples[i].images) for i in self.members.values[start:end].tolist())


def _plan(bins: list[list[int]], kept: np.ndarray, cut: np.ndarray) -> tuple[Ragged, np.ndarray]:
    order = np.asarray([j for members in bins for j in members], dtype=np.int64)
    offsets = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum([len(members) for members in bins], out=offsets[1:])
    return Ragged(kept[order], offsets), cut[order]


def pack_images(layout: BlockLayout, examples, kept: Kept, block_size: int) -> tuple[ImageBlocks, BlockStats]:
    """The kept examples packed into blocks of block_size tokens and layout.slots images (K)."""
    slots = layout.slots
    check_slots(slots, kept)
    bins = fill_slots(kept.lengths.tolist(), kept.counts.tolist(), block_size, slots)
    members, lengths = _plan(bins, kept.indices, kept.lengths)
    stats = replace(kept.stats, blocks=len(bins), slots=slots)
    stats.padding = stats.blocks * block_size - stats.tokens
    stats.padding_slots = stats.blocks * slots - stats.images
    stats.crowded = _crowded(kept, stats)
    sizes = np.full(len(bins), block_size, dtype=np.int64)
    return ImageBlocks(layout, examples, members, lengths, sizes), stats


def _counted(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _crowded(kept: Kept, stats: BlockStats) -> int:
    """The kept examples with more images than the blocks hold on average (rounded up)."""
    mean = math.ceil(stats.images / stats.blocks) if stats.blocks else 0
    return int(np.count_nonzero(kept.counts > max(1, mean)))


def fill_slots(lengths: list[int], counts: list[int], block_size: int, slots: int) -> list[list[int]]:
    """Best-fit decreasing bins of at most block_size tokens and `slots` images, placing the
    examples in the better of two orders (fewer bins; the first on a tie): longest first, or
    largest first by tokens and images together (each as a share of a block's). Neither wins
    everywhere: where lengths and image counts vary apart, longest first filled the slots early
    and made 18% more blocks than tokens alone need, the other order none more; where the long
    examples are the ones with images, longest first made 2% fewer."""
    by_length = packing.best_fit_decreasing(lengths, block_size, counts, slots)
    together = sorted(range(len(lengths)), key=lambda i: (-(lengths[i] * slots + counts[i] * block_size), i))
    by_both = packing.best_fit_decreasing(lengths, block_size, counts, slots, order=together)
    return by_both if len(by_both) < len(by_length) else by_length


def unpacked_images(layout: BlockLayout, examples, kept: Kept,
                    block_size: int) -> tuple[ImageBlocks, BlockStats]:
    """--no-packing: one example a block, its length the smallest of LENGTH_BUCKETS lengths up to
    block_size that holds it, with layout.slots image slots (at least the most of one example)."""
    slots = layout.slots
    check_slots(slots, kept)
    lengths = bucket_lengths(LENGTH_BUCKETS, block_size)
    sizes = np.asarray([lengths[np.searchsorted(lengths, n)] for n in kept.lengths.tolist()],
                       dtype=np.int64)
    members, cut = _plan([[j] for j in range(len(kept.indices))], kept.indices, kept.lengths)
    stats = replace(kept.stats, blocks=len(sizes), slots=slots)
    stats.padding = int(sizes.sum()) - stats.tokens
    stats.padding_slots = stats.blocks * slots - stats.images
    stats.crowded = _crowded(kept, stats)
    return ImageBlocks(layout, examples, members, cut, sizes), stats


# -- making a block ---------------------------------------------------------------------------------

class BlockLayout:
    """How the blocks of one model are made: its pad and image token ids, its positions (1-D or
    Qwen's 3-D), its image slots and the pixel values of each image (`processing`)."""

    def __init__(self, processing, slots: int) -> None:
        self.processing, self.slots = processing, slots
        self.patches = slot_patches(processing)
        tokenizer = processing.tokenizer
        self.pad_token_id = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0)
                                 if t is not None)
        self.image_token = processing.image_token_id
        self.rope = RopeIndex(processing.config) if processing.family.positions == "3d" else None

    def block(self, parts: list[tuple[object, int]], size: int) -> dict:
        """The block of `parts` ((ImageExample, length after the cut) pairs), `size` tokens long."""
        rows = () if self.rope is None else (3,)
        input_ids = torch.full((size,), self.pad_token_id, dtype=torch.long)
        labels = torch.full((size,), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(*rows, size, dtype=torch.long)
        seq_lens = torch.zeros(size, dtype=torch.long)
        images, at = [], 0
        for k, (example, n) in enumerate(parts):
            ids = torch.from_numpy(np.asarray(example.input_ids[:n], dtype=np.int64))
            pixels = [self.processing.pixels(ref, bucket, example.where)
                      for ref, bucket in zip(example.images, example.buckets)]
            input_ids[at:at + n] = ids
            labels[at:at + n] = torch.from_numpy(np.asarray(example.labels[:n], dtype=np.int64))
            labels[at:at + n][ids == self.image_token] = IGNORE_INDEX
            labels[at] = IGNORE_INDEX  # nothing in this block predicts an example's first token
            position_ids[..., at:at + n] = self.positions(ids, pixels)
            seq_lens[k] = n
            images += pixels
            at += n
        position_ids[..., at:] = torch.arange(size - at)  # the padding is a sequence of its own
        count = len(images)
        if count > self.slots:
            raise ValueError(f"a block of {count} images has {self.slots} slots")
        # Padding slots: a blank image of the first bucket.
        images += [self.processing.blank(0)] * (self.slots - count)
        block = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
                 "seq_lens": seq_lens, **stack_images(images, self.patches),
                 IMAGE_COUNT: torch.tensor(count)}
        return block

    def positions(self, ids: torch.Tensor, pixels: list[dict]) -> torch.Tensor:
        """One example's positions: 0, 1, ... or transformers' 3-D ones of the example alone."""
        if self.rope is None:
            return torch.arange(len(ids))
        grids = torch.stack([torch.as_tensor(p["image_grid_thw"]).reshape(3) for p in pixels]) \
            if pixels else None
        return self.rope(ids, grids, self.image_token)


def slot_patches(processing) -> int | None:
    """The patches of one image slot of a dynamic-resolution family (Qwen): its buckets' most
    image tokens x merge^2; None for a fixed-size family (or a processing without buckets)."""
    tokens = getattr(getattr(processing, "buckets", None), "tokens", None)
    if tokens is None or processing.family.positions != "3d":
        return None
    return tokens * processing.config.vision_config.spatial_merge_size ** 2


def stack_images(images: list[dict], patches: int | None = None) -> dict:
    """pixel_values (and image_grid_thw) of a block's slots: [K, C, H, W], or Qwen's [K * P, D]
    patches with the [K, 3] grids, each image's patches followed by blank (zero) ones up to the
    slot's `patches` (a bucket of fewer tokens than the slot: its grid says how many are its
    own, and kinds/vlm/execution.py leaves the rest out of the tower's attention and features)."""
    values = [torch.as_tensor(p["pixel_values"], dtype=torch.float32) for p in images]
    if "image_grid_thw" not in images[0]:
        return {"pixel_values": torch.stack(values)}
    if patches is not None:
        values = [torch.nn.functional.pad(v, (0, 0, 0, patches - v.shape[0])) if v.shape[0] < patches else v
                  for v in values]
    grids = [torch.as_tensor(p["image_grid_thw"], dtype=torch.long).reshape(3) for p in images]
    return {"pixel_values": torch.cat(values), "image_grid_thw": torch.stack(grids)}


class RopeIndex:
    """transformers' own multimodal rotary positions (the model class's `get_rope_index`, Qwen's
    3-D rows: temporal, height, width) of one example, without a model: the method reads only
    the config and the class's `get_vision_position_ids`, so it is called on this object."""

    def __init__(self, config) -> None:
        self.config = config

    @property
    def model_class(self):
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        return MODEL_MAPPING[type(self.config)]

    def get_vision_position_ids(self, *args, **kwargs) -> torch.Tensor:
        return self.model_class.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, ids: torch.Tensor, grids: torch.Tensor | None, image_token: int) -> torch.Tensor:
        """[3, len(ids)] positions of one example, `grids` its images' (t, h, w) patch grids."""
        kinds = (ids == image_token).to(torch.int32)  # the processor's mm_token_type_ids: image 1
        positions, _ = self.model_class.get_rope_index(self, ids[None], mm_token_type_ids=kinds[None],
                                                       image_grid_thw=grids)
        return positions[:, 0]


# -- batches ----------------------------------------------------------------------------------------

class ImageCollator:
    """Stacks blocks into a batch whose image slots are ordered real images first: pixel_values
    [B * K, ...] (Qwen: [B * K * P, D]) hold block 0's real images, block 1's, ..., then every
    padding slot; image_grid_thw in the same order; image_count is dropped.

    Why: transformers' masked_scatter fills the batch's image tokens, in row-major order, from the
    image features in order; with the padding slots last, the first n features are the n real
    images' and the rest is never read, while the shapes stay the same every step.
    Blocks of different lengths (unpacked) are padded to the longest: pad id, labels -100, the
    padding's positions continuing, seq_lens zeros."""

    def __init__(self, pad_token_id: int = 0) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, blocks: list[dict]) -> dict:
        size = max(b["input_ids"].shape[-1] for b in blocks)
        blocks = [self.pad(b, size) for b in blocks]
        batch = {name: torch.stack([b[name] for b in blocks])
                 for name in ("input_ids", "labels", "position_ids", "seq_lens")}
        counts = [int(b[IMAGE_COUNT]) for b in blocks]
        grids = "image_grid_thw" in blocks[0]
        slots = blocks[0]["image_grid_thw" if grids else "pixel_values"].shape[0]
        order = torch.tensor([b * slots + s for b, n in enumerate(counts) for s in range(n)]
                             + [b * slots + s for b, n in enumerate(counts) for s in range(n, slots)])
        pixels = torch.stack([b["pixel_values"] for b in blocks])
        if grids:  # [B, K * P, D]: slot by slot, each its P patches
            patches = pixels.reshape(len(blocks) * slots, -1, pixels.shape[-1])
            batch["pixel_values"] = patches[order].reshape(-1, pixels.shape[-1])
            batch["image_grid_thw"] = torch.cat([b["image_grid_thw"] for b in blocks])[order]
        else:
            batch["pixel_values"] = pixels.flatten(0, 1)[order]
        return batch

    def pad(self, block: dict, size: int) -> dict:
        """`block` lengthened to `size` tokens (a longer padding sequence)."""
        length = block["input_ids"].shape[-1]
        if length == size:
            return block
        more = size - length
        used = int(block["seq_lens"].sum())
        rows = block["position_ids"].shape[:-1]
        position_ids = torch.arange(length - used, size - used).expand(*rows, more)
        return block | {
            "input_ids": torch.cat([block["input_ids"], torch.full((more,), self.pad_token_id)]),
            "labels": torch.cat([block["labels"], torch.full((more,), IGNORE_INDEX)]),
            "position_ids": torch.cat([block["position_ids"], position_ids], dim=-1),
            "seq_lens": torch.cat([block["seq_lens"], torch.zeros(more, dtype=torch.long)])}
