"""The Hugging Face recipe's data: local text in one of four shapes, tokenized once, packed into
blocks of equal length, cached on disk.

Shapes: a UTF-8 text file; a folder of text files; a file of records (rows of fields: JSON Lines
.jsonl, .json holding lines or one array, or Parquet) with a text field, or a folder of such files
(shards, read in sorted order); a folder written by datasets' save_to_disk. A folder's files are
split by their names as datasets' load_dataset splits them (data/splits.py: `train.jsonl`,
`dev.jsonl`, `test.jsonl`, `data/test-00000-of-00001.parquet`, a `validation/` subfolder as
--streaming lays shards out): the train split is trained on, the validation split validated on,
and the test split read only by `hputrain evaluate --split test`. A folder's files are read by their
kind: one of record files and other files is refused, as is one whose files hold rows of different
kinds (chat rows beside preference pairs), since the method comes from the rows' fields.
A document is a file, a record or a row: its tokens are followed by the tokenizer's eos token, then
everything is cut into blocks of `block_size` tokens (the tail shorter than a block is dropped,
as run_clm does), so that every step has the same shapes and graph-compiling devices compile once.

Validation, as run_clm does it: a DatasetDict (save_to_disk) with a "validation" split, or a
folder with files named for it, is evaluated on that split, packed the same way by itself; any
other data set holds out the last `validation_percentage` percent of its blocks.

The blocks are cached in one int32 .npy file per split whose name is a hash of what decides them
(the data set's files with their sizes and modification times, the split, the tokenizer's files,
the block size, the text field), so a second run with the same inputs reads them back instead of
tokenizing again. The first process of a node to need them tokenizes (in --dataset-num-proc
processes) while the others wait on the cache's lock (data/token_store.py), and every rank reads
the file memory-mapped: one copy of the tokens per node, in the page cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...data import sft, token_store
from ...data.batching import walk_sorted
from ...data.splits import FolderSplits, describe, folder_splits
from ...data.streaming import read_rows
from ...errors import InputError
from ...files import NotARegularFile, open_regular_file, read_regular_file

CACHE_VERSION = 1  # bump when the packing changes, so old cache files are not read
PIECE_CHARS = 1 << 16  # a long document is tokenized in pieces cut at line ends: bounded memory
BATCH_PIECES = 256  # pieces per tokenizer call: the fast tokenizers work a batch in parallel
SHAPES = ("a UTF-8 text file, a folder of text files, a JSON Lines or Parquet file with a text "
          "field (or a folder of them), or a folder written by datasets' save_to_disk")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")
"""Files of records (rows of fields), alone or in a folder; any other file is read as text."""
BESIDE_RECORDS = (".md", ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff")
"""Files a folder of records may hold that are not data: its card (README.md, as a Hugging Face
data set folder has) and the images its rows name (images/0001.png beside train.jsonl)."""
SHAPE_COLUMNS = ("messages", "conversations", "prompt", "completion", "chosen", "rejected")
"""The fields that decide a row's method (SFT, DPO, GRPO, or text without any of them)."""
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
SPLITS_FILE = "dataset_dict.json"  # a DatasetDict's save_to_disk names its splits here
TRAIN_SPLIT, VALIDATION_SPLIT = "train", "validation"  # run_clm's names
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja")


class BlockDataset(torch.utils.data.Dataset):
    """Rows of a [blocks, block_size] token array as {input_ids, labels}: labels are the inputs,
    the model shifts them (every Hugging Face causal LM does)."""

    def __init__(self, blocks: np.ndarray) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict:
        ids = torch.from_numpy(np.array(self.blocks[index], dtype=np.int64))
        return {"input_ids": ids, "labels": ids.clone()}


@dataclass
class Blocks:
    train: BlockDataset
    validation: BlockDataset | None
    cache_file: Path
    from_cache: bool
    own_validation: bool = False
    """The validation blocks are the data set's own validation split (not held out of train)."""


