"""The checkpoint folder protocol: what `output_dir/checkpoint-STEP/` holds, and how it comes to
hold it whole or not at all.

A checkpoint folder holds the model and optimizer state (as a state IO writes it: full.py or
sharded.py), config.json as the model's library writes it, scheduler.pt, trainer_state.json
(written last), rng_state_RANK.pt, and model_extra_state.pt where layers have extra state, such
as fp8 scaling. It is assembled in a hidden `.tmp-checkpoint-STEP` (`begin_checkpoint`) and
renamed into place when complete (`finalize`), so a kill mid-save leaves the previous checkpoint
whole; every file is written through `checks.named_write`, so a failed write (a full disk) names its file
and `save_checkpoint` makes it one CheckpointError. `rotate_checkpoints` renames a folder away
before deleting it, so a kill never leaves half a checkpoint-N, and `clear_leftovers` removes
what such kills leave. `lock_output_dir` keeps a second run out of an output_dir in use.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import InputError
from .checks import load_failure_reason, named_write

MODEL_FILE = "model.safetensors"
# a model with frozen parameters (a LoRA's base): its trainable parameters only
TRAINABLE_FILE = "trainable.safetensors"
TRAINABLE_RECORD = "trainable_parameters.json"  # {"parameters": [the names saved]}
ADAPTER_FILE = "adapter_model.safetensors"  # a PEFT model's adapter, as PEFT saves it (export.py)
EXTRA_STATE_FILE = "model_extra_state.pt"  # layers' get_extra_state(), e.g. fp8 amax histories
SHARDED_DIR = "sharded"  # DCP's .metadata and one __RANK_0.distcp per rank (sharded.py)
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"  # the model's configuration, written the way its library writes it
LOCK_FILE = ".hputrain.lock"  # in output_dir: one run at a time (see lock_output_dir)
SET_ASIDE_DIR = ".overwritten"  # in output_dir: earlier runs' files, a run-N each (start.py)
_DROPPING = ".deleting-overwritten"  # SET_ASIDE_DIR renamed away before it is deleted
FINAL_DIR = "final"  # in output_dir: the trained model as save_pretrained writes it, at a run's end
RECIPE_FILE = "recipe.json"  # in output_dir: what `hputrain train` ran, written at its end
_METHOD_FILES: list[str] = []  # in output_dir: what methods write beside the metrics (register_run_file)
_FOLDER_NAME = re.compile(r"checkpoint-(\d+)")
# What a killed save, re-save or rotation leaves: .tmp-, .old- and .deleting-checkpoint-N.
_LEFTOVER = re.compile(rf"\.(tmp|old|deleting)-(checkpoint-\d+|{FINAL_DIR})")  # and export's


class CheckpointError(InputError):
    """A checkpoint folder or file that is missing or cannot be read."""


def register_run_file(name: str) -> None:
    """A file or folder a training method writes into output_dir (GRPO's completions.jsonl),
    set aside with the run's own when a run starts again from the beginning (hputrain/registry.py
    registers each once)."""
    if name not in _METHOD_FILES:
        _METHOD_FILES.append(name)


def method_files() -> tuple[str, ...]:
    return tuple(_METHOD_FILES)


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def temp_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Where checkpoint STEP is assembled; the leading dot keeps it out of every listing."""
    return Path(output_dir) / f".tmp-checkpoint-{step}"


