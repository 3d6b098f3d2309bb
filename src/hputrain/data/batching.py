"""The built-in byte-level corpus and its fixed-length training windows; batching.

By default the corpus is the Python standard library's own source code, found on this machine at
run time, so a training run needs no download. Bytes are tokens (vocab 256). The text is cut into
windows of seq_len + 1 tokens; a window gives `input_ids` and `labels` shifted by one.

Batching: the collators (default_collate, PadToBuckets for length buckets, DropUnusedColumns in
front of either), the copy to the device (to_device) and the order of samples per step and rank
(MicroBatches; worker processes in workers.py).
"""

from __future__ import annotations

import os
import stat
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..config.sections import DataSettings
from ..errors import InputError
from ..files import read_regular_file
from . import workers

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
"""Directory names never read (installed third-party code and bytecode caches)."""

FILE_SEPARATOR = b"\n"
"""Bytes put between two files of the corpus."""

WINDOWS_PER_BLOCK = 32
"""Windows in one train/validation split block (see `split_windows`)."""


class DataError(InputError):
    """The corpus could not be read or is unusable; the message names the path and the problem."""


def stdlib_source_dir() -> Path:
    """Return the directory holding the running Python's standard library source."""
    return Path(sysconfig.get_paths()["stdlib"])


def read_corpus(path: str | os.PathLike | None = None, max_bytes: int | None = None) -> bytes:
    """Return the bytes of a text corpus, files joined by a newline, cut to at most max_bytes.

    With path None, read the standard library's `*.py` files. A folder is walked in sorted order,
    skipping hidden entries, __pycache__, site-packages and dist-packages; of its regular files
    (never a FIFO, socket or device), those that are UTF-8 text without NUL bytes are read. A
    single text file is read as it is.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise DataError(f"max_bytes must be positive, got {max_bytes}.")
    root = stdlib_source_dir() if path is None else Path(path)
    if not root.exists():
        raise DataError(f"Corpus path {root} does not exist.")
    if not (root.is_file() or root.is_dir()):  # a FIFO, a device, a socket
        raise DataError(f"Corpus path {root} is neither a regular file nor a folder.")
    suffix = ".py" if path is None else None
    files = [root] if root.is_file() else walk_sorted(root, suffix)

    chunks: list[bytes] = []
    size = 0
    for file in files:
        data = _read_text_file(file)
        if data is None:
            continue
        if chunks:
            chunks.append(FILE_SEPARATOR)
            size += len(FILE_SEPARATOR)
        chunks.append(data)
        size += len(data)
        if max_bytes is not None and size >= max_bytes:
            break
    if not chunks:
        kind = "is not a UTF-8 text file" if root.is_file() else "has no readable text files"
        raise DataError(f"Corpus path {root} {kind}.")
    corpus = b"".join(chunks)
    return corpus if max_bytes is None else corpus[:max_bytes]


def walk_sorted(root: Path, suffix: str | None) -> list[Path]:
    """List the files under root in sorted, depth-first order, pruning skipped directories."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning and sorting dirnames in place steers os.walk, which makes the order stable.
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith(".") or (suffix is not None and not name.endswith(suffix)):
                continue
            if _is_regular_file(Path(dirpath, name)):
                found.append(Path(dirpath, name))
    return found


def _is_regular_file(file: Path) -> bool:
    """A regular file, or a link to one (not a FIFO, socket or device)."""
    try:
        return stat.S_ISREG(os.stat(file).st_mode)
    except OSError:
        return False


def _read_text_file(file: Path) -> bytes | None:
    """Return the file's bytes if it is a regular file of UTF-8 text without NUL bytes, else
    None. Opened without blocking and checked before reading: a FIFO (or a device) among the
    files would wait for a writer, or never end."""
    try:
        data = read_regular_file(file)
        data.decode("utf-8")
    except (OSError, ValueError):  # NotARegularFile and UnicodeDecodeError are ValueErrors
        return None
    if b"\0" in data or not data:
        return None
    return data


