"""Save a run to `output_dir/checkpoint-STEP/` and resume it exactly.

`save_checkpoint` and `load_checkpoint` drive the folder protocol (folder.py) around a state IO
(state.py) chosen by the strategy (`state_io_for`, the one place that knows both): FullState
(full.py: model.safetensors and optimizer.pt, written by rank 0), or ShardedState (sharded.py:
every rank writes its shards with torch.distributed.checkpoint into sharded/) under a strategy
whose `shards_state` is True. Loading reads the state the way the folder holds it.

With several processes every rank calls `save_checkpoint(..., barrier=dist.barrier)`, which runs:
rank 0 begin_checkpoint | barrier | every rank write_rng_state (and its data position, when a
stream reads its own shards) and the state IO's write (rank 0 only for FullState), rank 0
write_common_files | barrier | rank 0 finalize and
rotate_checkpoints | barrier.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..errors import EveryRankError, InputError
from .checks import check_trainer_state, named_write, write_failure
from .folder import (MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, SHARDED_DIR, STATE_FILE,
                     TRAINABLE_FILE, CheckpointError, begin_checkpoint, checkpoint_dir,
                     checkpoint_folders, drop_set_aside, finalize, load_pt, os_reason, reading,
                     rng_file, rotate_checkpoints, temp_dir, torch_save, write_text)
from .full import FullState, write_model_config
from .host import unwrap_model
from .sharded import SharedWriteError, ShardedState
from .state import StateIO


class EveryRankCheckpointError(CheckpointError, EveryRankError):
    """A save that failed on every rank alike (sharded.SharedWriteError): rank 0 says it."""


def state_io_for(strategy) -> StateIO:
    """The state IO of a strategy: sharded where it shards the model's state (fsdp)."""
    return ShardedState() if getattr(strategy, "shards_state", False) else FullState()


# -- saving ------------------------------------------------------------------------------------
def write_rng_state(folder: str | os.PathLike, rank: int, accelerator=None) -> None:
    """Write this process's Python, numpy, torch and device generator states to rng_state_RANK.pt.
    numpy's key array becomes a tensor so that the file loads with weights_only=True."""
    if not Path(folder).is_dir():  # rank 0 made it before the barrier
        raise CheckpointError(f"{folder} is missing on rank {rank}: every rank must see the same "
                              "output_dir (a shared filesystem across nodes)")
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    device_state = accelerator.rng_state() if accelerator is not None else None
    with named_write(rng_file(folder, rank)):  # torch.save's failure names no file
        torch_save({
            "python": random.getstate(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached_gaussian)},
            "torch": torch.get_rng_state(),
            "device": device_state.cpu() if device_state is not None else None,
        }, rng_file(folder, rank))


def data_state_file(folder: str | os.PathLike, rank: int) -> Path:
    """Where rank `rank`'s data position is saved: a stream that reads its own shards has one per
    rank (data/streaming.py)."""
    return Path(folder) / f"data_state_rank{rank}.json"


def read_data_state(folder: str | os.PathLike, rank: int,
                    check: Callable[[dict], None] | None = None) -> dict | None:
    """Rank `rank`'s saved data position, or None when the checkpoint has none for it. `check`,
    the data's own (MicroBatches.check_data_state), raises ValueError when the position is not one
    it can continue from: one line naming the file, before anything is read from it."""
    file = data_state_file(folder, rank)
    if not file.exists():
        return None
    with reading(file):
        state = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(state, dict):
            raise CheckpointError(f"{file} does not hold a data position (a JSON object).")
        if check is not None:
            check(state)
    return state


def write_common_files(folder: str | os.PathLike, step: int, *, model, scheduler,
                       state: dict) -> None:
    """Rank 0: the model's configuration, the scheduler and the trainer state (with "step"
    added, written last). A scheduler of None is skipped."""
    folder, text = Path(folder), json.dumps({**state, "step": step}, indent=2)  # fail early
    write_model_config(unwrap_model(model), folder)
    if scheduler is not None:
        with named_write(folder / SCHEDULER_FILE):
            torch_save(scheduler.state_dict(), folder / SCHEDULER_FILE)
    write_text(folder / STATE_FILE, text)


