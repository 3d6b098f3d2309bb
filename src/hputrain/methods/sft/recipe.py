"""The Hugging Face recipe's chat and instruction data (supervised fine-tuning): which method a data
set asks for, its rows encoded through the tokenizer's chat template (data/sft.py), packed into
blocks without cross-talk (data/packing.py) or padded to a few lengths, and cached on disk.

The method comes from the data's columns: `messages` (TRL's conversational rows), `conversations`
(ShareGPT) or `prompt` + `completion` mean SFT, whatever else the rows hold; otherwise the text
column (--text-column, default `text`) means causal LM on packed text (recipes/hf/data.py), as does
plain text (a file or a folder of them).

Validation: a save_to_disk DatasetDict's own "validation" split, else the last
validation_percentage percent of the examples (at least one), held out before packing so that no
example is in both. The encoded examples (not the blocks: packing them is quick) are cached in
one folder per split (data/token_store.py), keyed by the data files, the tokenizer's files, the
chat template's text and the loss flags: int32 token ids and labels with the examples' offsets,
made once per node by --dataset-num-proc processes and memory-mapped by every rank. The blocks
hold only the packing plan and are built when read, so the ranks of a node share one copy of the
tokens in the page cache.
"""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...data import packing, token_store
from ...data import sft
from ...data.chat import chat_template
from ...data.token_store import Ragged
from ...recipes.hf.common import counted, split_sizes
from ...errors import InputError
from ...recipes.hf import data as hf_data

CACHE_VERSION = 2  # 2: a folder of memory-mapped .npy files, no longer one .npz


@dataclass
class SFTData:
    fmt: str
    """The row shape (sft.FORMATS)."""
    train: packing.PackedBlocks | packing.UnpackedRows
    """Packed blocks (input_ids, labels, position_ids, seq_lens), or one example a row, built
    when read from the memory-mapped cache."""
    validation: packing.PackedBlocks | packing.UnpackedRows | None
    collator: object | None
    """The collator of unpacked rows (length buckets); None for packed blocks."""
    rows: sft.SFTStats
    """What became of the rows (every split)."""
    packed: packing.PackingStats
    """What packing (or cutting) did to the examples (every split)."""
    cache_file: Path
    """The cache folder of the training split."""
    from_cache: bool
    own_validation: bool = False


def load_sft(path: str, fmt: str, tokenizer, block_size: int, options, *, cache_dir: str | Path,
             tokenizer_folder: str | Path | None = None, split: str = hf_data.TRAIN_SPLIT) -> SFTData:
    """The SFT data set at `path` as training and validation blocks (or rows), built when read
    from the memory-mapped cache. `options` is the recipe's HFOptions (packing,
    assistant_only_loss, completion_only_loss, validation_split_percentage, dataset_num_proc);
    `split`: the split read as the training rows (hputrain evaluate --split reads another)."""
    percentage = options.validation_split_percentage
    own = percentage > 0 and hf_data.VALIDATION_SPLIT in hf_data.saved_splits(path)
    train, rows, cache_file, from_cache = encoded(path, fmt, tokenizer, options, cache_dir,
                                                  tokenizer_folder, split)
    if own:
        held, more, _, cached = encoded(path, fmt, tokenizer, options, cache_dir, tokenizer_folder,
                                        hf_data.VALIDATION_SPLIT)
        rows, from_cache = _add(rows, more), from_cache and cached
        train_part, held_part = np.arange(len(train)), np.arange(len(held))
    else:
        held = train
        train_part, held_part = sft.hold_out(len(train), percentage, path)
    pad = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
    blocks, collator, stats = _arrange(train, train_part, block_size, pad, options.packing)
    if not len(blocks):
        raise InputError(f"--dataset {path}: no example is left to train on (every one has nothing "
                         "to learn within --block-size tokens)")
    validation, more = None, packing.PackingStats()
    if len(held_part):
        validation, _, more = _arrange(held, held_part, block_size, pad, options.packing)
    stats.add(more)
    return SFTData(fmt, blocks, validation if validation is not None and len(validation) else None,
                   collator, rows, stats, cache_file, from_cache, own_validation=own)


def _arrange(examples: Examples, select: np.ndarray, block_size: int, pad: int, packed: bool):
    """(blocks or rows of the selected examples, the collator of rows or None, PackingStats)."""
    flat = (examples.ids, examples.labels, examples.learned_from, select, block_size, pad)
    if packed:
        blocks, stats = packing.pack_ragged(*flat)
        return blocks, None, stats
    return packing.unpacked_ragged(*flat)


def _add(a: sft.SFTStats, b: sft.SFTStats) -> sft.SFTStats:
    return sft.SFTStats(a.rows + b.rows, a.examples + b.examples, a.nothing_to_learn + b.nothing_to_learn)


# -- encoding --------------------------------------------------------------------------------------

ROWS_PER_PART = 256
"""Rows a tokenizing process takes at a time."""


@dataclass
class Examples:
    """The encoded examples of one split, flat (memory-mapped when read from the cache)."""

    ids: Ragged
    labels: Ragged
    learned_from: np.ndarray
    """Each example's first learned position (packing.first_learned): decides what a cut drops."""

    def __len__(self) -> int:
        return len(self.ids)


