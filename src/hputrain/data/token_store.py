"""Tokenized data made once per node and shared, memory-mapped, by every process of the node.

A data set is tokenized by the first process of a node to reach it; the others wait for it and
read what it wrote. The protocol is a file lock beside the cache (`made_once`): every process
takes an exclusive fcntl.flock on CACHE.lock, finds the cache there (and reads it) or makes it
(and writes it), then lets the lock go. It needs no process group, so it works before the Trainer
joins the processes; two nodes sharing a file system serialise on the same lock, so each cache is
still written once.

A cache is a folder of .npy files (never .npz, which cannot be memory-mapped) written into a
temporary folder beside its name and renamed into place: a process killed while writing leaves no
half cache under the final name (its temporary folder is left over and ignored). Arrays are read
with mmap_mode="r", so the ranks of a node share the page cache's pages instead of each holding
a copy; nothing is built from them until an item is read.

Ragged data (examples of different lengths) is one flat int32 array per field plus the int64
offsets where each example starts (`Ragged`). Tokenizing runs in `workers` processes over chunks
of rows (`ordered_map`), whose results are joined in the order of the rows: the cache is the same
whatever the number of workers.
"""
from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..errors import InputError

MAX_DEFAULT_WORKERS = 8
"""The default number of tokenizing processes is one per CPU core, at most this many."""


def default_workers() -> int:
    """One tokenizing process per CPU core this process may run on, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WORKERS, cores))


def check_workers(workers: int | None) -> int:
    """`workers` (--dataset-num-proc), or the default when None; anything below 1 is one line."""
    if workers is None:
        return default_workers()
    if not isinstance(workers, int) or workers < 1:
        raise InputError(f"--dataset-num-proc must be a whole number of at least 1, got {workers!r}")
    return workers


@contextmanager
def node_lock(cache: Path):
    """An exclusive lock on CACHE.lock, held for the block: the processes of a node (and of other
    nodes on a shared file system) take turns."""
    lock = cache.with_name(cache.name + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a+b")
    except OSError as exc:
        raise InputError(f"the token cache {cache.parent} cannot be written: {exc.strerror}: choose "
                         "another --cache-dir or output_dir") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as exc:  # ENOLCK, EOPNOTSUPP, ENOSYS: some NFS and Lustre mounts
            raise InputError(f"the token cache {cache.parent} is on a file system without file "
                             f"locks (flock: {exc.strerror}), which the processes of a node take "
                             "turns through: choose a --cache-dir on a local disk (each node then "
                             "makes its own)") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def made_once(cache: Path, read: Callable[[Path], object | None], make: Callable[[], object],
              write: Callable[[Path, object], None]):
    """(what `read` returns, whether it came from the cache): read under the node lock when
    the cache is there and whole, else made, written and read back (the writer maps the same
    file its peers map). `read` returns None for a missing or damaged cache."""
    with node_lock(cache):
        found = read(cache)
        if found is not None:
            return found, True
        write(cache, make())
        made = read(cache)
    if made is None:
        raise InputError(f"the token cache {cache} was written but cannot be read back")
    return made, False


# -- folders of arrays -----------------------------------------------------------------------------

def write_arrays(folder: Path, arrays: dict[str, np.ndarray]) -> None:
    """One .npy per array in a temporary folder beside `folder`, then renamed to it: readers see
    all of it or none of it."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        temp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
        for name, array in arrays.items():
            with open(temp / f"{name}.npy", "wb") as handle:
                np.save(handle, np.ascontiguousarray(array), allow_pickle=False)
                handle.flush()
                os.fsync(handle.fileno())
        if folder.exists():  # a damaged cache of the same name (we hold the lock): replaced
            shutil.rmtree(folder)
        os.rename(temp, folder)
    except OSError as exc:
        raise InputError(f"the token cache {folder.parent} cannot be written: {exc.strerror}: "
                         "choose another --cache-dir or output_dir") from None


def read_arrays(folder: Path, names: Iterable[str]) -> dict[str, np.ndarray] | None:
    """The named arrays of `folder`, memory-mapped read-only; None when one is missing or damaged."""
    if not folder.is_dir():
        return None
    try:
        return {name: np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False)
                for name in names}
    except (OSError, ValueError):
        return None


class Ragged:
    """Sequences of different lengths as one flat array and the offsets where each starts
    (len + 1 of them): sequence i is values[offsets[i]:offsets[i + 1]]."""

    def __init__(self, values: np.ndarray, offsets: np.ndarray) -> None:
        self.values, self.offsets = values, offsets

    @classmethod
    def join(cls, parts: list[Ragged]) -> Ragged:
        """The sequences of every part, in order."""
        values = [p.values for p in parts]
        lengths = [np.diff(p.offsets) for p in parts]
        offsets = np.zeros(sum(map(len, lengths)) + 1, dtype=np.int64)
        if len(offsets) > 1:
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
        flat = np.concatenate(values) if values else np.zeros(0, dtype=np.int32)
        return cls(flat.astype(np.int32, copy=False), offsets)

    @classmethod
    def of(cls, sequences: list) -> Ragged:
        """From Python lists (or arrays) of token ids."""
        offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum([len(s) for s in sequences], out=offsets[1:])
        flat = (np.concatenate([np.asarray(s, dtype=np.int32) for s in sequences]) if sequences
                else np.zeros(0, dtype=np.int32))
        return cls(flat, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        """What `write_arrays` stores: NAME and NAME.offsets."""
        return {name: self.values, f"{name}.offsets": self.offsets}

    @classmethod
    def read(cls, arrays: dict[str, np.ndarray], name: str) -> Ragged:
        return cls(arrays[name], arrays[f"{name}.offsets"])


# -- tokenizing in several processes ---------------------------------------------------------------

def chunks(items: Iterable, size: int) -> Iterator[list]:
    """`items` in lists of `size` (the last one shorter)."""
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def ordered_map(fn: Callable, context, parts: Iterable, workers: int) -> Iterator:
    """fn(context, part) for each part, in order: in this process when workers is 1, else in a
    pool of `workers` forked processes (context reaches them through the fork, not a pickle),
    with at most 2 * workers parts in flight so that memory stays bounded. A single part is
    worked here too: a pool would only add its start."""
    parts = iter(parts)
    head = list(itertools.islice(parts, 2))
    if workers <= 1 or len(head) < 2:
        for part in itertools.chain(head, parts):
            yield fn(context, part)
        return
    parts = itertools.chain(head, parts)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=_set_context, initargs=(context,))
    pending: deque = deque()
    try:
        for part in parts:
            pending.append(pool.submit(_call, fn, part))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)


_CONTEXT = None  # in a worker: what ordered_map's caller gave (the tokenizer and options)


def _set_context(context) -> None:
    global _CONTEXT
    _CONTEXT = context


def _call(fn: Callable, part):
    return fn(_CONTEXT, part)