def rng_file(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"rng_state_{rank}.pt"


def os_reason(exc: OSError) -> str:
    """"No space left on device (/out/x)": the system's words and the path they concern."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"{reason} ({exc.filename})" if exc.filename else reason


# -- one run per output_dir ----------------------------------------------------------------------
class OutputDirLock:
    """The lock `lock_output_dir` took: held until `release()` (or the end of a `with` block), and
    dropped by the kernel when the process ends however it ends, kill -9 included."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the flock
            self._fd = None

    def __enter__(self) -> "OutputDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_output_dir(output_dir: str | os.PathLike) -> OutputDirLock:
    """Make `output_dir` and take its run lock (an advisory flock on LOCK_FILE, which holds the
    holder's pid), then clear what a killed run left in it (`clear_leftovers`). Global rank 0
    calls this at the start of a run and releases it at the end. Raises InputError when another
    process holds the lock (naming its pid) or the folder cannot be written."""
    folder = Path(output_dir)
    path = folder / LOCK_FILE
    if folder.exists() and not folder.is_dir():
        raise InputError(f"output_dir {folder} is not a folder.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise InputError(f"output_dir {folder} cannot be written: {os_reason(exc)}.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise InputError(f"output_dir {folder} is in use by another run (pid {holder}): wait for "
                         "it to end, or choose another output_dir.") from None
    except OSError as exc:
        os.close(fd)
        raise InputError(f"output_dir {folder} cannot be locked: {os_reason(exc)}.") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        clear_leftovers(folder)
    except OSError as exc:
        os.close(fd)
        raise InputError(f"output_dir {folder} cannot be written: {os_reason(exc)}.") from None
    return OutputDirLock(path, fd)


def clear_leftovers(output_dir: str | os.PathLike) -> list[Path]:
    """Delete what a killed save, export or rotation left in `output_dir` (.tmp-checkpoint-N,
    .tmp-final: half written; .deleting-checkpoint-N: half deleted; .old-checkpoint-N, .old-final:
    replaced), and return it. An .old- folder without its checkpoint-N or final/ (a kill between
    `finalize`'s two renames) is the only copy: it is put back instead. Only the lock holder
    calls this."""
    folder, removed = Path(output_dir), []
    if not folder.is_dir():
        return removed
    if (folder / _DROPPING).is_dir():  # a kill while `drop_set_aside` deleted it
        shutil.rmtree(folder / _DROPPING, ignore_errors=True)
        removed.append(folder / _DROPPING)
    for child in sorted(folder.iterdir()):
        match = _LEFTOVER.fullmatch(child.name)
        if match is None or not child.is_dir():
            continue
        final = folder / match.group(2)
        whole = (child / STATE_FILE).is_file() or match.group(2) == FINAL_DIR  # finalize renames whole
        if match.group(1) == "old" and not final.exists() and whole:
            os.replace(child, final)
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


# -- writing and reading files -------------------------------------------------------------------
def fsync(path: Path) -> None:
    """Flush a file or folder to disk, so a rename never publishes data still in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(obj, path: Path) -> None:
    with named_write(path), open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_text(path: Path, text: str) -> None:
    with named_write(path):
        path.write_text(text, encoding="utf-8")
        fsync(path)


@contextmanager
def reading(file: Path) -> Iterator[None]:
    """Turn any failure while loading `file` into a CheckpointError that names it."""
    if not file.is_file():
        raise CheckpointError(f"Checkpoint file {file} is missing.")
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"Checkpoint file {file} cannot be loaded: "
                              f"{load_failure_reason(exc)}.") from exc


def load_pt(file: Path):
    """A .pt file of plain data and tensors, on the CPU: torch.load(weights_only=True), which
    refuses a file that would run code."""
    return torch.load(file, map_location="cpu", weights_only=True)


# -- the folder's life: begun, finalized, rotated ------------------------------------------------
def begin_checkpoint(output_dir: str | os.PathLike, step: int) -> Path:
    """Create an empty temp folder for STEP (clearing one a killed save left). Rank 0 only."""
    tmp = temp_dir(output_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finalize(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Rename the finished temp folder to `final`. An existing `final` (a re-save of the same
    step) is moved aside first and deleted only once the new folder is in place."""
    tmp, final = Path(tmp), Path(final)
    fsync(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def drop_set_aside(output_dir: str | os.PathLike) -> None:
    """Delete what a run from the beginning set aside (start.py): it has now a complete
    checkpoint or final/ on disk to take its place. Renamed away first, so that a kill midway
    leaves no half-deleted run in SET_ASIDE_DIR (`clear_leftovers` ends the job). Rank 0 only."""
    aside, gone = Path(output_dir) / SET_ASIDE_DIR, Path(output_dir) / _DROPPING
    if not aside.exists():
        return
    shutil.rmtree(gone, ignore_errors=True)  # one a kill left: a folder is not renamed over
    try:
        os.replace(aside, gone)
    except OSError:  # it cannot be renamed: deleted where it is, as it can be
        gone = aside
    shutil.rmtree(gone, ignore_errors=True)


def checkpoint_folders(output_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint-N folders in `output_dir`, oldest step first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), child) for child in output_dir.iterdir()
             if (m := _FOLDER_NAME.fullmatch(child.name)) and child.is_dir()]
    return [path for _, path in sorted(found)]


def rotate_checkpoints(output_dir: str | os.PathLike, limit: int | None, keep: Path) -> list[Path]:
    """Delete the oldest checkpoint-N folders so that `limit` remain, never `keep`; return them.
    Each is renamed away before it is deleted, so a kill never leaves a half checkpoint-N."""
    if limit is None:
        return []
    others = [path for path in checkpoint_folders(output_dir) if path != Path(keep)]
    doomed = others[:max(0, len(others) - (limit - 1))]
    for path in doomed:
        gone = path.with_name(f".deleting-{path.name}")
        os.replace(path, gone)
        shutil.rmtree(gone, ignore_errors=True)
    return doomed
