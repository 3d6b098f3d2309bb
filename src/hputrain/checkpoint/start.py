"""Where a run starts in its output_dir: from a checkpoint, or from the beginning.

- resume_from_checkpoint="latest": the newest checkpoint, and from the beginning where there is
  none yet, said in one line. A preemptible job's script then has one command for its first run
  and for every rerun.
- resume_from_checkpoint=FOLDER: that checkpoint.
- neither: from the beginning, in an output_dir that holds no checkpoint. One that does is
  refused in one line, since training over an earlier run's checkpoints would overwrite and
  rotate them away, unless overwrite_output_dir says to start over. After torchrun restarted the
  job (`restarted`), "latest" is taken where there is a checkpoint: the job's own.

A run that starts from the beginning continues none of an earlier run's files: the checkpoint-N
folders it starts over (overwrite_output_dir, or only unfinished ones under "latest") and the logs
a run appends to (`logs`: metrics.jsonl ...) are moved into output_dir/.overwritten, where
"latest" never finds them. Nothing there is deleted before this run has written something to
take its place: its first checkpoint (save_checkpoint), or its end (`drop_set_aside`).

Global rank 0 decides (`plan_start`, under the output_dir's lock) and tells the other ranks; a
refusal is returned, not raised, so that every rank raises it together.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..errors import EveryRankError, InputError
from .folder import SET_ASIDE_DIR, checkpoint_folders
from .saving import (latest_checkpoint, load_checkpoint, read_data_state, resolve_checkpoint,
                     state_io_for)

RESUME_FLAG = "--resume-from-checkpoint latest"
OVERWRITE_FLAG = "--overwrite-output-dir"


@dataclass(frozen=True)
class Start:
    """Rank 0's decision, the same on every rank."""
    checkpoint: Path | None = None
    """The checkpoint to resume from; None: from the beginning."""
    fresh: bool = False
    """From the beginning: what an earlier run left is set aside (`set_aside`)."""
    note: str | None = None
    """A line for the user (rank 0), or None."""
    error: str | None = None
    """A refusal, which every rank raises (EveryRankError)."""


def plan_start(output_dir: str | os.PathLike, spec: str | bool | None, *, overwrite: bool,
               restarted: bool = False) -> Start:
    """Where the run in `output_dir` starts, given resume_from_checkpoint (`spec`) and
    overwrite_output_dir; reads the folder and changes nothing. A refusal is Start.error."""
    out = Path(output_dir)
    spec = "latest" if spec is True else spec or None  # Hugging Face's train(resume_from_checkpoint=True)
    if spec and overwrite:
        return Start(error=f"{OVERWRITE_FLAG} starts over and --resume-from-checkpoint continues "
                           f"a run: give one of them")
    latest = latest_checkpoint(out)
    if not spec and restarted and latest is not None:
        spec = "latest"  # torchrun restarted the job after a failure: pick up where it was
    if spec == "latest" and latest is None:
        return Start(fresh=True, note=f"no checkpoint in {out} yet: starting from the beginning")
    if spec:
        try:
            return Start(checkpoint=resolve_checkpoint(out, spec))
        except InputError as exc:
            return Start(error=str(exc))
    found = checkpoint_folders(out)
    if found and not overwrite:
        newest = f"the newest: {found[-1].name}" if len(found) > 1 else found[0].name
        return Start(error=f"output_dir {out} holds {_count(len(found), 'checkpoint')} of an "
                           f"earlier run ({newest}): add {RESUME_FLAG} to continue it, or "
                           f"{OVERWRITE_FLAG} to start over")
    return Start(fresh=True)


def agree_on_start(group, output_dir: str | os.PathLike, spec: str | None, *, overwrite: bool,
                   logs: tuple[str, ...]) -> Start:
    """Where the run starts, the same on every rank of `group` (a ProcessGroup): rank 0 decides
    and sets aside (`begin_run`), under the output_dir's lock; its refusal is raised by every
    rank alike (EveryRankError: said once, by rank 0)."""
    start = (begin_run(output_dir, spec, overwrite=overwrite, restarted=group.restarts > 0,
                       logs=logs) if group.is_main else None)
    start = group.gather_objects(start)[0]
    if start.error is not None:
        raise EveryRankError(start.error)
    return start


def load_start(start: Start, *, model, optimizer, scheduler, accelerator, rank: int, strategy,
               batches=None) -> dict:
    """Load `start`'s checkpoint into the model, optimizer and scheduler (and `batches`, a stream
    that reads its own shards, where it was); return its trainer state, or {} for a run from the
    beginning."""
    if start.checkpoint is None:
        return {}
    state = load_checkpoint(start.checkpoint, model=model, optimizer=optimizer, scheduler=scheduler,
                            accelerator=accelerator, rank=rank, state_io=state_io_for(strategy))
    if batches is not None:
        batches.load_state_dict(read_data_state(
            start.checkpoint, rank, check=getattr(batches, "check_data_state", None)))
    accelerator.mark_step()
    return state


def begin_run(output_dir: str | os.PathLike, spec: str | None, *, overwrite: bool,
              restarted: bool, logs: tuple[str, ...]) -> Start:
    """`plan_start`, then, for a run from the beginning, `set_aside`, its line joined to the
    note. Rank 0 only, under the output_dir's lock; raises nothing of its own (Start.error)."""
    start = plan_start(output_dir, spec, overwrite=overwrite, restarted=restarted)
    if not start.fresh:
        return start
    try:
        moved = set_aside(output_dir, logs)
    except InputError as exc:
        return Start(error=str(exc))
    if moved is None:
        return start
    return Start(fresh=True, note=f"{start.note or 'starting from the beginning'}; {moved}")


def set_aside(output_dir: str | os.PathLike, logs: tuple[str, ...]) -> str | None:
    """Move what an earlier run left in `output_dir` (its checkpoint-N folders and `logs`) into
    SET_ASIDE_DIR, replacing what an older start left there; return a line saying what moved,
    or None when nothing did. Rank 0 only, under the output_dir's lock."""
    out = Path(output_dir)
    moving = [*checkpoint_folders(out), *(out / name for name in logs if (out / name).exists())]
    if not moving:
        return None
    aside = out / SET_ASIDE_DIR
    try:
        aside.mkdir(exist_ok=True)
        for path in moving:
            target = aside / path.name
            if target.is_dir():
                shutil.rmtree(target)
            os.replace(path, target)
    except OSError as exc:
        raise InputError(f"output_dir {out} cannot be written: {exc.strerror} "
                         f"({exc.filename})") from None
    folders = sum(1 for path in moving if path.name.startswith("checkpoint-"))
    names = ([_count(folders, "checkpoint")] if folders else []) + [
        path.name for path in moving if not path.name.startswith("checkpoint-")]
    return (f"the earlier run's {', '.join(names)} set aside in {aside} until this run saves "
            "a checkpoint or ends")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