def load_blocks(path: str, tokenizer, block_size: int, *, text_column: str = "text",
                validation_percentage: float = 5, cache_dir: str | Path,
                tokenizer_folder: str | Path | None = None, workers: int | None = None,
                split: str = TRAIN_SPLIT) -> Blocks:
    """The data set at `path` as training and validation blocks: its own "validation" split,
    else the last `validation_percentage` percent of the blocks (at least one). A percentage of
    0 means no validation blocks either way. `split`: the split read as the training blocks
    (hputrain evaluate --split reads another). The first process of the node to get here
    tokenizes, in `workers` processes (default: one per core, at most 8); the others wait for
    its cache and read it (token_store.made_once)."""
    workers = token_store.check_workers(workers)
    source = Path(path)
    own = validation_percentage > 0 and VALIDATION_SPLIT in saved_splits(path)

    def blocks_of(split: str, where: str) -> tuple[np.ndarray, Path, bool]:
        kind, files = _source(source, split)
        key = cache_key(kind, source, files, tokenizer, tokenizer_folder, block_size, text_column,
                         split if kind == "saved" else None)
        cache_file = Path(cache_dir) / f"blocks-{key[:24]}.npy"

        def make() -> np.ndarray:
            documents = _documents(kind, source, files, text_column, split)
            return pack(token_ids(documents, tokenizer, workers), block_size, where)

        blocks, cached = token_store.made_once(cache_file, lambda f: _read_cache(f, block_size),
                                               make, _write_cache)
        return blocks, cache_file, cached

    blocks, cache_file, from_cache = blocks_of(split, path if split == TRAIN_SPLIT
                                               else f"{path} (its {split} split)")
    if own:
        held_out, _, cached = blocks_of(VALIDATION_SPLIT, f"{path} (its {VALIDATION_SPLIT} split)")
        return Blocks(BlockDataset(blocks), BlockDataset(held_out), cache_file, from_cache and cached,
                      own_validation=True)
    train, validation = hold_out_blocks(blocks, validation_percentage, path)
    return Blocks(BlockDataset(train), None if validation is None else BlockDataset(validation),
                  cache_file, from_cache)


def token_ids(documents, tokenizer, workers: int = 1) -> np.ndarray:
    """Every document's tokens followed by eos (when the tokenizer has one), in one array;
    tokenized in `workers` processes, BATCH_PIECES pieces at a time, joined in order."""
    parts = token_store.chunks(_marked_pieces(documents), BATCH_PIECES)
    out = list(token_store.ordered_map(_encode_pieces, tokenizer, parts, workers))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


def _marked_pieces(documents) -> Iterator[tuple[str, bool]]:
    """(piece, whether it is its document's last) for every piece of every document: a long
    document is split across workers too."""
    for document in documents:
        pieces = list(_pieces(document))
        for i, piece in enumerate(pieces):
            yield piece, i == len(pieces) - 1


def _encode_pieces(tokenizer, pieces: list[tuple[str, bool]]) -> np.ndarray:
    """The tokens of (piece, whether it ends its document) pairs, eos after each document's last."""
    eos = tokenizer.eos_token_id
    encoded = tokenizer([piece for piece, _ in pieces], add_special_tokens=False,
                        verbose=False)["input_ids"]
    return np.concatenate([np.asarray(ids + ([eos] if last and eos is not None else []),
                                      dtype=np.int32) for ids, (_, last) in zip(encoded, pieces)])


def pack(ids: np.ndarray, block_size: int, path: str) -> np.ndarray:
    """[blocks, block_size]: the tail shorter than a block is dropped."""
    if len(ids) == 0:
        raise InputError(f"--dataset {path} holds no text: give it some, or point --dataset at "
                         f"{SHAPES}")
    count = len(ids) // block_size
    if count == 0:
        raise InputError(f"--dataset {path} has {len(ids)} tokens, fewer than one block of "
                         f"{block_size}: give more text or a smaller --block-size")
    return ids[:count * block_size].reshape(count, block_size)


