"""Which split a file of a data folder belongs to, by its name, as datasets' `load_dataset(path)`
(and `data_dir=`) decides it (datasets/data_files.py, SPLIT_KEYWORDS and the patterns built from
them), so that a folder of `train.jsonl` and `test.jsonl`, or a Hub snapshot of
`data/train-00000-of-00002.parquet` and `data/test-00000-of-00001.parquet`, is read as the splits
its author meant, and a test file is never trained on.

A file's path below the data folder names a split by, in this order:

- the Hub's sharded layout `data/{split}-NNNNN-of-NNNNN*.*` (the split is the name before the
  shard number: `data/unsupervised-...` is a split of its own, read by no run);
- a folder on the way to it named for a split: the keyword alone, or at either end of, or within,
  the name, set off by one of `-._ 0-9` (`train/`, `valid_2/`, `my-test/`);
- its file name: starting with the keyword, or holding it, followed by one of those characters
  (`train.jsonl`, `dev-00001.parquet`, `wiki.test.txt`, `val2.jsonl`).

Keywords (datasets' SPLIT_KEYWORDS): train, training -> train; validation, valid, dev, val ->
validation; test, testing, eval, evaluation -> test. Where one name matches two splits, the split
further from training wins (test, then validation), so that what its name calls held out is.

Files that name no split are the training split where no file names it (a folder without split
names reads as it always did, and a `validation/` subfolder beside unnamed shards, as --streaming
lays them out, is the validation split); beside files named for training they are left out, as
datasets leaves them, and said so.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

TRAIN, VALIDATION, TEST = "train", "validation", "test"
KEYWORDS = {TRAIN: ("train", "training"), VALIDATION: ("validation", "valid", "dev", "val"),
            TEST: ("test", "testing", "eval", "evaluation")}
"""datasets' SPLIT_KEYWORDS (datasets 2.14 to 5.x)."""
SEPARATORS = "-._ 0-9"
"""datasets' NON_WORDS_CHARS: what sets a keyword off within a name."""
_SEP = f"[{SEPARATORS}]"
_BY_PRIORITY = (TEST, VALIDATION, TRAIN)
_IN_FOLDER_NAME = {split: re.compile(rf"(?:^|{_SEP})(?:{'|'.join(words)})(?:{_SEP}|$)")
                   for split, words in KEYWORDS.items()}
_IN_FILE_NAME = {split: re.compile(rf"(?:^|{_SEP})(?:{'|'.join(words)}){_SEP}")
                 for split, words in KEYWORDS.items()}
_SHARDED = re.compile(r"^data/(\w+(?:\.\w+)*)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*$")
"""datasets' SPLIT_PATTERN_SHARDED, data/{split}-[0-9]*5-of-[0-9]*5*.*, the Hub's Parquet layout."""


def _keyword_split(name: str, patterns: dict) -> str | None:
    return next((split for split in _BY_PRIORITY if patterns[split].search(name)), None)


def split_of(relative: PurePosixPath | str) -> str | None:
    """The split that a file's path below its data folder names ("train", "validation", "test",
    or a sharded file's own split name), or None when it names none."""
    relative = PurePosixPath(relative)
    sharded = _SHARDED.match(relative.as_posix())
    if sharded:
        name = sharded.group(1)
        return _keyword_split(name, _IN_FOLDER_NAME) or name
    for folder in relative.parts[:-1]:
        split = _keyword_split(folder, _IN_FOLDER_NAME)
        if split:
            return split
    return _keyword_split(relative.name, _IN_FILE_NAME)


@dataclass
class FolderSplits:
    """A data folder's files by split: `files` in split order (train, validation, test, then any
    other, each split's files in the folder's sorted order), `unnamed` the files left out."""

    files: dict[str, list[Path]] = field(default_factory=dict)
    unnamed: list[Path] = field(default_factory=list)
    """Files that name no split, beside files named for training: read by no run."""
    named: bool = False
    """Whether any file names a split (False: every file is the training split, as it always was)."""

    def of(self, split: str) -> list[Path]:
        return self.files.get(split, [])


def folder_splits(root: Path, files: list[Path]) -> FolderSplits:
    """`files` (below `root`) by the split their paths name; see the module's docstring."""
    named: dict[str, list[Path]] = {}
    unnamed: list[Path] = []
    for file in files:
        split = split_of(file.relative_to(root).as_posix())
        (named.setdefault(split, []) if split else unnamed).append(file)
    result = FolderSplits(named=bool(named))
    if TRAIN not in named and unnamed:
        named[TRAIN], unnamed = unnamed, []
    order = [s for s in (TRAIN, VALIDATION, TEST) if s in named] + sorted(set(named) - set(KEYWORDS))
    result.files = {split: named[split] for split in order}
    result.unnamed = unnamed
    return result


def describe(root: Path, splits: FolderSplits, read: tuple[str, ...] | None = None,
             shown: int = 2) -> str:
    """"train: train.jsonl; validation: dev.jsonl; test: test.jsonl (not read)": each split's
    files relative to `root`, the first `shown` named and the rest counted; when `read` is given,
    the splits other than those marked as not read; the files left out named."""
    def names(files: list[Path]) -> str:
        listed = ", ".join(f.relative_to(root).as_posix() for f in files[:shown])
        return listed + (f" and {len(files) - shown} more" if len(files) > shown else "")

    parts = [f"{split}: {names(files)}" + ("" if read is None or split in read else " (not read)")
             for split, files in splits.files.items()]
    if splits.unnamed:
        parts.append(f"left out, naming no split beside the train files: {names(splits.unnamed)}")
    return "; ".join(parts)