def encoded(path: str, fmt: str, tokenizer, options, cache_dir, tokenizer_folder, split: str):
    """(Examples, SFTStats, cache folder, whether read from it) of one split: made by the first
    process of the node to get here, read by the others (token_store.made_once)."""
    kind, files = hf_data.source_files(path, split)
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else repr(template)  # a dict of named ones
    extra = [CACHE_VERSION, "sft", fmt, options.assistant_only_loss, options.completion_only_loss,
             hashlib.sha256(template.encode()).hexdigest()]
    key = hf_data.cache_key(kind, Path(path), files, tokenizer, tokenizer_folder, 0, fmt,
                            split if kind == "saved" else None, extra)
    cache = Path(cache_dir) / f"sft-{key[:24]}"
    workers = token_store.check_workers(getattr(options, "dataset_num_proc", None))
    (examples, stats), cached = token_store.made_once(
        cache, _read_cache, lambda: encode(path, fmt, tokenizer, options, split, workers), _write_cache)
    return examples, stats, cache, cached


def encode(path: str, fmt: str, tokenizer, options, split: str = hf_data.TRAIN_SPLIT,
           workers: int = 1) -> tuple[Examples, sft.SFTStats]:
    """Every row of the split encoded (sft.encode_row), in `workers` processes, in row order; each
    error names its row by file line (or save_to_disk row); rows with nothing to learn counted
    and left out."""
    rows = hf_data.records(path, split)
    first = next(rows, None)
    if first is None:
        raise InputError(f"--dataset {path} holds no rows")
    chat = None
    if fmt != "prompt_completion" or not isinstance(first[1].get("prompt"), str):
        chat = chat_template(tokenizer, fmt)
    context = (fmt, tokenizer, chat, options.assistant_only_loss, options.completion_only_loss)
    parts = list(token_store.ordered_map(_encode_part, context,
                                         token_store.chunks(itertools.chain([first], rows),
                                                            ROWS_PER_PART), workers))
    stats = sft.SFTStats(sum(p[3] for p in parts), 0, sum(p[4] for p in parts))
    examples = Examples(Ragged.join([p[0] for p in parts]), Ragged.join([p[1] for p in parts]),
                        np.concatenate([p[2] for p in parts]).astype(np.int32))
    stats.examples = len(examples)
    return examples, stats


def _encode_part(context, rows: list) -> tuple:
    """(ids, labels, learned_from, rows, rows with nothing to learn) of some rows: the work of
    one tokenizing process."""
    fmt, tokenizer, chat, assistant_only_loss, completion_only_loss = context
    kept, skipped = [], 0
    for where, row in rows:
        example = sft.encode_row(row, fmt, tokenizer, chat, where=f"--dataset {where}",
                                 assistant_only_loss=assistant_only_loss,
                                 completion_only_loss=completion_only_loss)
        if example is None:
            skipped += 1
        else:
            kept.append(example)
    return (Ragged.of([e["input_ids"] for e in kept]), Ragged.of([e["labels"] for e in kept]),
            np.asarray([packing.first_learned(e["labels"]) for e in kept], dtype=np.int32),
            len(rows), skipped)


# -- the cache -------------------------------------------------------------------------------------

CACHE_ARRAYS = ("input_ids", "input_ids.offsets", "labels", "labels.offsets", "learned_from", "stats")


def _read_cache(folder: Path):
    """(Examples memory-mapped, SFTStats), or None when the cache is missing or damaged."""
    arrays = token_store.read_arrays(folder, CACHE_ARRAYS)
    if arrays is None:
        return None
    ids, labels = Ragged.read(arrays, "input_ids"), Ragged.read(arrays, "labels")
    whole = (len(ids) == len(labels) == len(arrays["learned_from"]) and arrays["stats"].shape == (3,)
             and ids.offsets[-1] == len(ids.values) and np.array_equal(ids.offsets, labels.offsets))
    if not whole:
        return None
    return Examples(ids, labels, arrays["learned_from"]), sft.SFTStats(*map(int, arrays["stats"]))


def _write_cache(folder: Path, made) -> None:
    examples, stats = made
    token_store.write_arrays(folder, {
        **examples.ids.arrays("input_ids"), **examples.labels.arrays("labels"),
        "learned_from": examples.learned_from,
        "stats": np.asarray([stats.rows, stats.examples, stats.nothing_to_learn], dtype=np.int64)})


# -- the run header --------------------------------------------------------------------------------

def describe(data: SFTData, options, block_size: int, source: str) -> str:
    """The header's lines on SFT data: what is learned, what became of the rows, the blocks."""
    if data.fmt == "prompt_completion":
        learned = ("completion tokens (--completion-only-loss)" if options.completion_only_loss
                   else "every token (--no-completion-only-loss)")
    else:
        learned = ("assistant turns, end of turn included (--assistant-only-loss)"
                   if options.assistant_only_loss else "every token (--no-assistant-only-loss)")
    rows, packed = data.rows, data.packed
    held_out = len(data.validation) if data.validation is not None else 0
    if options.packing:
        shape = (f"{split_sizes(len(data.train), held_out, 'block')} of {block_size} "
                 f"tokens, packed with attention kept inside each example "
                 f"({packed.padding_fraction:.1%} padding)")
    else:
        shape = (f"{split_sizes(len(data.train), held_out, 'row')} of at most "
                 f"{block_size} tokens, unpacked (--no-packing), padded to length buckets")
    return (f"hputrain: loss on {learned}\n"
            f"hputrain: {counted(rows.rows, 'row')}, {rows.nothing_to_learn} skipped with nothing "
            f"to learn, {packed.truncated} cut to {block_size} tokens (--block-size), "
            f"{packed.nothing_to_learn} left with nothing to learn after the cut\n"
            f"hputrain: {shape} {source}\n")