def hold_out_blocks(blocks: np.ndarray, percentage: float, path: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(training blocks, validation blocks): the validation share is taken from the end."""
    if percentage <= 0:
        return blocks, None
    held_out = max(1, int(len(blocks) * percentage / 100))
    if held_out >= len(blocks):
        raise InputError(f"--dataset {path} packs into {len(blocks)} block(s) of {blocks.shape[1]} "
                         f"tokens, too few to hold {percentage:g}% out for validation: give more "
                         "text, a smaller --block-size, or --validation-split-percentage 0")
    return blocks[:-held_out], blocks[-held_out:]


# -- what the data set is ----------------------------------------------------------------------

def columns_of(path: str) -> list[str] | None:
    """The data set's columns: a save_to_disk folder's, or the first record's fields of a file
    of records (of each file of a folder of them, every split's, which must agree on the fields
    that decide the method); None for plain text (a file or a folder of them)."""
    source = Path(path)
    kind, layout = _layout(source)
    if kind == "saved":
        return list(_load_saved(source)[0].column_names)
    if kind not in ("jsonl", "records"):
        return None
    files = [file for split_files in layout.files.values() for file in split_files]
    firsts = [(file, _file_fields(file)) for file in files]
    firsts = [(file, fields) for file, fields in firsts if fields is not None] or [(source, [])]
    _one_kind_of_row(source, firsts)
    return firsts[0][1]


def _file_fields(path: Path) -> list[str] | None:
    """The field names of a file of records: its first record's, or a Parquet file's schema's,
    which reads no row (pyarrow reads a row group's column chunks whole: of a file of images,
    hundreds of megabytes for one row); None when the file holds no record."""
    if path.suffix.lower() != ".parquet":
        return _fields(_first_record(path))
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (OSError, ValueError):  # read by _first_record, whose errors say what is wrong
        return _fields(_first_record(path))
    return list(file.schema_arrow.names) if file.metadata.num_rows else None


def _fields(first: tuple[str, object] | None) -> list[str] | None:
    """A record's field names ([] when it is not an object of fields); None for no record."""
    if first is None:
        return None
    return list(first[1]) if isinstance(first[1], dict) else []


def _one_kind_of_row(folder: Path, firsts: list[tuple[Path, list[str]]]) -> None:
    """One line when the files' first rows differ in the fields that decide the method."""
    shapes: dict[tuple, tuple[Path, list[str]]] = {}
    for file, fields in firsts:
        shapes.setdefault(tuple(c for c in SHAPE_COLUMNS if c in fields), (file, fields))
    if len(shapes) > 1:
        (a, a_fields), (b, b_fields) = list(shapes.values())[:2]
        raise InputError(f"--dataset {folder} mixes rows of different kinds: {a.relative_to(folder)} "
                         f"has {', '.join(map(str, a_fields)) or 'no fields'}, "
                         f"{b.relative_to(folder)} has {', '.join(map(str, b_fields)) or 'no fields'}: "
                         "the method comes from the rows' fields, so give one kind of row per data set")


def records(path: str, split: str = TRAIN_SPLIT) -> Iterator[tuple[str, dict]]:
    """(where, row) for each row of a file of records, of each file of a folder of them that
    belongs to `split` (in sorted order), or of a save_to_disk folder (a DatasetDict: its
    `split`); `where` names the row in errors."""
    source = Path(path)
    kind, files = _source(source, split)
    if kind == "saved":
        data, name = _load_saved(source, split)
        for number, row in enumerate(data):
            yield f"{name} row {number}", row
        return
    for file in files:
        for where, record in _file_records(file):
            if not isinstance(record, dict):
                raise InputError(f"--dataset {where} is {type(record).__name__}, not an object of fields")
            yield where, record


def saved_splits(path: str) -> list[str]:
    """The split names of a save_to_disk DatasetDict folder, or of a folder whose files name
    splits (["train", "validation"] for one with a validation/ subfolder; data/splits.py), []
    for anything else."""
    source = Path(path)
    if not source.is_dir():
        return []
    if any((source / marker).is_file() for marker in SAVED_MARKERS):
        return _saved_splits(source)
    try:
        _, layout = _layout(source)
    except InputError:  # an empty or mixed folder: reading it says so, in one line
        return []
    return list(layout.files) if layout.named else []


def splits_line(path: str, validating: bool = True, *, evaluated: str | None = None) -> str:
    """The run header's line naming the files of each split of a folder that names splits (a
    DatasetDict's split names), the splits the run does not read marked; "" for a data set
    without splits. `validating`: whether the run reads the validation split; `evaluated`: the
    one split hputrain evaluate reads."""
    read = (evaluated,) if evaluated else (TRAIN_SPLIT, VALIDATION_SPLIT) if validating else (TRAIN_SPLIT,)
    source = Path(path)
    if not source.is_dir():
        return ""
    if any((source / marker).is_file() for marker in SAVED_MARKERS):
        names = _saved_splits(source)
        listed = ", ".join(name + ("" if name in read else " (not read)") for name in names)
        return f"hputrain: splits of the DatasetDict: {listed}\n" if len(names) > 1 else ""
    try:
        layout = _layout(source)[1]
    except InputError:  # reading it says why, in one line
        return ""
    if list(layout.files) in ([], [TRAIN_SPLIT]) and not layout.unnamed:
        return ""
    return f"hputrain: splits, by file name: {describe(source, layout, read)}\n"


def check_split(path: str, split: str) -> None:
    """One line when the data set at `path` has no split `split` (before any model is read)."""
    source = Path(path)
    if split == TRAIN_SPLIT:
        _source(source, split)
    elif source.is_dir() and any((source / marker).is_file() for marker in SAVED_MARKERS):
        names = _saved_splits(source)
        if split not in names:
            raise InputError(f"--dataset {path} has no {split!r} split: its DatasetDict holds "
                             f"{', '.join(map(repr, names)) or 'a single Dataset (the train split)'}")
    else:
        _source(source, split)


def _is_record_file(path: Path) -> bool:
    return path.suffix.lower() in RECORD_SUFFIXES


def _source(path: Path, split: str = TRAIN_SPLIT) -> tuple[str, list[Path]]:
    """(kind, the files that make up `split`, in a fixed order). Kinds: "saved" (save_to_disk:
    all its files, whatever the split), "records" (a folder of record files), "folder" (of text
    files), "jsonl" (one file of records, Parquet's too: the name predates them, and it is part
    of the cache keys), "text"; a folder's files split by their names (data/splits.py)."""
    kind, layout = _layout(path)
    if kind == "saved":
        return kind, layout.of(TRAIN_SPLIT)
    files = layout.of(split)
    if files:
        return kind, files
    if not path.is_dir():
        raise InputError(f"--dataset {path} is one file, the train split: --split {split} reads a "
                         "folder's files named for that split (test.jsonl, data/test-*.parquet)")
    if split == TRAIN_SPLIT:
        raise InputError(f"--dataset {path} holds no files to train on: its files name other "
                         f"splits ({describe(path, layout)}); name the training files for the "
                         "train split (train.jsonl, data/train-00000-of-00001.parquet), or give "
                         "files that name no split")
    raise InputError(f"--dataset {path} has no {split} split ({describe(path, layout)}): a file or "
                     f"folder named for it ({split}.jsonl, {split}/) is")


def _layout(path: Path) -> tuple[str, FolderSplits]:
    """(kind, its files by split): a folder of records or text split by file names, the others
    one train split ("saved": every file of the save_to_disk folder)."""
    if not path.exists():
        raise InputError(f"--dataset {path} does not exist: give {SHAPES}")
    if path.is_dir():
        files = walk_sorted(path, suffix=None)  # hidden entries and caches left out, as data.py reads
        if any((path / marker).is_file() for marker in SAVED_MARKERS):
            return "saved", FolderSplits({TRAIN_SPLIT: files})
        if not files:
            raise InputError(f"--dataset {path} is an empty folder: give {SHAPES}")
        rows = [file for file in files if _is_record_file(file)]
        if not rows:
            return "folder", folder_splits(path, files)
        others = [file for file in files
                  if not _is_record_file(file) and file.suffix.lower() not in BESIDE_RECORDS]
        if others:
            other = others[0]
            raise InputError(f"--dataset {path} mixes files of records ({rows[0].relative_to(path)}) "
                             f"with other files ({other.relative_to(path)}), which would be read as "
                             f"plain text: keep one kind of file in the folder (records: "
                             f"{', '.join(RECORD_SUFFIXES)})")
        return "records", folder_splits(path, rows)
    return "jsonl" if _is_record_file(path) else "text", FolderSplits({TRAIN_SPLIT: [path]})


def _saved_splits(path: Path) -> list[str]:
    """The split names of a DatasetDict written by save_to_disk ([] for a single Dataset, or
    a file datasets will refuse when it loads the folder)."""
    try:
        splits = json.loads((path / SPLITS_FILE).read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [name for name in splits if isinstance(name, str)] if isinstance(splits, list) else []


def _documents(kind: str, path: Path, files: list[Path], column: str,
               split: str = TRAIN_SPLIT) -> Iterator[str]:
    if kind == "saved":
        yield from _saved_rows(path, column, split)
    elif kind in ("jsonl", "records"):
        for file in files:
            for where, record in _file_records(file):
                yield _text_field(record, column, where)
    else:
        for file in files:
            yield _read_text(file)


def _read_bytes(path: Path) -> bytes:
    try:
        return read_regular_file(path)
    except NotARegularFile as exc:
        raise InputError(f"--dataset: {exc}: give {SHAPES}") from None
    except OSError as exc:
        raise InputError(f"--dataset {path} cannot be read: {exc.strerror}") from None


def _read_text(path: Path) -> str:
    data = _read_bytes(path)
    if b"\0" in data:
        raise InputError(f"--dataset {path} is not text (it holds NUL bytes): give {SHAPES}")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"--dataset {path} is not UTF-8 text (byte {exc.start}): convert it to "
                         f"UTF-8, or give {SHAPES}") from None


def _file_records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record) for each record of a file of them: Parquet rows (read a batch at a time,
    as --streaming reads them), or JSON (one object a line, or a .json file's one array)."""
    if path.suffix.lower() == ".parquet":
        for record, row, _ in read_rows(path):
            yield f"{path} row {row}", record
    else:
        yield from _json_objects(path)


def _first_record(path: Path) -> tuple[str, object] | None:
    """(where, the first record) of a file of records, or None when it holds none. A JSON Lines
    file is read up to its first row only (its method is decided once per file); what that quick
    read cannot take (a .json array, a line that is not JSON, a FIFO) is read whole, whose
    errors say what is wrong in one line."""
    if path.suffix.lower() != ".parquet":
        try:
            with open_regular_file(path) as handle:
                for number, line in enumerate(handle, 1):
                    text = line.decode("utf-8-sig" if number == 1 else "utf-8").strip()
                    if text.startswith("[") and path.suffix.lower() == ".json":
                        break  # one array: read whole below
                    if text:
                        return f"{path} line {number}", json.loads(text)
                else:
                    return None
        except (OSError, ValueError):  # NotARegularFile, UnicodeDecodeError, JSONDecodeError
            pass
    return next(_file_records(path), None)


def _json_objects(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record) for each record: one JSON object a line, or (a .json file) one array."""
    text = _read_text(path)
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            records = list(enumerate(json.loads(text), 1))
        except json.JSONDecodeError as exc:
            raise InputError(f"--dataset {path} is not valid JSON ({exc.msg}, line {exc.lineno})") from None
        where = "record"
    else:
        records = ((n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip())
        where = "line"
    for number, record in records:
        if isinstance(record, str) and where == "line":
            try:
                record = json.loads(record)
            except json.JSONDecodeError as exc:
                raise InputError(f"--dataset {path} line {number} is not JSON ({exc.msg}): a JSON "
                                 "Lines file holds one object a line") from None
        yield f"{path} {where} {number}", record


def _text_field(record, column: str, where: str) -> str:
    if not isinstance(record, dict) or column not in record:
        has = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise InputError(f"--dataset {where} has no {column!r} field (it has: {has or 'nothing'}): "
                         "name the text field with --text-column")
    value = record[column]
    if not isinstance(value, str):
        raise InputError(f"--dataset {where}: field {column!r} is {type(value).__name__}, not text")
    return value


def _saved_rows(path: Path, column: str, split: str = TRAIN_SPLIT) -> Iterator[str]:
    """The text column of a folder written by save_to_disk (a DatasetDict: its `split`)."""
    data, where = _load_saved(path, split)
    if column not in data.column_names:
        raise InputError(f"--dataset {where} has no {column!r} column (it has: "
                         f"{', '.join(data.column_names)}): name it with --text-column")
    for number, batch in enumerate(data.iter(batch_size=1000)):
        for offset, value in enumerate(batch[column]):
            if not isinstance(value, str):
                raise InputError(f"--dataset {where} row {number * 1000 + offset}: column {column!r} "
                                 f"is {type(value).__name__}, not text")
            yield value


def _load_saved(path: Path, split: str = TRAIN_SPLIT):
    """(the datasets.Dataset of a save_to_disk folder, or its DatasetDict's `split`, how errors
    name it)."""
    try:
        import datasets
    except ImportError:
        raise InputError(f"--dataset {path} was written by datasets' save_to_disk, and datasets is "
                         "not installed: pip install datasets") from None
    try:
        data = datasets.load_from_disk(str(path))
    except (OSError, ValueError, KeyError, FileNotFoundError) as exc:
        raise InputError(f"--dataset {path} cannot be loaded with datasets.load_from_disk: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    where = path
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise InputError(f"--dataset {path} holds the splits {', '.join(data)} and no {split!r}"
                             + (": save the split to train on by itself" if split == TRAIN_SPLIT else ""))
        data = data[split]
        where = f"{path} (its {split} split)" if split != TRAIN_SPLIT else path
    return data, where


def _pieces(text: str) -> Iterator[str]:
    """`text` in pieces of at most PIECE_CHARS, cut after a newline where there is one."""
    start = 0
    while start < len(text):
        end = min(start + PIECE_CHARS, len(text))
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        yield text[start:end]
        start = end


# -- the cache ---------------------------------------------------------------------------------

def source_files(path: str, split: str = TRAIN_SPLIT) -> tuple[str, list[Path]]:
    """(kind, the files that make up the data set's `split`): what a cache key is made of."""
    return _source(Path(path), split)


def cache_key(kind, source: Path, files, tokenizer, tokenizer_folder, block_size, column,
              split: str | None = None, extra: list | None = None) -> str:
    """A hash of what decides the blocks; `split`: which split of a save_to_disk folder (None:
    the other shapes, whose keys are then what they were before splits were read)."""
    digest = hashlib.sha256()
    resolved = source.resolve()
    stats = [(str(f.resolve().relative_to(resolved)) if kind in ("saved", "folder", "records") else f.name,
              f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    decided = [CACHE_VERSION, kind, str(resolved), stats, block_size, column,
               type(tokenizer).__name__, len(tokenizer), tokenizer.eos_token_id]
    digest.update(json.dumps(decided + ([split] if split else []) + (extra or [])).encode())
    folder = Path(tokenizer_folder) if tokenizer_folder else None
    for name in TOKENIZER_FILES:  # the files that decide the tokens, by content
        if folder is not None and (folder / name).is_file():
            digest.update(name.encode() + hashlib.sha256((folder / name).read_bytes()).digest())
    return digest.hexdigest()


def _read_cache(path: Path, block_size: int) -> np.ndarray | None:
    """The cached blocks, or None when there are none (or they are not what this run needs)."""
    if not path.is_file():
        return None
    try:
        blocks = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError):  # a half-written or damaged file: tokenize again
        return None
    ok = blocks.ndim == 2 and blocks.shape[1] == block_size and len(blocks) > 0
    return blocks if ok else None


def _write_cache(path: Path, blocks: np.ndarray) -> None:
    """Written beside its final name and renamed: a run killed mid-write leaves no half file, and
    processes that write the same file at once each rename a whole one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npy")
        with os.fdopen(fd, "wb") as handle:
            np.save(handle, np.ascontiguousarray(blocks), allow_pickle=False)
        os.replace(temp, path)
    except OSError as exc:
        raise InputError(f"the token cache {path.parent} cannot be written: {exc.strerror}: choose "
                         "another --cache-dir or output_dir") from None


def data_method(path: str, text_column: str = "text") -> str:
    """"text", or the SFT row shape (sft.FORMATS) of the data set at `path`, from its columns."""
    columns = columns_of(path)
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
