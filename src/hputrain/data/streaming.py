"""A corpus read as a stream: a folder of JSON Lines or Parquet shards, each rank reading its own,
rows tokenized and packed on the fly, the stream's position saved with each checkpoint.

Why plain readers per shard, not datasets' streaming mode: a position here is exact and small
(which shard of this rank, how many rows of it, the byte offset in a JSON Lines file), resuming
seeks straight to it (a JSON Lines offset, a Parquet row group from the file's metadata) instead
of re-reading, and the assignment of shards to ranks is ours to state: shard i (in sorted order)
is read by rank i % world_size, and by no other.

`ShardStream` is an IterableDataset with `reads_own_shards = True`: data.MicroBatches then gives it
its rank (`take_rank`) and never slices its samples; it saves `state_dict()` after every
micro-batch and restores it with `load_state_dict`. One pass over this rank's shards is an epoch;
`next_epoch` starts the next pass, which MicroBatches calls on every rank as soon as one rank's
shards run out (an agreement through the process group), so every rank takes the same steps; what
the other ranks had left is then never read, and `pass_ended` says what, once, in one line.

Rows become samples in one of three ways (`packing`):

  "text"    the encoder returns a row's token ids (eos appended); they are joined and cut into
            blocks of block_size tokens, as recipes/hf/data.py does for a whole corpus. The
            position keeps the tokens read but not yet in a block (`pending`); they carry over
            from one shard to the next, and are dropped at the end of a pass.
  "packed"  the encoder returns an SFT example ({"input_ids", "labels"}, or None when it has
            nothing to learn); `buffer` examples at a time are packed into blocks with restarting
            position_ids (packing.pack). The position is that of the buffer's first row and the
            number of its blocks already given out (`pending`): a resumed stream reads the buffer's
            rows again, packs them the same way and skips those blocks.
  "rows"    one example a row (unpacked SFT), cut to block_size, padded per batch by the collator.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ..errors import InputError
from .batching import walk_sorted
from .packing import pack, unpacked
from .splits import TRAIN, VALIDATION, FolderSplits, describe, folder_splits

SHARD_SUFFIXES = (".jsonl", ".parquet")
"""The files a shard folder is made of."""
PARQUET_BATCH_ROWS = 1024
"""Rows read from a Parquet file at a time."""
PACKINGS = ("text", "packed", "rows")


def find_shards(folder: str | Path, what: str = "--dataset") -> list[Path]:
    """The training shards under `folder` (or `folder` itself, one shard), in sorted order: the
    train split of its shards by their names (data/splits.py; validation and test shards left
    out); one line when there are none."""
    root = Path(folder)
    if root.is_file() and root.suffix.lower() in SHARD_SUFFIXES:
        return [root]  # one shard
    splits = shard_splits(root, what)
    if not splits.of(TRAIN):
        held = f" outside its other splits ({describe(root, splits)})" if splits.files else ""
        raise InputError(f"{what} {folder} holds no .jsonl or .parquet shards{held}: --streaming "
                         "reads a folder of them")
    return splits.of(TRAIN)


def validation_shards(folder: str | Path) -> list[Path]:
    """The validation split's shards of `folder` (its validation/ subfolder's, a dev.jsonl), or []
    when it has none."""
    root = Path(folder)
    return shard_splits(root).of(VALIDATION) if root.is_dir() else []


def shard_splits(root: Path, what: str = "--dataset") -> FolderSplits:
    """The shard files under the folder `root` by split (data/splits.py)."""
    if not root.is_dir():
        raise InputError(f"{what} {root} is not a folder: --streaming reads a folder of JSON Lines "
                         "(.jsonl) or Parquet (.parquet) shards")
    return folder_splits(root, [path for path in walk_sorted(root, None)
                                if path.suffix.lower() in SHARD_SUFFIXES])


def read_rows(path: Path, row: int = 0, offset: int = 0) -> Iterator[tuple[dict, int, int]]:
    """(record, rows read so far, byte offset after it) for each row of a shard after the first
    `row` rows; `offset` is where those end in a JSON Lines file (Parquet ignores it)."""
    if path.suffix.lower() == ".parquet":
        return _parquet_rows(path, row)
    return _jsonl_rows(path, row, offset)


def _jsonl_rows(path: Path, row: int, offset: int) -> Iterator[tuple[dict, int, int]]:
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise InputError(f"--dataset {path} cannot be read: {exc.strerror}") from None
    with handle:
        handle.seek(offset)
        for line in handle:
            offset += len(line)
            if not line.strip():
                continue
            row += 1
            try:
                record = json.loads(line)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
                raise InputError(f"--dataset {path} row {row} is not a JSON object ({exc}): a JSON "
                                 "Lines shard holds one object a line") from None
            if not isinstance(record, dict):
                raise InputError(f"--dataset {path} row {row} is {type(record).__name__}, not an "
                                 "object of fields")
            yield record, row, offset


def _parquet_rows(path: Path, row: int) -> Iterator[tuple[dict, int, int]]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise InputError(f"--dataset {path} cannot be read as Parquet: "
                         f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    first, before = 0, 0  # the first row group holding rows past `row`, and the rows before it
    while first < file.num_row_groups and before + file.metadata.row_group(first).num_rows <= row:
        before += file.metadata.row_group(first).num_rows
        first += 1
    at = before
    groups = list(range(first, file.num_row_groups))
    for batch in file.iter_batches(PARQUET_BATCH_ROWS, row_groups=groups) if groups else ():
        for record in batch.to_pylist():
            at += 1
            if at > row:
                yield record, at, 0


def _is_count(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_tokens(value) -> bool:
    return isinstance(value, list) and all(map(_is_count, value))


def _check_offset(shard: Path, offset: int) -> None:
    """Raise ValueError unless `offset` is where a line of a JSON Lines shard starts (Parquet
    positions have none): a shard changed since the checkpoint would be read from mid-line."""
    if offset == 0 or shard.suffix.lower() == ".parquet":
        return
    try:
        with open(shard, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            handle.seek(min(offset, size) - 1)
            before = handle.read(1)
    except OSError as exc:
        raise ValueError(f"its shard {shard} cannot be read: {exc.strerror}") from None
    if offset > size:
        raise ValueError(f"its offset {offset} is past the end of {shard} ({size} bytes): the shard "
                         "changed since the checkpoint was saved")
    if before != b"\n" and offset < size:  # the end of a last line without its newline is one
        raise ValueError(f"its offset {offset} is not the start of a line of {shard}: the shard "
                         "changed since the checkpoint was saved")


def first_row(shards: list[Path]) -> tuple[dict, str]:
    """(the first row of the first shard that has one, where it is) to tell the data's shape."""
    for shard in shards:
        for record, row, _ in read_rows(shard):
            return record, f"{shard} row {row}"
    raise InputError(f"--dataset: its shards ({shards[0].parent}) hold no rows")


