"""The Hugging Face recipe's chat and instruction data (supervised fine-tuning): which method a data
set asks for, its rows encoded through the tokenizer's chat template (data/sft.py), packed into
blocks without cross-talk (data/packing.py) or padded to a few lengths, and cached on disk.

The method comes from the data's columns: `messages` (TRL's conversational rows), `conversations`
(ShareGPT) or `prompt` + `completion` mean SFT, whatever else the rows hold; otherwise the text
column (--text-column, default `text`) means causal LM on packed text (hf_data.py), as does
plain text (a file or a folder of them).

Validation: a save_to_disk DatasetDict's own "validation" split, else the last
validation_percentage percent of the examples (at least one), held out before packing so that no
example is in both. The encoded examples (not the blocks: packing them is quick) are cached in
one .npz file per split, keyed by the data files, the tokenizer's files, the chat template's text
and the loss flags.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data import packing, sft
from ..data.chat import ChatTemplate
from ..errors import InputError
from . import hf_data

CACHE_VERSION = 1
METHODS = {"text": "causal LM on packed text",
           "messages": "SFT on conversations ('messages')",
           "conversations": "SFT on ShareGPT conversations ('conversations')",
           "prompt_completion": "SFT on prompt-completion pairs ('prompt', 'completion')"}
"""What the run header calls each method."""


def data_method(path: str, text_column: str = "text") -> str:
    """"text", or the SFT row shape (sft.FORMATS) of the data set at `path`, from its columns."""
    columns = hf_data.columns_of(path)
    if columns is None:
        return "text"
    try:
        return sft.detect_format(columns)
    except InputError:
        if text_column in columns:
            return "text"
        where = f"{path} has no {text_column!r} column" if Path(path).is_dir() else \
            f"{path} line 1 has no {text_column!r} field"
        raise InputError(f"--dataset {where} (it has: {', '.join(map(str, columns)) or 'nothing'}): "
                         "name the text field with --text-column, or give chat rows in 'messages' "
                         "or 'conversations', or 'prompt' and 'completion'") from None


@dataclass
class SFTData:
    fmt: str
    """The row shape (sft.FORMATS)."""
    train: list[dict]
    """Packed blocks (input_ids, labels, position_ids, seq_lens), or one example a row."""
    validation: list[dict] | None
    collator: object | None
    """The collator of unpacked rows (length buckets); None for packed blocks."""
    rows: sft.SFTStats
    """What became of the rows (every split)."""
    packed: packing.PackingStats
    """What packing (or cutting) did to the examples (every split)."""
    cache_file: Path
    from_cache: bool
    own_validation: bool = False


def load_sft(path: str, fmt: str, tokenizer, block_size: int, options, *, cache_dir: str | Path,
             tokenizer_folder: str | Path | None = None) -> SFTData:
    """The SFT data set at `path` as training and validation blocks (or rows). `options` is the
    recipe's HFOptions (packing, assistant_only_loss, completion_only_loss,
    validation_split_percentage)."""
    percentage = options.validation_split_percentage
    own = percentage > 0 and hf_data.VALIDATION_SPLIT in hf_data.saved_splits(path)
    train, rows, cache_file, from_cache = encoded(path, fmt, tokenizer, options, cache_dir,
                                                  tokenizer_folder, hf_data.TRAIN_SPLIT)
    if own:
        held_out, more, _, cached = encoded(path, fmt, tokenizer, options, cache_dir, tokenizer_folder,
                                            hf_data.VALIDATION_SPLIT)
        rows, from_cache = _add(rows, more), from_cache and cached
    else:
        train, held_out = _hold_out(train, percentage, path)
    pad = next(t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if t is not None)
    if options.packing:
        blocks, stats = packing.pack(train, block_size, pad)
        more = packing.pack(held_out, block_size, pad) if held_out else ([], packing.PackingStats())
        collator = None
    else:
        blocks, collator, stats = packing.unpacked(train, block_size, pad)
        more = packing.unpacked(held_out, block_size, pad)[::2] if held_out else ([], packing.PackingStats())
    if not blocks:
        raise InputError(f"--dataset {path}: no example is left to train on (every one has nothing "
                         "to learn within --block-size tokens)")
    for name in ("examples", "blocks", "truncated", "labels_cut", "nothing_to_learn", "tokens", "padding"):
        setattr(stats, name, getattr(stats, name) + getattr(more[1], name))
    return SFTData(fmt, blocks, more[0] or None, collator, rows, stats, cache_file, from_cache,
                   own_validation=own)


def _hold_out(examples: list[dict], percentage: float, path: str):
    if percentage <= 0:
        return examples, []
    held_out = max(1, int(len(examples) * percentage / 100))
    if held_out >= len(examples):
        raise InputError(f"--dataset {path} has {len(examples)} example(s), too few to hold "
                         f"{percentage:g}% out for validation: give more rows, or "
                         "--validation-split-percentage 0")
    return examples[:-held_out], examples[-held_out:]


def _add(a: sft.SFTStats, b: sft.SFTStats) -> sft.SFTStats:
    return sft.SFTStats(a.rows + b.rows, a.examples + b.examples, a.nothing_to_learn + b.nothing_to_learn)


# -- encoding --------------------------------------------------------------------------------------

def encoded(path: str, fmt: str, tokenizer, options, cache_dir, tokenizer_folder, split: str):
    """(examples, SFTStats, cache file, whether read from it) of one split."""
    kind, files = hf_data.source_files(path)
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else repr(template)  # a dict of named ones
    extra = [CACHE_VERSION, "sft", fmt, options.assistant_only_loss, options.completion_only_loss,
             hashlib.sha256(template.encode()).hexdigest()]
    key = hf_data.cache_key(kind, Path(path), files, tokenizer, tokenizer_folder, 0, fmt,
                            split if kind == "saved" else None, extra)
    cache_file = Path(cache_dir) / f"sft-{key[:24]}.npz"
    cached = _read_cache(cache_file)
    if cached is not None:
        return (*cached, cache_file, True)
    examples, stats = encode(path, fmt, tokenizer, options, split)
    _write_cache(cache_file, examples, stats)
    return examples, stats, cache_file, False


def encode(path: str, fmt: str, tokenizer, options, split: str = hf_data.TRAIN_SPLIT):
    """Every row of the split as {"input_ids", "labels"} (sft.encode_row), each error naming its
    row by file line (or save_to_disk row); rows with nothing to learn counted and left out."""
    rows = list(hf_data.records(path, split))
    chat = None
    if fmt != "prompt_completion" or (rows and not isinstance(rows[0][1].get("prompt"), str)):
        chat = chat_template(tokenizer, fmt)
    stats, examples = sft.SFTStats(), []
    for where, row in rows:
        stats.rows += 1
        example = sft.encode_row(row, fmt, tokenizer, chat, where=f"--dataset {where}",
                                 assistant_only_loss=options.assistant_only_loss,
                                 completion_only_loss=options.completion_only_loss)
        if example is None:
            stats.nothing_to_learn += 1
        else:
            examples.append(example)
    stats.examples = len(examples)
    if not rows:
        raise InputError(f"--dataset {path} holds no rows")
    return examples, stats


def chat_template(tokenizer, fmt: str) -> ChatTemplate:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InputError(f"the tokenizer of --model {getattr(tokenizer, 'name_or_path', '')} has no "
                         f"chat template, which {fmt} rows need: pass --chat-template FILE (a Jinja "
                         "chat template)")
    return ChatTemplate(tokenizer)


def use_chat_template(tokenizer, file: str | None) -> None:
    """Replace the tokenizer's chat template with the Jinja text of `file` (--chat-template); it is
    then the one saved with the tokenizer."""
    if file is None:
        return
    try:
        text = Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--chat-template {file} cannot be read: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip():
        raise InputError(f"--chat-template {file} is empty: give a Jinja chat template")
    tokenizer.chat_template = text


# -- the cache -------------------------------------------------------------------------------------

def _read_cache(path: Path):
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            ids, labels, lengths, counts = (data[k] for k in ("ids", "labels", "lengths", "stats"))
    except (OSError, ValueError, KeyError):  # half-written or damaged: encode again
        return None
    ends = np.cumsum(lengths)
    examples = [{"input_ids": ids[end - n:end].tolist(), "labels": labels[end - n:end].tolist()}
                for n, end in zip(lengths.tolist(), ends.tolist())]
    return examples, sft.SFTStats(*map(int, counts))


def _write_cache(path: Path, examples: list[dict], stats: sft.SFTStats) -> None:
    """Written beside its final name and renamed, as hf_data writes its blocks."""
    join = (lambda key: np.concatenate([np.asarray(e[key], dtype=np.int32) for e in examples])
            if examples else np.zeros(0, dtype=np.int32))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, ids=join("input_ids"), labels=join("labels"),
                     lengths=np.asarray([len(e["input_ids"]) for e in examples], dtype=np.int64),
                     stats=np.asarray([stats.rows, stats.examples, stats.nothing_to_learn]))
        os.replace(temp, path)
    except OSError as exc:
        raise InputError(f"the token cache {path.parent} cannot be written: {exc.strerror}: choose "
                         "another --cache-dir or output_dir") from None


# -- the run header --------------------------------------------------------------------------------

def counted(n: int, noun: str) -> str:
    """"1 block", "0 blocks", "3 rows": a count and its noun, in the number it takes."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def split_sizes(train: int, held_out: int, noun: str) -> str:
    """"8 training and 2 validation blocks", or with a count of one, "8 training blocks and 1
    validation block"."""
    if train != 1 and held_out != 1:
        return f"{train} training and {held_out} validation {noun}s"
    return f"{counted(train, 'training ' + noun)} and {counted(held_out, 'validation ' + noun)}"


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
