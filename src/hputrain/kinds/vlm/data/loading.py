"""An image data set as training and validation blocks of fixed shapes (the recipe's entry point).

`load_image_data` encodes the rows (encode.encode_split), holds validation out as text SFT does
(a DatasetDict's own "validation" split, or the last --validation-split-percentage percent of the
examples, before packing, so that no example is in both), chooses the image slots K once for both
splits (the blocks of a run have one shape) and packs (blocks.pack_images) or pads one example a
block (blocks.unpacked_images, --no-packing). The blocks hold the plan; pixel values are made when
a block is read. The encoded examples are cached in `cache_dir` (cache.py) when the caller gives
a key of the data files: made once per node, memory-mapped by every rank.

Reading the rows is the recipe's (recipes/hf_data.records, a layer above): it hands a function of
the split name giving (where, row, folder) triples, the data set's split names, and a function of
the split name giving the hash of its data files (hf_data.cache_key) for the cache.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ....errors import InputError
from ....data.sft import hold_out
from ....data.token_store import check_workers
from . import blocks
from .blocks import BlockLayout, BlockStats, ImageBlocks, ImageCollator, Kept
from .cache import cached_split
from .encode import ImageStats, encode_split

TRAIN_SPLIT, VALIDATION_SPLIT = "train", "validation"

Rows = Callable[[str], Iterable[tuple[str, dict, Path | None]]]
"""The rows of a split: (where, row, the folder its image paths are relative to)."""


@dataclass
class ImageData:
    """The blocks of an image data set, and what became of its rows."""

    fmt: str
    """The row shape (encode's formats)."""
    train: ImageBlocks
    validation: ImageBlocks | None
    collator: ImageCollator
    """Stacks blocks, the batch's image slots real images first (a DataLoader's collate_fn)."""
    stats: BlockStats
    """Rows, examples, cut, nothing left to learn after the cut, images, slots K, blocks, padding
    and padding slots (every split)."""
    rows: ImageStats
    """What encoding did to the rows (every split): rows, examples, nothing to learn, images."""
    own_validation: bool = False
    """The validation blocks are the data set's own "validation" split."""
    from_cache: bool = False
    """Every split's examples were read from the cache."""
    cache_file: Path | None = None
    """The cache folder of the training split's examples (None: not cached)."""

    @property
    def slots(self) -> int:
        return self.stats.slots


def load_image_data(path: str, fmt: str, processing, block_size: int, options,
                    cache_dir: str | Path | None = None, *, rows: Rows,
                    splits: Sequence[str] = (), cache_key: Callable[[str], str] | None = None,
                    train_split: str = TRAIN_SPLIT) -> ImageData:
    """The image data set at `path` (rows of `fmt`, read by `rows(split)`; `splits`: its split
    names; `train_split`: the one read as the training blocks, another for hputrain evaluate
    --split) as blocks of block_size tokens. `options` is the recipe's HFOptions (packing,
    validation_split_percentage, image_slots, dataset_num_proc, and the loss flags encode_split
    reads). The examples are cached in `cache_dir` when `cache_key(split)` gives the hash of
    the split's data files."""
    percentage = options.validation_split_percentage
    own = percentage > 0 and VALIDATION_SPLIT in splits
    workers = check_workers(getattr(options, "dataset_num_proc", None))

    def encoded(split: str):
        def make():
            return encode_split(rows(split), fmt, processing, options, workers)
        if cache_dir is None or cache_key is None:
            return (*make(), None, False)
        return cached_split(cache_dir, cache_key(split), fmt, processing, options, make)

    train, counted, cache_file, from_cache = encoded(train_split)
    if own:
        held, more, _, cached = encoded(VALIDATION_SPLIT)
        counted, from_cache = counted.add(more), from_cache and cached
        train_part, held_part = np.arange(len(train)), np.arange(len(held))
    else:
        held = train
        train_part, held_part = hold_out(len(train), percentage, path)
    kept = blocks.cut_examples(train, train_part, block_size)
    kept_held = blocks.cut_examples(held, held_part, block_size) if len(held_part) else None
    layout = BlockLayout(processing, choose_slots(options, kept, kept_held, block_size))
    arrange = blocks.pack_images if options.packing else blocks.unpacked_images
    made, stats = arrange(layout, train, kept, block_size)
    stats.slots_given = getattr(options, "image_slots", None) is not None
    if not len(made):
        raise InputError(f"--dataset {path}: no example is left to train on (every one has nothing "
                         "to learn within --block-size tokens)")
    validation = None
    if kept_held is not None:
        validation, more_stats = arrange(layout, held, kept_held, block_size)
        stats.add(more_stats)
    stats.rows = counted.rows
    return ImageData(fmt, made, validation if validation is not None and len(validation) else None,
                     ImageCollator(layout.pad_token_id), stats, counted, own_validation=own,
                     from_cache=from_cache, cache_file=cache_file)


def choose_slots(options, train: Kept, held: Kept | None, block_size: int) -> int:
    """K: --image-slots (refused below the most images of one example, in either split), else
    packed, the mean images per block of a packing by tokens alone (rounded up), unpacked, the
    most images of one example; at least 1."""
    most = max(train.most, held.most if held is not None else 0)
    requested = getattr(options, "image_slots", None)
    if requested is not None:
        blocks.check_slots(requested, *([train] if held is None else [train, held]))
        return requested
    if not options.packing:
        return max(1, most)
    return blocks.default_slots(train.counts.tolist(), train.lengths.tolist(), block_size, most)