class ShardStream(IterableDataset):
    """This rank's shards as a stream of blocks (or rows): see the module docstring.

    `encode(record, where)` turns a row into token ids ("text") or an SFT example ("packed",
    "rows"); `where` names the row in its errors."""

    reads_own_shards = True
    """MicroBatches' cue that this data set is already this rank's: it calls take_rank and keeps
    every sample, where it would otherwise take this rank's slice of each micro-batch."""

    def __init__(self, shards: list[Path], encode: Callable, *, block_size: int,
                 packing: str = "text", pad_token_id: int = 0, buffer: int = 256) -> None:
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
        if not shards:
            raise InputError("--dataset holds no shards to stream")
        self.all_shards, self.encode = list(shards), encode
        self.block_size, self.packing, self.pad_token_id, self.buffer = block_size, packing, pad_token_id, buffer
        self.take_rank(0, 1)

    def take_rank(self, rank: int, world_size: int, agree: Callable = list,
                  notify: Callable | None = None) -> None:
        """Read shard i on rank i % world_size only, from the start; `agree` (values -> their
        sums over the ranks) ends passes together, `notify` (line -> None) hears what they leave
        unread (pass_ends)."""
        if len(self.all_shards) < world_size:
            raise InputError(f"--streaming: --dataset has {len(self.all_shards)} shard(s) for "
                             f"{world_size} data-parallel ranks, and each rank reads its own shards: "
                             f"split the data into at least {world_size} files")
        self.rank, self.world_size = rank, world_size
        self.shards = self.all_shards[rank::world_size]
        self.agree, self.notify, self._told_unread = agree, notify, False
        self._state = self._start(0)

    # -- the position ---------------------------------------------------------------------------
    def _start(self, epoch: int) -> dict:
        return self._at(epoch, 0, 0, 0, [] if self.packing == "text" else 0)

    def _at(self, epoch: int, shard: int, row: int, offset: int, pending) -> dict:
        name = self.shards[shard].name if shard < len(self.shards) else None
        return {"epoch": epoch, "shard": shard, "file": name, "row": row, "offset": offset,
                "pending": pending, "rank": self.rank, "world_size": self.world_size}

    def state_dict(self) -> dict:
        """The position after the last sample given out (JSON-ready)."""
        pending = self._state["pending"]
        return {**self._state, "pending": pending.tolist() if isinstance(pending, np.ndarray) else pending}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; one line when it is not a position in these shards
        with this number of ranks (check_position)."""
        try:
            self.check_position(state)
        except ValueError as error:
            raise InputError(f"the checkpoint's stream position: {error}") from None
        self._state = self._at(state["epoch"], state["shard"], state["row"], state["offset"],
                               state["pending"])

    def check_position(self, state) -> None:
        """Raise ValueError (the reason, in words) unless `state` is a position this rank can
        continue from: every field of its kind (a crafted or damaged file would seek to a
        negative offset, or index with a string), saved by this rank of as many, in a shard this
        rank reads, at the start of a line of it."""
        if not isinstance(state, dict):
            raise ValueError("it is not a JSON object")
        whole = {"epoch": 0, "shard": 0, "row": 0, "offset": 0, "rank": 0, "world_size": 1}
        for key, least in whole.items():
            value = state.get(key)
            if not _is_count(value, least):
                raise ValueError(f"{key} must be a whole number >= {least}, not {json.dumps(value)[:40]}")
        pending = state.get("pending")
        tokens = self.packing == "text"
        if not (_is_tokens(pending) if tokens else _is_count(pending)):
            raise ValueError(f"pending must be {'a list of token ids' if tokens else 'a whole number >= 0'}"
                             f", not {json.dumps(pending)[:40]}")
        if (state["rank"], state["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"it is rank {state['rank']} of {state['world_size']}'s position, and this "
                             f"is rank {self.rank} of {self.world_size}: resume a --streaming run on as "
                             "many processes as it was saved with")
        shard, name = state["shard"], state.get("file")
        if shard >= len(self.shards) or self.shards[shard].name != name:
            raise ValueError(f"it names shard {str(name)[:80]!r} (number {shard} of rank {self.rank}), "
                             "which this --dataset does not hold there: resume with the same shards")
        _check_offset(self.shards[shard], state["offset"])

    def next_epoch(self) -> None:
        """Start the next pass over this rank's shards (what is pending is dropped)."""
        self._state = self._start(self._state["epoch"] + 1)

    @property
    def epoch(self) -> int:
        return self._state["epoch"]

    # -- where a pass ends, and what it leaves unread --------------------------------------------
    def pass_ends(self, left: bool, empty: bool, position: dict, batch_size: int) -> bool:
        """Whether this pass ends on every rank, asked before each micro-batch on all of them (one
        small host all-reduce): it does as soon as one rank has none `left`. Raises InputError
        when a rank had none since a fresh pass began (`empty`); at the first end, says through
        `notify` what the ranks that still had samples leave (pass_ended)."""
        ended, none = self.agree([not left, not left and empty])
        if none:
            raise InputError("--streaming: a rank's shards hold less than one micro-batch "
                             f"({batch_size} samples): give every rank more data")
        line = self.pass_ended(left, position) if ended else None
        if line and self.notify:
            self.notify(line)
        return bool(ended)

    def pass_ended(self, left: bool, position: dict) -> str | None:
        """Called on every rank when the ranks agree that a pass ended, the first time only with
        effect: where each rank that still had samples (`left`) stopped (`position`, after its last
        micro-batch), summed over the ranks by `agree`, as one line (on every rank). Every pass
        ends at the same place, so what those ranks leave is never read: their shards hold more
        than the shortest rank's. None when nothing is left, or already said."""
        if self.world_size == 1 or self._told_unread:
            return None
        self._told_unread = True
        n, at = self.world_size, self.unread_from(position) if left else None
        mine = [0.0] * (3 * n)
        mine[self.rank] = 1.0  # context-parallel ranks share a data-parallel rank: each reports it
        if at is not None:
            mine[n + self.rank], mine[2 * n + self.rank] = at[0] + 1, at[1]
        summed = self.agree(mine)
        places = {k: (round(summed[n + k] / summed[k]) - 1, round(summed[2 * n + k] / summed[k]))
                  for k in range(n) if summed[k]}
        unread = [f"rank {k}: {self.unread(k, *place)}" for k, place in places.items()
                  if place[0] >= 0]
        if not unread:
            return None
        ran_out = ", ".join(str(k) for k, place in places.items() if place[0] < 0)
        return (f"warning: --streaming's pass ended when rank {ran_out}'s shards ran out (every rank "
                "then starts its next pass, so that all take the same steps), and every pass ends "
                f"there, so these are never read: {'; '.join(unread)}. Give every rank as much "
                f"data: shards of even size, as many per rank ({n} ranks)")

    def unread_from(self, state: dict) -> tuple[int, int] | None:
        """(shard, rows of it read) where what this rank has not given out of its pass begins,
        at `state`; None when its shards are read to the end (the tokens left pending then are
        dropped by design)."""
        shard, row = state["shard"], state["row"]
        path = self.shards[shard]
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            done = row >= pq.ParquetFile(path).metadata.num_rows
        else:
            done = state["offset"] >= path.stat().st_size
        if done:
            shard, row = shard + 1, 0
        return (shard, row) if shard < len(self.shards) else None

    def unread(self, rank: int, shard: int, row: int) -> str:
        """The shards of `rank` from (shard, rows of it read) on, by name: what it leaves unread."""
        mine = self.all_shards[rank::self.world_size][shard:]
        names = [f"{mine[0].name} after row {row}" if row else mine[0].name] + [p.name for p in mine[1:]]
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")

    # -- the samples ------------------------------------------------------------------------------
    def __iter__(self):
        """The samples from the current position to the end of this pass; state_dict() follows."""
        start = dict(self._state)
        make = {"text": self._text_blocks, "packed": self._packed_blocks, "rows": self._rows}
        for sample, state in make[self.packing](start):
            self._state = state
            yield sample
        self._state = self._start(start["epoch"] + 1)

    def _read(self, state: dict) -> Iterator[tuple[dict, str, tuple[int, int, int]]]:
        """(record, where, (shard, rows read, offset) after it) from `state` to the pass's end."""
        row, offset = state["row"], state["offset"]
        for shard in range(state["shard"], len(self.shards)):
            path = self.shards[shard]
            for record, row, offset in read_rows(path, row, offset):
                yield record, f"--dataset {path} row {row}", (shard, row, offset)
            row, offset = 0, 0

    def _text_blocks(self, state: dict):
        """Blocks of the tokens pending at `state` (a saved position may hold several), then of
        each row's tokens joined to what is left."""
        block, at, rows = self.block_size, (state["shard"], state["row"], state["offset"]), self._read(state)
        tokens = np.asarray(state["pending"], dtype=np.int64)
        while True:
            count = len(tokens) // block
            for k in range(count):  # what is left after block k is a view: no copy per block
                ids = torch.from_numpy(tokens[k * block:(k + 1) * block].copy())
                yield ({"input_ids": ids, "labels": ids.clone()},
                       self._at(state["epoch"], *at, tokens[(k + 1) * block:]))
            item = next(rows, None)
            if item is None:
                return
            record, where, at = item
            tokens = np.concatenate([tokens[count * block:],
                                     np.asarray(self.encode(record, where), dtype=np.int64)])

    def _packed_blocks(self, state: dict):
        """Buffers of `buffer` examples packed into blocks; the position of a block inside a buffer
        is the buffer's first row and the blocks of it given out."""
        group, skip = (state["shard"], state["row"], state["offset"]), state["pending"]
        rows = self._read(state)
        while True:
            examples, end, done = [], group, True
            for record, where, at in rows:
                end, example = at, self.encode(record, where)
                if example is not None:
                    examples.append(example)
                if len(examples) == self.buffer:
                    done = False
                    break
            blocks = pack(examples, self.block_size, self.pad_token_id)[0] if examples else []
            for k in range(skip, len(blocks)):
                after = (*end, 0) if k == len(blocks) - 1 else (*group, k + 1)
                yield blocks[k], self._at(state["epoch"], *after)
            if done:
                return
            group, skip = end, 0

    def _rows(self, state: dict):
        for record, where, at in self._read(state):
            example = self.encode(record, where)
            rows = unpacked([example], self.block_size, self.pad_token_id)[0] if example else []
            for row in rows:
                yield row, self._at(state["epoch"], *at, 0)