def save_checkpoint(output_dir: str | os.PathLike, step: int, *, model, optimizer, scheduler,
                    state: dict, accelerator, rank: int = 0, world_size: int = 1,
                    save_total_limit: int | None = None,
                    barrier: Callable[[], None] | None = None,
                    state_io: StateIO | None = None,
                    consolidate: bool = False, data_state: dict | None = None) -> Path:
    """Save checkpoint STEP atomically and return its folder; then keep only the newest
    `save_total_limit` checkpoints. With world_size > 1 every rank calls this with `barrier`.
    `state_io` (default FullState) writes the model and optimizer state; `consolidate` also
    writes the whole model as MODEL_FILE where the state IO shards it (the end of training).
    `data_state`: this rank's data position (a stream's), written as data_state_rankR.json."""
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
            if data_state is not None:
                write_text(data_state_file(tmp, rank), json.dumps(data_state))
            state_io.write(tmp, model=unwrap_model(model), optimizer=optimizer, rank=rank)
            if consolidate:
                with named_write(tmp / MODEL_FILE):
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
            drop_set_aside(output_dir)  # an earlier run's files, replaced now (start.py)
    except Exception as exc:  # a full disk, a read-only or vanished folder: the earlier ones stay
        error = write_failure(exc)  # also torch.save's RuntimeError around the system's error
        if error is None:
            raise
        kind = (EveryRankCheckpointError if isinstance(error, SharedWriteError) and world_size > 1
                else CheckpointError)
        raise kind(f"Cannot save checkpoint {final}: {os_reason(error)}.") from exc
    wait()
    return final


# -- loading -----------------------------------------------------------------------------------
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
    with reading(file):
        state = json.loads(file.read_text(encoding="utf-8"))
        check_trainer_state(state, file.parent)
        return state


def _restore_rng(file: Path, accelerator) -> None:
    """Put back the four generators saved by `write_rng_state`."""
    with reading(file):
        saved = load_pt(file)
        version, internal, gauss_next = saved["python"]
        random.setstate((version, tuple(internal), gauss_next))
        n = saved["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached_gaussian"]))
        torch.set_rng_state(saved["torch"])
        if accelerator is not None and saved["device"] is not None:
            accelerator.set_rng_state(saved["device"])


def derived_seed(seed: int, rank: int, step: int) -> int:
    """The seed of a rank the checkpoint holds no generator state for (it was saved by fewer
    processes): drawn from the run's seed, the rank and the step, so that each such rank, and each
    resume, has its own stream, the same on every rerun."""
    words = np.random.SeedSequence([seed % 2**64, rank, step]).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])  # 63 bits: every seeder takes it


def seed_generators(seed: int) -> None:
    """Seed the four generators `write_rng_state` saves: a run from the beginning (the Trainer),
    and a resumed rank the checkpoint has no generator state for."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # the device's too, where it has its own (CUDA)


def rng_note(state: dict, world_size: int) -> str | None:
    """The line rank 0 says where ranks of this run have no generator state in the checkpoint
    (`state`, its trainer state), so that `load_checkpoint` seeds them (`derived_seed`); None
    where every rank has its own."""
    saved = state.get("world_size", world_size)
    if world_size <= saved:
        return None
    ranks = f"rank {saved}" if world_size - saved == 1 else f"ranks {saved}-{world_size - 1}"
    processes = f"{saved} process{'' if saved == 1 else 'es'}"
    return (f"resuming on {world_size} processes a checkpoint saved by {processes}: {ranks} "
            f"{'has' if world_size - saved == 1 else 'have'} no saved generator state, so "
            f"{'its' if world_size - saved == 1 else 'their'} generators are seeded from seed "
            f"{state.get('seed', 0)}, the rank and step {state['step']}")


def _reader_for(folder: Path, state_io: StateIO | None) -> StateIO:
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
                    state_io: StateIO | None = None) -> dict:
    """Load a checkpoint folder into `model` (strict) and the optional optimizer and scheduler,
    restore rank `rank`'s generators, and return the trainer state. Raises CheckpointError.
    With several processes every rank calls it (a sharded folder loads collectively). A
    checkpoint of fewer processes (its state's world_size) has no generator file for the ranks
    beyond its own: those are seeded from its seed, the rank and the step (`derived_seed`;
    `rng_note` says so)."""
    folder = Path(path)
    _check_folder(folder)
    state = _read_state(folder / STATE_FILE)
    reader = _reader_for(folder, state_io)
    reader.load(folder, model=unwrap_model(model), optimizer=optimizer, rank=rank)
    if scheduler is not None:
        with reading(folder / SCHEDULER_FILE):
            scheduler.load_state_dict(load_pt(folder / SCHEDULER_FILE))
    if restore_rng and rank >= state.get("world_size", rank + 1):  # saved by fewer processes
        seed_generators(derived_seed(state.get("seed", 0), rank, state["step"]))
    elif restore_rng:
        _restore_rng(rng_file(folder, rank), accelerator)
    return state


# -- finding a checkpoint ------------------------------------------------------------------------
def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint-N folder with the largest N, or None: one with its trainer state
    and the state of either state IO."""
    complete = [path for path in checkpoint_folders(output_dir) if (path / STATE_FILE).is_file()
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