class TokenWindows(Dataset):
    """Fixed-length training windows over a 1-D uint8 token tensor.

    Window i covers tokens[i * seq_len : i * seq_len + seq_len + 1] and yields
    {"input_ids": the first seq_len tokens, "labels": the last seq_len} as int64 tensors.
    `window_ids`, when given, selects which windows (by number) this dataset exposes, so a train and
    a validation set can share one token tensor.
    """

    def __init__(
        self, tokens: torch.Tensor, seq_len: int, window_ids: torch.Tensor | None = None
    ) -> None:
        if tokens.dim() != 1:
            raise DataError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}.")
        if seq_len <= 0:
            raise DataError(f"seq_len must be positive, got {seq_len}.")
        self.tokens = tokens
        self.seq_len = seq_len
        if window_ids is None:
            window_ids = torch.arange(count_windows(len(tokens), seq_len))
        self.window_ids = window_ids

    def __len__(self) -> int:
        return len(self.window_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows.")
        start = int(self.window_ids[index]) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        return {"input_ids": window[:-1], "labels": window[1:]}


def count_windows(num_tokens: int, seq_len: int) -> int:
    """Number of full seq_len + 1 windows, at stride seq_len, in num_tokens tokens."""
    return max(0, (num_tokens - 1) // seq_len)


def split_windows(num_windows: int, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Split window numbers 0..num_windows-1 into (train, validation) without randomness.

    Consecutive windows form blocks of WINDOWS_PER_BLOCK (fewer for a small corpus) and every k-th
    block, k = round(1 / val_fraction), goes to validation. Validation thus samples the whole
    stream, which matters because a corpus sorted by path changes character along its length.
    """
    every = max(2, round(1 / val_fraction))
    block = max(1, min(WINDOWS_PER_BLOCK, num_windows // every))
    block_of_window = torch.arange(num_windows) // block
    is_val = block_of_window % every == every - 1
    if not is_val.any():  # too few blocks for even one k-th block: use the last one
        is_val = block_of_window == block_of_window[-1]
    ids = torch.arange(num_windows)
    return ids[~is_val], ids[is_val]


def load_corpus(
    path: str | os.PathLike | None = None,
    seq_len: int = 256,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
) -> tuple[TokenWindows, TokenWindows]:
    """Read a corpus (see `read_corpus`) and return (train, validation) windows of seq_len tokens.

    The split is deterministic (see `split_windows`); both parts are non-empty and share no window.
    """
    if not 0.0 < val_fraction <= 0.5:
        raise DataError(f"val_fraction must be in (0, 0.5], got {val_fraction}.")
    if seq_len <= 0:
        raise DataError(f"seq_len must be positive, got {seq_len}.")
    corpus = read_corpus(path, max_bytes=max_bytes)
    num_windows = count_windows(len(corpus), seq_len)
    if num_windows < 2:
        where = stdlib_source_dir() if path is None else path
        raise DataError(
            f"Corpus at {where} has {len(corpus)} bytes, too small for two windows of "
            f"seq_len={seq_len} (needs at least {2 * seq_len + 1} bytes)."
        )
    # bytearray makes a writable copy, which torch.frombuffer needs to avoid sharing read-only memory.
    tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    train_ids, val_ids = split_windows(num_windows, val_fraction)
    return TokenWindows(tokens, seq_len, train_ids), TokenWindows(tokens, seq_len, val_ids)


# -- batching ----------------------------------------------------------------------------------------

PAD_VALUES = {"labels": -100, "attention_mask": 0}  # anything else pads with 0


def _to_tensor(values: list, key: str | None, pad: Mapping = PAD_VALUES, width=None):
    """Stack a list of per-sample values into one tensor, padding 1-D sequences on the right:
    to the longest, or to width(longest) when a width function is given (PadToBuckets)."""
    if not isinstance(values[0], torch.Tensor):
        if isinstance(values[0], str) or not isinstance(values[0], (int, float, bool, list, tuple)):
            return values  # text and other objects stay a list (not model inputs)
        values = [torch.as_tensor(v) for v in values]
    if width is None and all(v.shape == values[0].shape for v in values):
        return torch.stack(values)
    if all(v.dim() == 1 for v in values):
        length = max(v.shape[0] for v in values)
        out = values[0].new_full((len(values), length if width is None else width(length)), pad.get(key, 0))
        for row, v in zip(out, values):
            row[:v.shape[0]] = v
        return out
    raise InputError(f"cannot batch {key or 'samples'} of shapes {sorted({tuple(v.shape) for v in values})}: "
                     "pass a data_collator")


def default_collate(samples: list):
    """Dicts become dicts of batched tensors, tuples tuples of them, tensors a stacked tensor."""
    first = samples[0]
    if isinstance(first, dict):
        return {key: _to_tensor([s[key] for s in samples], key) for key in first}
    if isinstance(first, (list, tuple)):
        return tuple(_to_tensor(list(column), None) for column in zip(*samples))
    return _to_tensor(samples, None)


def bucket_lengths(count: int, max_length: int, multiple: int | None = None) -> list[int]:
    """`count` lengths spaced evenly up to max_length (4 of 128: 32, 64, 96, 128), each rounded up
    to `multiple` but never past max_length, which is always the last."""
    lengths = {-(-max_length * i // count) for i in range(1, count + 1)}
    if multiple:
        lengths = {min(-(-length // multiple) * multiple, max_length) for length in lengths}
    return sorted(lengths)


class PadToBuckets:
    """A collator that pads token sequences to one of a few lengths, so that lazy mode and graphs
    see a bounded set of batch shapes instead of a new one almost every batch.

    Samples are dicts with input_ids. Their per-token values (input_ids, attention_mask, labels
    and any other 1-D value as long as the sample's input_ids) are padded on the right to the
    smallest bucket that holds the longest row: input_ids with pad_token_id, attention_mask with 0,
    labels with -100 (which the loss ignores), anything else with 0. Right padding with labels
    -100 leaves a causal model's loss unchanged, so no attention_mask is added where the samples
    have none: a mask with padding costs transformers a host read every step. Other values (a
    class label, text) are batched as default_collate does.

    Buckets: `buckets` lengths spaced evenly up to max_length (see `bucket_lengths`); with
    pad_to_multiple_of alone, the longest row rounded up to that multiple (not past max_length).
    A row longer than max_length is an InputError: the model could not take it.
    """

    def __init__(self, pad_token_id: int = 0, pad_to_multiple_of: int | None = None,
                 buckets: int | None = None, max_length: int | None = None) -> None:
        for name, value in (("pad_to_multiple_of", pad_to_multiple_of), ("buckets", buckets),
                            ("max_length", max_length)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InputError(f"{name} must be a whole number of at least 1, got {value!r}")
        if buckets is not None and max_length is None:
            raise InputError("length buckets need a maximum length: give max_length, or pad to a "
                             "multiple with pad_to_multiple_of instead")
        self.pad_token_id, self.multiple, self.max_length = pad_token_id, pad_to_multiple_of, max_length
        self.lengths = None if buckets is None else bucket_lengths(buckets, max_length, pad_to_multiple_of)

    def width(self, longest: int) -> int:
        """The padded length of a batch whose longest row has `longest` tokens."""
        if self.max_length is not None and longest > self.max_length:
            raise InputError(f"a row of {longest} tokens is longer than the model's maximum length "
                             f"{self.max_length}: cut the rows to at most {self.max_length} tokens")
        if self.lengths is not None:
            return next(length for length in self.lengths if length >= longest)
        width = longest if self.multiple is None else -(-longest // self.multiple) * self.multiple
        return width if self.max_length is None else min(width, self.max_length)

    def __call__(self, samples: list) -> dict:
        first = samples[0]
        if not isinstance(first, Mapping) or "input_ids" not in first:
            raise InputError("length buckets and pad_to_multiple_of pad token sequences: give samples "
                             "as dicts with input_ids, or pass a data_collator")
        lengths = [len(s["input_ids"]) for s in samples]
        pad = {**PAD_VALUES, "input_ids": self.pad_token_id}
        batch = {}
        for key in first:
            values = [s[key] for s in samples]
            per_token = all(_is_row_of(v, n) for v, n in zip(values, lengths))
            batch[key] = _to_tensor(values, key, pad, self.width if per_token else None)
        return batch


def _is_row_of(value, length: int) -> bool:
    """Whether a sample's value is one number per token (a 1-D sequence as long as input_ids)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 1 and value.shape[0] == length
    return isinstance(value, (list, tuple)) and len(value) == length


MAX_LENGTH_NAMES = ("max_position_embeddings", "n_positions", "block_size")
"""Where a model's config gives the longest sequence it takes (Hugging Face's names, then the
built-in GPT's)."""


def default_collator_for(model: torch.nn.Module, settings: DataSettings):
    """The collator a Trainer uses when it is given none: default_collate, or PadToBuckets when
    settings.length_buckets or settings.pad_to_multiple_of is set, padding input_ids with the model's
    config.pad_token_id (0 when it has none) up to its maximum length."""
    if settings.length_buckets is None and settings.pad_to_multiple_of is None:
        return default_collate
    config = getattr(base_model(model), "config", None)
    pad_token_id = getattr(config, "pad_token_id", None)
    max_length = next((getattr(config, name) for name in MAX_LENGTH_NAMES
                       if isinstance(getattr(config, name, None), int)), None)
    if settings.length_buckets is not None and max_length is None:
        raise InputError(f"length_buckets needs the model's maximum length ({', '.join(MAX_LENGTH_NAMES)} "
                         f"in its config), which {type(model).__name__} does not give: "
                         "use pad_to_multiple_of instead")
    return PadToBuckets(0 if pad_token_id is None else pad_token_id, settings.pad_to_multiple_of,
                        settings.length_buckets, max_length)


def map_tensors(fn, batch):
    """`batch` with `fn` applied to each of its tensors, in dicts (a Hugging Face collator's
    BatchEncoding, a UserDict, becomes a dict), lists and tuples; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    return batch


def to_device(batch, device: torch.device, non_blocking: bool = False):
    """`batch` with its tensors on `device`. A non-blocking copy from host memory is asynchronous
    only from pinned memory (from pageable memory the copy waits), so an unpinned host tensor is
    pinned first where this host can pin (a CPU-only build cannot)."""
    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if non_blocking and _should_pin(tensor, device):
            tensor = tensor.pin_memory()
        return tensor.to(device, non_blocking=non_blocking)
    return map_tensors(copy, batch)


def pin(batch):
    """`batch` with its tensors in pinned host memory (MicroBatches without workers; with
    workers the loader pins them)."""
    return map_tensors(lambda tensor: tensor if tensor.is_pinned() else tensor.pin_memory(), batch)


def _should_pin(tensor: torch.Tensor, device) -> bool:
    """A host tensor about to be copied to another device, not pinned yet, on a host that pins."""
    return (tensor.is_cpu and tensor.device != torch.device(device) and host_can_pin()
            and not tensor.is_pinned())


def host_can_pin() -> bool:
    """Whether host memory can be pinned here: torch pins for its accelerator, and a build or
    machine without one has nothing to pin for."""
    return torch.accelerator.is_available()


LABEL_NAMES = frozenset({"labels", "label", "label_ids", "shift_labels"})
"""Batch keys that are labels: kept in batches (a compute_loss, the token count) even when the
model's forward names none of them."""


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model whose forward does the work, for every question asked of a model's signature or
    class (its input names, its loss function, whether it takes num_items_in_batch): under PEFT's
    adapters the base model, since PEFT's wrapper names only some inputs and passes the rest
    (position_ids, the loss keywords) on through **kwargs; any other model itself. Read without
    importing peft: a PEFT model means peft is imported already."""
    peft = sys.modules.get("peft")
    if peft is not None and isinstance(model, peft.PeftModel):
        return model.get_base_model()
    return model


def model_input_names(model: torch.nn.Module) -> frozenset[str] | None:
    """The batch keys the model's forward takes by name (None when it names nothing and takes
    **kwargs); under PEFT's adapters, the base model's (see `base_model`). Other keys, apart from
    LABEL_NAMES, such as a text column of a Hugging Face dataset, are left out of batches (the
    Hugging Face Trainer's remove_unused_columns), even for a forward that also takes **kwargs:
    transformers' models take loss and attention options there, not data."""
    import inspect

    params = inspect.signature(base_model(model).forward).parameters.values()
    named = frozenset(p.name for p in params
                      if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL))
    if not named and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return named


class DropUnusedColumns:
    """A collator that first leaves out of dict samples every key not in `keep`, then calls
    `collate`: the Hugging Face Trainer's remove_unused_columns (a text column above all). `keep`
    None leaves every key in. A class of its own, not a Trainer's bound method, so that it pickles
    (whenever `collate` does) to data workers started by spawn (macOS, Windows) without the
    Trainer, its model and its optimizer."""

    def __init__(self, collate, keep: frozenset[str] | None = None) -> None:
        self.collate, self.keep = collate, keep

    def __call__(self, samples: list):
        if self.keep is not None and isinstance(samples[0], Mapping):
            samples = [{k: v for k, v in sample.items() if k in self.keep} for sample in samples]
        return self.collate(samples)


@dataclass(frozen=True)
class LoaderOptions:
    """How training batches are loaded (TrainingArguments' dataloader_* fields)."""

    num_workers: int = 0
    """Worker processes that load and collate ahead of the step (see workers.py); 0: this one."""
    pin_memory: bool = False
    """Batches come out in pinned host memory (only where the device copies from it
    asynchronously: the Trainer asks its accelerator)."""
    prefetch_factor: int | None = None
    """Batches each worker prepares ahead; None: torch's default."""


class MicroBatches:
    """This rank's micro-batches, in an order fixed by (seed, epoch).

    The global batch of optimizer step k is the same set of samples whatever the number of
    processes: it is cut into `accumulate` micro-steps, and each micro-step into one slice per
    rank. One process with batch 2B and two with batch B therefore train on the same samples, and a
    resumed run continues from step k exactly. With worker processes (`loading`) the batches are
    the same, bitwise, and come in the same order: the workers are handed this order (workers.py).
    """

    def __init__(self, dataset, collate, batch_size: int, accumulate: int = 1, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 loading: LoaderOptions = LoaderOptions(), agree=None, notify=None):
        self.dataset, self.collate = dataset, collate
        self.loading = loading
        # A data set that reads its own shards (data/streaming.py) is this rank's already: it is
        # told its rank here and never sliced; `agree` (values -> their sums over the ranks: the
        # process group's host_sum) ends its passes together, and `notify` (line -> None) says
        # what they leave unread (ShardStream.pass_ends).
        self.own_shards = bool(getattr(dataset, "reads_own_shards", False))
        if self.own_shards:
            dataset.take_rank(rank, world_size, agree=agree or list, notify=notify)
        self._resumed: dict | None = None  # the position a resumed run's stream starts from
        self._positions: dict[int, dict] = {}  # micro-batches given out -> the position after them
        self.batch_size, self.accumulate = batch_size, accumulate
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.micro_size = batch_size * world_size
        self.global_batch_size = self.micro_size * accumulate
        self.num_samples = len(dataset) if hasattr(dataset, "__len__") else None
        self.steps_per_epoch = None
        if self.num_samples is not None:
            whole, rest = divmod(self.num_samples, self.global_batch_size)
            self.steps_per_epoch = whole + (1 if rest and not drop_last else 0)

    def epoch_of(self, step: int) -> float:
        if self.own_shards:  # the pass a rank-local stream is in after that step
            return float(self._positions.get(step * self.accumulate, {}).get("epoch", 0))
        return step / self.steps_per_epoch if self.steps_per_epoch else 0.0

    def iterate(self, start_step: int = 0, epochs: int | None = None):
        """Micro-batches from optimizer step `start_step` on, for `epochs` passes (None: forever)."""
        if self.own_shards:
            batches = self.local_stream(start_step, epochs)
            pinning = self.loading.pin_memory and not self.loading.num_workers  # else the loader pins
            yield from (map(pin, batches) if pinning else batches)
            return
        if self.loading.num_workers > 0:
            yield from workers.in_workers(self, start_step, epochs)
            return
        if self.num_samples is None:
            batches = self.stream(start_step, epochs)
        else:
            batches = (self.collate([self.dataset[i] for i in mine])
                       for mine in self.index_lists(start_step, epochs))
        yield from (map(pin, batches) if self.loading.pin_memory else batches)

    def index_lists(self, start_step: int = 0, epochs: int | None = None):
        """A map-style dataset: the sample indices of this rank's micro-batches, in order."""
        if self.steps_per_epoch == 0:
            return
        epoch, step = divmod(start_step, self.steps_per_epoch)
        while epochs is None or epoch < epochs:
            order = self._order(epoch)
            for s in range(step, self.steps_per_epoch):
                chunk = order[s * self.global_batch_size:(s + 1) * self.global_batch_size]
                for m in range(self.accumulate):
                    mine = self._my_slice(chunk[m * self.micro_size:(m + 1) * self.micro_size])
                    if len(mine):
                        yield mine.tolist()
            epoch, step = epoch + 1, 0

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def _my_slice(self, micro: torch.Tensor | list):
        return micro[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]

    def stream(self, start_step: int = 0, epochs: int | None = None):
        """An iterable dataset: this rank's collated micro-batches of consecutive samples, the
        stream restarted when exhausted."""
        to_skip, epoch = start_step * self.accumulate, 0
        while epochs is None or epoch < epochs:
            stream, produced = iter(self.dataset), False
            while True:
                micro = [sample for _, sample in zip(range(self.micro_size), stream)]
                if not micro or (self.drop_last and len(micro) < self.micro_size):
                    break
                produced = True
                if to_skip:
                    to_skip -= 1
                    continue
                mine = self._my_slice(micro)
                if mine:
                    yield self.collate(mine)
            if not produced:
                raise InputError("the iterable train_dataset yielded no complete batch")
            epoch += 1

    # -- a data set that reads its own shards (data/streaming.py) --------------------------------
    def data_state(self, step: int) -> dict | None:
        """This rank's stream position after optimizer step `step` (what a checkpoint saves), or
        None for a data set without one."""
        return self._positions.get(step * self.accumulate) if self.own_shards else None

    def load_state_dict(self, state: dict | None) -> None:
        """The position a resumed run continues from (None: re-read the stream and skip the steps
        already trained)."""
        self._resumed = state

    def check_data_state(self, state) -> None:
        """Raise ValueError (why) unless this rank's stream can continue from `state`."""
        if self.own_shards:
            self.dataset.check_position(state)

    def local_stream(self, start_step: int = 0, epochs: int | None = None):
        """Micro-batches of consecutive samples of a rank-local stream, none sliced, each one's
        position remembered (data_state). A pass ends on every rank as soon as one rank's shards
        run out (ShardStream.pass_ends), so all take the same steps; then all start the next."""
        count, to_skip = start_step * self.accumulate, 0
        if self._resumed is not None:
            self.dataset.load_state_dict(self._resumed)
        else:
            to_skip = count  # no saved position: read the steps already trained again, unused
        position, fresh = self.dataset.state_dict(), self._resumed is None
        self._remember(count, position)
        while epochs is None or position["epoch"] < epochs:
            # (micro-batch, position after it) to the end of the pass, in a worker if asked for
            batches = workers.local_pass(self) if self.loading.num_workers else self.pass_batches()
            produced = 0
            try:
                while True:
                    item = next(batches, None)
                    if self.dataset.pass_ends(item is not None, not produced and fresh, position,
                                              self.batch_size):
                        break
                    batch, position = item
                    produced, count = produced + 1, count + 1
                    self._remember(count, position)
                    if to_skip:
                        to_skip -= 1
                        continue
                    yield batch
            finally:
                batches.close()  # a loader's worker stops here
            self.dataset.load_state_dict(position)
            self.dataset.next_epoch()
            position, fresh = self.dataset.state_dict(), True
            self._remember(count, position)

    def pass_batches(self):  # here, or in a worker (workers.local_pass)
        samples = iter(self.dataset)
        while len(micro := [s for _, s in zip(range(self.batch_size), samples)]) == self.batch_size:
            yield self.collate(micro), self.dataset.state_dict()

    def _remember(self, count: int, position: dict) -> None:
        """Keep the positions of the last two steps' micro-batches: a save follows its step, or
        the next step's micro-batches when the ranks stop before training them."""
        self._positions[count] = position
        for old in [c for c in self._positions if c < count - 2 * self.accumulate]:
            del self._positions[old]
