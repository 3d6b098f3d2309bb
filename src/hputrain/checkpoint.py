"""Checkpoints: save a run to `output_dir/checkpoint-STEP/` and resume it exactly.

This module is the folder protocol; how the model and optimizer state is written is a state IO
chosen by the strategy (`state_io_for`): `FullState` here (model.safetensors and optimizer.pt,
written by rank 0), or `ShardedState` (checkpoint_sharded.py: every rank writes its shards with
torch.distributed.checkpoint into sharded/) under a strategy whose `shards_state` is True.
Loading reads the state the way the folder holds it.

A model with frozen parameters (a PEFT LoRA model's base) is saved as its trainable parameters
only (TRAINABLE_FILE, or their shards), named in TRAINABLE_RECORD, with their optimizer state.
Resuming loads them into the model built again from the same base, and refuses a checkpoint whose
trainable names are not the model's. A PEFT model's folder also gets adapter_model.safetensors
and adapter_config.json, so `PeftModel.from_pretrained(base, checkpoint)` loads it.

The folder (the model and optimizer state, config.json as the model's library writes it,
scheduler.pt, trainer_state.json, rng_state_RANK.pt, and model_extra_state.pt where layers have
extra state, such as fp8 scaling) is assembled in a hidden `.tmp-checkpoint-STEP` and renamed into
place when complete, so a kill mid-save leaves the previous checkpoint whole; a failed write (a
full disk) is a CheckpointError. Loading uses safetensors and `torch.load(weights_only=True)`
only, so a checkpoint cannot run code, and checks what it loaded against the model and optimizer
before using it. `lock_output_dir` keeps a second run out of an output_dir in use.

With several processes every rank calls `save_checkpoint(..., barrier=dist.barrier)`, which runs:
rank 0 begin_checkpoint | barrier | every rank write_rng_state and the state IO's write (rank 0
only for FullState), rank 0 write_common_files | barrier | rank 0 finalize and
rotate_checkpoints | barrier.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .checkpoint_checks import (
    check_optimizer_state,
    check_trainable_names,
    check_trainer_state,
    has_frozen_parameters,
    trainable_names,
)
from .checkpoint_checks import load_failure_reason as _reason
from .checkpoint_sharded import SHARDED_DIR, ShardedState
from .errors import InputError

MODEL_FILE = "model.safetensors"
# a model with frozen parameters (a LoRA's base): its trainable parameters only
TRAINABLE_FILE = "trainable.safetensors"
TRAINABLE_RECORD = "trainable_parameters.json"  # {"parameters": [the names saved]}
ADAPTER_FILE = "adapter_model.safetensors"  # a PEFT model's adapter, as PEFT saves it (export.py)
EXTRA_STATE_FILE = "model_extra_state.pt"  # layers' get_extra_state(), e.g. fp8 amax histories
_EXTRA = "_extra_state"  # the suffix torch gives those entries in state_dict()
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"  # the model's configuration, written the way its library writes it
LOCK_FILE = ".hputrain.lock"  # in output_dir: one run at a time (see lock_output_dir)
_FOLDER_NAME = re.compile(r"checkpoint-(\d+)")
# What a killed save, re-save or rotation leaves: .tmp-, .old- and .deleting-checkpoint-N.
_LEFTOVER = re.compile(r"\.(tmp|old|deleting)-(checkpoint-\d+)")


class CheckpointError(InputError):
    """A checkpoint folder or file that is missing or cannot be read."""


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def temp_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Where checkpoint STEP is assembled; the leading dot keeps it out of every listing."""
    return Path(output_dir) / f".tmp-checkpoint-{step}"


