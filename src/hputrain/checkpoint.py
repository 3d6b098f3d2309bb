"""Checkpoints: save a run to `output_dir/checkpoint-STEP/` and resume it exactly.

The folder (model.safetensors, optimizer.pt, scheduler.pt, trainer_state.json, rng_state_RANK.pt,
and model_extra_state.pt where layers have extra state, such as fp8 scaling) is assembled in a
hidden `.tmp-checkpoint-STEP` and renamed into place when complete, so a kill mid-save leaves the
previous checkpoint whole. Loading uses safetensors and
`torch.load(weights_only=True)` only: a checkpoint cannot run code.

With several processes every rank calls `save_checkpoint(..., barrier=dist.barrier)`, which runs:
rank 0 begin_checkpoint | barrier | every rank write_rng_state, rank 0 write_rank0_files |
barrier | rank 0 finalize and rotate_checkpoints | barrier.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .errors import InputError

MODEL_FILE = "model.safetensors"
EXTRA_STATE_FILE = "model_extra_state.pt"  # layers' get_extra_state(), e.g. fp8 amax histories
_EXTRA = "_extra_state"  # the suffix torch gives those entries in state_dict()
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
_FOLDER_NAME = re.compile(r"checkpoint-(\d+)")


class CheckpointError(InputError):
    """A checkpoint folder or file that is missing or cannot be read."""


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def temp_dir(output_dir: str | os.PathLike, step: int) -> Path:
    """Where checkpoint STEP is assembled; the leading dot keeps it out of every listing."""
    return Path(output_dir) / f".tmp-checkpoint-{step}"


def rng_file(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"rng_state_{rank}.pt"


# -- saving ------------------------------------------------------------------------------------
def _fsync(path: Path) -> None:
    """Flush a file or folder to disk, so a rename never publishes data still in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


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


def _model_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """The model's tensors on the CPU, each once (a tied weight, an embedding shared with the
    output layer, under its first name; `_load_model` fills in the others), and apart from them
    the layers' extra state (not tensors: EXTRA_STATE_FILE holds it)."""
    seen, tensors, extra = set(), {}, {}
    for name, value in model.state_dict(keep_vars=True).items():
        if name.endswith(_EXTRA):
            extra[name] = _on_cpu(value)
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


def write_rank0_files(folder: str | os.PathLike, step: int, *, model, optimizer, scheduler,
                      state: dict) -> None:
    """Write the model, optimizer, scheduler and trainer state (with "step" added) into `folder`.
    An optimizer or scheduler of None is skipped."""
    folder, text = Path(folder), json.dumps({**state, "step": step}, indent=2)  # fail early
    tensors, extra = _model_state(unwrap_model(model))
    save_file(tensors, str(folder / MODEL_FILE), metadata={"format": "pt"})
    _fsync(folder / MODEL_FILE)
    if extra:
        _torch_save(extra, folder / EXTRA_STATE_FILE)
    if optimizer is not None:
        _torch_save(_on_cpu(optimizer.state_dict()), folder / OPTIMIZER_FILE)
    if scheduler is not None:
        _torch_save(scheduler.state_dict(), folder / SCHEDULER_FILE)
    (folder / STATE_FILE).write_text(text, encoding="utf-8")
    _fsync(folder / STATE_FILE)


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
                    barrier: Callable[[], None] | None = None) -> Path:
    """Save checkpoint STEP atomically and return its folder; then keep only the newest
    `save_total_limit` checkpoints. With world_size > 1 every rank calls this with `barrier`."""
    if save_total_limit is not None and save_total_limit < 1:
        raise InputError(f"save_total_limit must be at least 1, got {save_total_limit}.")
    if world_size > 1 and barrier is None:
        raise ValueError("save_checkpoint with world_size > 1 needs barrier= (all ranks call it).")
    wait = barrier if world_size > 1 else (lambda: None)
    tmp, final = temp_dir(output_dir, step), checkpoint_dir(output_dir, step)
    if rank == 0:
        begin_checkpoint(output_dir, step)
    wait()
    try:
        write_rng_state(tmp, rank, accelerator)
        if rank == 0:
            write_rank0_files(tmp, step, model=model, optimizer=optimizer, scheduler=scheduler,
                              state=state)
        wait()
        if rank == 0:
            finalize(tmp, final)
    except BaseException:
        if world_size == 1:  # with several ranks, the next begin_checkpoint clears it
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        rotate_checkpoints(output_dir, save_total_limit, keep=final)
    wait()
    return final


# -- loading -----------------------------------------------------------------------------------
def _reason(exc: BaseException) -> str:
    """One line saying why a file did not load (torch's weights_only message is a page long)."""
    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) and "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n")[0]
        text = f"torch.load(weights_only=True) refused it ({detail.split('. Please')[0]})"
    text = " ".join(text.split()).rstrip(".") or type(exc).__name__
    return text if len(text) <= 300 else text[:294] + " (...)"


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
    for name in (STATE_FILE, MODEL_FILE):
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder} is not a complete checkpoint folder: {name} is missing.")


def _read_state(file: Path) -> dict:
    with _reading(file):
        state = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(state, dict):
            raise ValueError("it does not hold a JSON object")
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
    if any(name.endswith(_EXTRA) for name in state):
        with _reading(folder / EXTRA_STATE_FILE):
            model.load_state_dict(_load_pt(folder / EXTRA_STATE_FILE), strict=False)


def load_checkpoint(path: str | os.PathLike, *, model, optimizer=None, scheduler=None,
                    accelerator=None, rank: int = 0, restore_rng: bool = True) -> dict:
    """Load a checkpoint folder into `model` (strict) and the optional optimizer and scheduler,
    restore rank `rank`'s generators, and return the trainer state. Raises CheckpointError."""
    folder = Path(path)
    _check_folder(folder)
    state = _read_state(folder / STATE_FILE)
    _load_model(unwrap_model(model), folder)
    # optimizer.load_state_dict moves its state to each parameter's device
    for target, name in ((optimizer, OPTIMIZER_FILE), (scheduler, SCHEDULER_FILE)):
        if target is not None:
            with _reading(folder / name):
                target.load_state_dict(_load_pt(folder / name))
    if restore_rng:
        _restore_rng(rng_file(folder, rank), accelerator)
    return state


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint-N folder with the largest N, or None."""
    complete = [path for path in _checkpoint_folders(Path(output_dir))
                if (path / STATE_FILE).is_file() and (path / MODEL_FILE).is_file()]
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