def rng_file(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"rng_state_{rank}.pt"


def _os_reason(exc: OSError) -> str:
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
        raise InputError(f"output_dir {folder} cannot be written: {_os_reason(exc)}.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise InputError(f"output_dir {folder} is in use by another run (pid {holder}): wait for "
                         "it to end, or choose another output_dir.") from None
    except OSError as exc:
        os.close(fd)
        raise InputError(f"output_dir {folder} cannot be locked: {_os_reason(exc)}.") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        clear_leftovers(folder)
    except OSError as exc:
        os.close(fd)
        raise InputError(f"output_dir {folder} cannot be written: {_os_reason(exc)}.") from None
    return OutputDirLock(path, fd)


def clear_leftovers(output_dir: str | os.PathLike) -> list[Path]:
    """Delete what a killed save or rotation left in `output_dir` (.tmp-checkpoint-N: half
    written; .deleting-checkpoint-N: half deleted; .old-checkpoint-N: replaced), and return it.
    An .old-checkpoint-N without its checkpoint-N (a kill between `finalize`'s two renames) is
    the only copy of that checkpoint: it is put back instead. Only the lock holder calls this."""
    folder, removed = Path(output_dir), []
    if not folder.is_dir():
        return removed
    for child in sorted(folder.iterdir()):
        match = _LEFTOVER.fullmatch(child.name)
        if match is None or not child.is_dir():
            continue
        final = folder / match.group(2)
        if match.group(1) == "old" and not final.exists() and (child / STATE_FILE).is_file():
            os.replace(child, final)
            continue
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


# -- saving ------------------------------------------------------------------------------------
def _fsync(path: Path) -> None:
    """Flush a file or folder to disk, so a rename never publishes data still in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def _writing(file: Path) -> Iterator[None]:
    """Name `file` in a failure to write it (a failed write() names no path; safetensors raises
    its own error type), as an OSError that `save_checkpoint` turns into one line."""
    try:
        yield
    except OSError as exc:
        if not exc.filename:
            exc.filename = str(file)
        raise
    except SafetensorError as exc:
        raise OSError(errno.EIO, " ".join(str(exc).split()), str(file)) from exc


def _torch_save(obj, path: Path) -> None:
    with _writing(path), open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_text(path: Path, text: str) -> None:
    with _writing(path):
        path.write_text(text, encoding="utf-8")
        _fsync(path)


def _on_cpu(obj):
    """`obj` with every tensor copied to the CPU: device tensors (lazy ones above all) cannot be
    serialised where they are."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {key: _on_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(value) for value in obj)
    return obj


def _model_state(model: torch.nn.Module,
                 trainable_only: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """The model's tensors on the CPU, each once (a tied weight, an embedding shared with the
    output layer, under its first name; `_load_model` fills in the others), and apart from them
    the layers' extra state (not tensors: EXTRA_STATE_FILE holds it). `trainable_only` keeps
    the parameters that require grad, named as `trainable_names` names them."""
    seen, tensors, extra = set(), {}, {}
    for name, value in model.state_dict(keep_vars=True).items():
        if name.endswith(_EXTRA):
            extra[name] = _on_cpu(value)
        elif trainable_only and not (isinstance(value, torch.nn.Parameter) and value.requires_grad):
            continue
        elif id(value) not in seen:
            seen.add(id(value))
            tensors[name] = value.detach().cpu().contiguous()
    return tensors, extra


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module that owns the weights, under DDP (`.module`) and torch.compile (`._orig_mod`)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def begin_checkpoint(output_dir: str | os.PathLike, step: int) -> Path:
    """Create an empty temp folder for STEP (clearing one a killed save left). Rank 0 only."""
    tmp = temp_dir(output_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_rng_state(folder: str | os.PathLike, rank: int, accelerator=None) -> None:
    """Write this process's Python, numpy, torch and device generator states to rng_state_RANK.pt.
    numpy's key array becomes a tensor so that the file loads with weights_only=True."""
    if not Path(folder).is_dir():  # rank 0 made it before the barrier
        raise CheckpointError(f"{folder} is missing on rank {rank}: every rank must see the same "
                              "output_dir (a shared filesystem across nodes)")
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    device_state = accelerator.rng_state() if accelerator is not None else None
    _torch_save({
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
        "torch": torch.get_rng_state(),
        "device": device_state.cpu() if device_state is not None else None,
    }, rng_file(folder, rank))


def _write_model_config(model: torch.nn.Module, folder: Path) -> None:
    """CONFIG_FILE as the model's library writes it: a transformers config through its own
    `to_json_file` (what `save_pretrained` writes), a dataclass config (the built-in GPT's) as
    the JSON of its fields. A model with neither gets no CONFIG_FILE."""
    config, path = getattr(model, "config", None), folder / CONFIG_FILE
    if hasattr(config, "to_json_file"):
        with _writing(path):
            config.to_json_file(path, use_diff=True)
            _fsync(path)
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        _write_text(path, json.dumps(dataclasses.asdict(config), indent=2, default=str))


def write_trainable_files(folder: Path, model, tensors: dict[str, torch.Tensor]) -> None:
    """Rank 0, for a model with frozen parameters: TRAINABLE_RECORD naming the trainable
    parameters saved, and for a PEFT model its adapter files from `tensors` (those parameters,
    whole and on the CPU)."""
    from . import export  # export.py imports this module

    _write_text(folder / TRAINABLE_RECORD, json.dumps({"parameters": list(tensors)}, indent=2))
    with _writing(folder / ADAPTER_FILE):
        export.write_adapter(model, folder, tensors)


class FullState:
    """The whole model and optimizer state, written by rank 0: MODEL_FILE (safetensors, each
    tensor once), or TRAINABLE_FILE and its record for a model with frozen parameters,
    EXTRA_STATE_FILE where layers have extra state, and OPTIMIZER_FILE."""

    shards = False

    @staticmethod
    def found_in(folder: Path) -> bool:
        return (folder / MODEL_FILE).is_file() or (folder / TRAINABLE_FILE).is_file()

    def write(self, folder: Path, *, model, optimizer, rank: int) -> None:
        if rank != 0:
            return
        frozen = has_frozen_parameters(model)
        tensors, extra = _model_state(model, trainable_only=frozen)
        file = folder / (TRAINABLE_FILE if frozen else MODEL_FILE)
        with _writing(file):
            save_file(tensors, str(file), metadata={"format": "pt"})
            _fsync(file)
        if frozen:
            write_trainable_files(folder, model, tensors)
        if extra:
            _torch_save(extra, folder / EXTRA_STATE_FILE)
        if optimizer is not None:
            _torch_save(_on_cpu(optimizer.state_dict()), folder / OPTIMIZER_FILE)

    def load(self, folder: Path, *, model, optimizer, rank: int) -> None:
        if (folder / TRAINABLE_FILE).exists():
            _load_trainable(model, folder)
        else:
            _load_model(model, folder)
        # optimizer.load_state_dict moves its state to each parameter's device
        if optimizer is not None:
            with _reading(folder / OPTIMIZER_FILE):
                saved = _load_pt(folder / OPTIMIZER_FILE)
                check_optimizer_state(saved, optimizer)
                optimizer.load_state_dict(saved)

    def consolidate(self, path: Path, *, model, rank: int) -> None:
        """MODEL_FILE is already the whole model."""


def state_io_for(strategy) -> FullState | ShardedState:
    """The state IO of a strategy: sharded where it shards the model's state (fsdp)."""
    return ShardedState() if getattr(strategy, "shards_state", False) else FullState()


def write_common_files(folder: str | os.PathLike, step: int, *, model, scheduler,
                       state: dict) -> None:
    """Rank 0: the model's configuration, the scheduler and the trainer state (with "step"
    added, written last). A scheduler of None is skipped."""
    folder, text = Path(folder), json.dumps({**state, "step": step}, indent=2)  # fail early
    _write_model_config(unwrap_model(model), folder)
    if scheduler is not None:
        _torch_save(scheduler.state_dict(), folder / SCHEDULER_FILE)
    _write_text(folder / STATE_FILE, text)


def finalize(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Rename the finished temp folder to `final`. An existing `final` (a re-save of the same
    step) is moved aside first and deleted only once the new folder is in place."""
    tmp, final = Path(tmp), Path(final)
    _fsync(tmp)
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
    _fsync(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _checkpoint_folders(output_dir: Path) -> list[Path]:
    """The checkpoint-N folders in `output_dir`, oldest step first."""
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
    others = [path for path in _checkpoint_folders(Path(output_dir)) if path != Path(keep)]
    doomed = others[:max(0, len(others) - (limit - 1))]
    for path in doomed:
        gone = path.with_name(f".deleting-{path.name}")
        os.replace(path, gone)
        shutil.rmtree(gone, ignore_errors=True)
    return doomed


def save_checkpoint(output_dir: str | os.PathLike, step: int, *, model, optimizer, scheduler,
                    state: dict, accelerator, rank: int = 0, world_size: int = 1,
                    save_total_limit: int | None = None,
                    barrier: Callable[[], None] | None = None,
                    state_io: FullState | ShardedState | None = None,
                    consolidate: bool = False) -> Path:
    """Save checkpoint STEP atomically and return its folder; then keep only the newest
    `save_total_limit` checkpoints. With world_size > 1 every rank calls this with `barrier`.
    `state_io` (default FullState) writes the model and optimizer state; `consolidate` also
    writes the whole model as MODEL_FILE where the state IO shards it (the end of training)."""
    state_io = state_io or FullState()
    if save_total_limit is not None and save_total_limit < 1:
        raise InputError(f"save_total_limit must be at least 1, got {save_total_limit}.")
    if world_size > 1 and barrier is None:
        raise ValueError("save_checkpoint with world_size > 1 needs barrier= (all ranks call it).")
    wait = barrier if world_size > 1 else (lambda: None)
    tmp, final = temp_dir(output_dir, step), checkpoint_dir(output_dir, step)
    try:
        if rank == 0:
            begin_checkpoint(output_dir, step)
        wait()
        try:
            write_rng_state(tmp, rank, accelerator)
            json.dumps(state)  # fail before writing anything
            state_io.write(tmp, model=unwrap_model(model), optimizer=optimizer, rank=rank)
            if consolidate:
                with _writing(tmp / MODEL_FILE):
                    state_io.consolidate(tmp / MODEL_FILE, model=unwrap_model(model), rank=rank)
            if rank == 0:
                write_common_files(tmp, step, model=model, scheduler=scheduler, state=state)
            wait()
            if rank == 0:
                finalize(tmp, final)
        except BaseException:
            if world_size == 1:  # with several ranks, the next begin_checkpoint clears it
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if rank == 0:
            rotate_checkpoints(output_dir, save_total_limit, keep=final)
    except OSError as exc:  # a full disk, a read-only or vanished folder: the earlier ones stay
        raise CheckpointError(f"Cannot save checkpoint {final}: {_os_reason(exc)}.") from exc
    wait()
    return final


# -- loading -----------------------------------------------------------------------------------
@contextmanager
def _reading(file: Path) -> Iterator[None]:
    """Turn any failure while loading `file` into a CheckpointError that names it."""
    if not file.is_file():
        raise CheckpointError(f"Checkpoint file {file} is missing.")
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"Checkpoint file {file} cannot be loaded: {_reason(exc)}.") from exc


def _load_pt(file: Path):
    return torch.load(file, map_location="cpu", weights_only=True)


def _check_folder(folder: Path) -> None:
    if not folder.exists():
        raise CheckpointError(f"Checkpoint folder {folder} does not exist.")
    if not folder.is_dir():
        raise CheckpointError(f"Checkpoint path {folder} is not a folder.")
    weights = TRAINABLE_FILE if (folder / TRAINABLE_FILE).exists() else MODEL_FILE
    names = (STATE_FILE,) if (folder / SHARDED_DIR).is_dir() else (STATE_FILE, weights)
    for name in names:
        path = folder / name
        if path.exists() and not path.is_file():  # a FIFO or a folder: never opened
            raise CheckpointError(f"{path} is not a regular file.")
        if not path.is_file():
            raise CheckpointError(f"{folder} is not a complete checkpoint folder: {name} is missing.")


def _read_state(file: Path) -> dict:
    with _reading(file):
        state = json.loads(file.read_text(encoding="utf-8"))
        check_trainer_state(state, file.parent)
        return state


def _restore_rng(file: Path, accelerator) -> None:
    """Put back the four generators saved by `write_rng_state`."""
    with _reading(file):
        saved = _load_pt(file)
        version, internal, gauss_next = saved["python"]
        random.setstate((version, tuple(internal), gauss_next))
        n = saved["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached_gaussian"]))
        torch.set_rng_state(saved["torch"])
        if accelerator is not None and saved["device"] is not None:
            accelerator.set_rng_state(saved["device"])


def _load_model(model: torch.nn.Module, folder: Path) -> None:
    """Load MODEL_FILE into `model`, every tensor of it and nothing else, then the layers' extra
    state from EXTRA_STATE_FILE when the model has any."""
    with _reading(folder / MODEL_FILE):
        tensors = load_file(str(folder / MODEL_FILE), device="cpu")
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        # a tied weight is stored once, under its first name: its other names are loaded too
        state = model.state_dict(keep_vars=True)
        loaded = {id(state[name]) for name in tensors if name in state}
        missing = sorted(name for name in missing
                         if not name.endswith(_EXTRA) and id(state[name]) not in loaded)
        if missing or unexpected:
            raise ValueError(f"it does not fit the model (missing: {', '.join(missing) or 'none'}; "
                             f"unexpected: {', '.join(sorted(unexpected)) or 'none'})")
    _load_extra_state(model, folder, state)


def _load_trainable(model: torch.nn.Module, folder: Path) -> None:
    """Load TRAINABLE_FILE once it and its record name exactly the model's trainable parameters."""
    mine = trainable_names(model)
    with _reading(folder / TRAINABLE_RECORD):
        record = json.loads((folder / TRAINABLE_RECORD).read_text(encoding="utf-8"))
        check_trainable_names(record.get("parameters") if isinstance(record, dict) else None, mine)
    with _reading(folder / TRAINABLE_FILE):
        tensors = load_file(str(folder / TRAINABLE_FILE), device="cpu")
        check_trainable_names(list(tensors), mine)
        model.load_state_dict(tensors, strict=False)  # a shape that differs raises, named
    _load_extra_state(model, folder, model.state_dict(keep_vars=True))


def _load_extra_state(model: torch.nn.Module, folder: Path, state: dict) -> None:
    """The layers' extra state from EXTRA_STATE_FILE, when the model (its `state`) has any."""
    names = {name for name in state if name.endswith(_EXTRA)}
    if names:
        with _reading(folder / EXTRA_STATE_FILE):
            extra = _load_pt(folder / EXTRA_STATE_FILE)
            if not isinstance(extra, dict) or set(extra) != names:
                found = sorted(map(str, extra)) if isinstance(extra, dict) else type(extra).__name__
                raise ValueError(f"it holds {found}, the model's layers {sorted(names)}")
            model.load_state_dict(extra, strict=False)  # each layer's set_extra_state checks its own


def _reader_for(folder: Path, state_io: FullState | ShardedState | None):
    """How the folder's state is read: its shards when it has them (DCP loads them on any number
    of processes, into sharded or plain models alike), else its full files. A strategy that
    shards (`state_io` sharded) cannot read full files into its shards."""
    if (folder / SHARDED_DIR).is_dir():  # ShardedState.load says what of it is missing
        return ShardedState()
    if state_io is not None and state_io.shards:
        raise CheckpointError(f"{folder} holds full state ({MODEL_FILE}, {OPTIMIZER_FILE}), not "
                              "the shards a sharded strategy resumes from: resume it with "
                              "strategy ddp or single.")
    return FullState()


def load_checkpoint(path: str | os.PathLike, *, model, optimizer=None, scheduler=None,
                    accelerator=None, rank: int = 0, restore_rng: bool = True,
                    state_io: FullState | ShardedState | None = None) -> dict:
    """Load a checkpoint folder into `model` (strict) and the optional optimizer and scheduler,
    restore rank `rank`'s generators, and return the trainer state. Raises CheckpointError.
    With several processes every rank calls it (a sharded folder loads collectively). A sharded
    checkpoint of fewer processes has no generator file for the ranks beyond its own: those
    keep their seeded generators."""
    folder = Path(path)
    _check_folder(folder)
    state = _read_state(folder / STATE_FILE)
    reader = _reader_for(folder, state_io)
    reader.load(folder, model=unwrap_model(model), optimizer=optimizer, rank=rank)
    if scheduler is not None:
        with _reading(folder / SCHEDULER_FILE):
            scheduler.load_state_dict(_load_pt(folder / SCHEDULER_FILE))
    resharded = reader.shards and rank >= state.get("world_size", 1)
    if restore_rng and not resharded:
        _restore_rng(rng_file(folder, rank), accelerator)
    return state


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint-N folder with the largest N, or None."""
    complete = [path for path in _checkpoint_folders(Path(output_dir)) if (path / STATE_FILE).is_file()
                and (FullState.found_in(path) or ShardedState.found_in(path))]
    return complete[-1] if complete else None


def resolve_checkpoint(output_dir: str | os.PathLike, spec: str) -> Path:
    """"latest" means the newest checkpoint in `output_dir`; anything else is a folder path,
    tried as given and then inside `output_dir` (so "checkpoint-500" works)."""
    if spec == "latest":
        found = latest_checkpoint(output_dir)
        if found is None:
            raise CheckpointError(f"There is no checkpoint in {output_dir} to resume from.")
        return found
    path = Path(spec).expanduser()
    if not path.exists() and not path.is_absolute() and (Path(output_dir) / path).exists():
        path = Path(output_dir) / path
    if not path.exists():
        raise CheckpointError(f"Checkpoint folder {path} does not exist.")
    return path
