"""Where a run starts in its output_dir: from a checkpoint, or from the beginning.

- resume_from_checkpoint="latest": the newest checkpoint, and from the beginning where there is
  none yet, said in one line. A preemptible job's script then has one command for its first run
  and for every rerun. A run that has already reached its last step (its newest checkpoint is
  there, or it finished keeping only final/) trains nothing and writes nothing, in one line
  (`reached_end`).
- resume_from_checkpoint=FOLDER: that checkpoint.
- neither: from the beginning, in an output_dir that holds no earlier run. One with checkpoints,
  or with the final/ of a finished run, is refused in one line, since training there would
  overwrite them, unless overwrite_output_dir says to start over. After torchrun restarted the
  job (`restarted`), "latest" is taken where the newest checkpoint is this job's own
  (`job_identity`, recorded in every checkpoint's trainer state); another job's checkpoints are
  treated as a run from the beginning treats them: refused.

A run that starts from the beginning continues none of an earlier run's files: what the earlier
run left (its checkpoint-N folders, final/, and the files it writes as it runs and at its end:
`files`, metrics.jsonl ...) is moved into output_dir/.overwritten/run-N, one folder per run set
aside (a second start over keeps the first one's whole beside it), where "latest" never finds
them. Nothing there is deleted before this run has a checkpoint (save_checkpoint) or its final/
(Trainer.save_model) complete on disk (`drop_set_aside`): a run stopped or failed before either
leaves them all there.

Global rank 0 decides (`plan_start`, under the output_dir's lock) and tells the other ranks; a
refusal is returned, not raised, so that every rank raises it together.
"""
from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import EveryRankError, InputError
from .folder import FINAL_DIR, SET_ASIDE_DIR, STATE_FILE, checkpoint_folders
from .saving import (latest_checkpoint, load_checkpoint, read_data_state, resolve_checkpoint,
                     state_io_for)

RESUME_FLAG = "--resume-from-checkpoint latest"
OVERWRITE_FLAG = "--overwrite-output-dir"


@dataclass(frozen=True)
class Start:
    """Rank 0's decision, the same on every rank."""
    checkpoint: Path | None = None
    """The checkpoint to resume from; None: from the beginning (or nowhere: see `step`)."""
    fresh: bool = False
    """From the beginning: what an earlier run left is set aside (`set_aside`)."""
    note: str | None = None
    """A line for the user (rank 0), or None."""
    error: str | None = None
    """A refusal, which every rank raises (EveryRankError)."""
    step: int | None = None
    """The step the run is at: its checkpoint's, or that of a finished run that kept only final/
    (then `checkpoint` is None and `fresh` False); see `reached_end`."""
    job: str | None = None
    """This job's identity (`job_identity`), recorded in the checkpoints it writes."""
    final: bool = False
    """output_dir holds final/, as a run writes it once it has ended (`reached_end`)."""


def plan_start(output_dir: str | os.PathLike, spec: str | bool | None, *, overwrite: bool,
               restarted: bool = False, job: str | None = None, metrics: str | None = None) -> Start:
    """Where the run in `output_dir` starts, given resume_from_checkpoint (`spec`) and
    overwrite_output_dir; reads the folder and changes nothing. After a restart, `job` (this
    job's identity) must be the newest checkpoint's for the run to continue it unasked;
    `metrics`, the run's log, says at which step a run that kept only final/ finished. A refusal
    is Start.error."""
    out = Path(output_dir)
    spec = "latest" if spec is True else spec or None  # Hugging Face's train(resume_from_checkpoint=True)
    if spec and overwrite:
        return Start(error=f"{OVERWRITE_FLAG} starts over and --resume-from-checkpoint continues "
                           f"a run: give one of them")
    latest = latest_checkpoint(out)
    if not spec and restarted and latest is not None and job is not None \
            and _trainer_state(latest).get("job") == job:
        spec = "latest"  # torchrun restarted this job after a failure: pick up where it was
    finished = (out / FINAL_DIR).is_dir()  # a run that ended, whether or not it kept checkpoints
    if spec == "latest" and latest is None:
        if finished:
            return _finished_run(out, metrics)
        return Start(fresh=True, note=f"no checkpoint in {out} yet: starting from the beginning")
    if spec:
        try:
            folder = resolve_checkpoint(out, spec)
        except InputError as exc:
            return Start(error=str(exc))
        step = _trainer_state(folder).get("step")
        return Start(checkpoint=folder, step=step if _is_step(step) else None, final=finished)
    found = checkpoint_folders(out)
    if found and not overwrite:
        newest = f"the newest: {found[-1].name}" if len(found) > 1 else found[0].name
        return Start(error=f"output_dir {out} holds {_count(len(found), 'checkpoint')} of an "
                           f"earlier run ({newest}): add {RESUME_FLAG} to continue it, or "
                           f"{OVERWRITE_FLAG} to start over")
    if finished and not overwrite:
        return Start(error=f"output_dir {out} holds the final model of an earlier run "
                           f"({FINAL_DIR}/): add {OVERWRITE_FLAG} to start over")
    return Start(fresh=True)


def _finished_run(out: Path, metrics: str | None) -> Start:
    """"latest" on a run that finished keeping no checkpoint, only final/: Start.step is where it
    ended (the last record of its `metrics` log), for `reached_end` to tell once the run's
    length is known; with no such record, refused (there is nothing to continue from)."""
    step = _last_step(out / metrics) if metrics is not None else None
    if step is None and metrics is not None:
        return Start(error=f"output_dir {out} holds the final model of an earlier run "
                           f"({FINAL_DIR}/) and no checkpoint to continue it from: add "
                           f"{OVERWRITE_FLAG} to start over")
    return Start(step=step, final=True)


def reached_end(start: Start, total_steps: int) -> str | None:
    """The line saying that the run has already reached its last step, where it has (a rerun of
    a finished run): then nothing is trained or written, except final/ where the run ended
    before writing it (Start.final false: a crash or a full disk after the last save), which is
    written from the last checkpoint. A finished run that kept no checkpoint cannot be continued
    to more steps: refused (EveryRankError, on every rank alike)."""
    if start.fresh or start.step is None:
        return None
    where = start.checkpoint if start.checkpoint is not None else f"the final model ({FINAL_DIR}/)"
    if start.step >= total_steps:
        said = f"the run has already reached max_steps ({total_steps}): {where} is at step {start.step}"
        if not start.final:
            return f"{said}, but {FINAL_DIR}/ is missing: writing it from there, training nothing"
        return f"{said}; nothing trained, nothing written"
    if start.checkpoint is None:
        raise EveryRankError(f"the run finished at step {start.step} and kept no checkpoint to "
                             f"continue it to step {total_steps} from, only {FINAL_DIR}/: add "
                             f"{OVERWRITE_FLAG} to start over")
    return None


def job_identity() -> str:
    """This job's name, the same across torchrun's restarts and another for every other job: the
    process that restarts it, torch's elastic agent (this process's parent, where the agent set
    TORCHELASTIC_RUN_ID; else this process, which nothing restarts), by host, boot, pid and
    start time (a pid alone is reused). Not the rendezvous's run id: torchrun's default is
    "none", `hputrain launch`'s names the rendezvous port (two jobs given one --master-port
    share it), and a scheduler's job id is reused across requeues. Global rank 0's agent stays
    the job's across restarts under a static rendezvous (`hputrain launch`, torchrun's
    default); where an elastic one moves rank 0 to another node, a restart is a new job."""
    pid = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
        started = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]  # field 22
    except (OSError, IndexError):  # no /proc: the pid and the host only
        boot, started = "-", "-"
    return f"{socket.gethostname()}/{boot}/{pid}/{started}"


def _trainer_state(folder: Path) -> dict:
    """A checkpoint's trainer state, or {} where it cannot be read (loading it says why)."""
    try:
        state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _last_step(file: Path) -> int | None:
    """The step of the last record of a run's metrics log (a finished run's summary), skipping a
    torn last line; None where there is none."""
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError):
        return None
    for line in reversed(lines):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if _is_step(step):
            return step
    return None


def _is_step(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def agree_on_start(group, output_dir: str | os.PathLike, spec: str | None, *, overwrite: bool,
                   files: tuple[str, ...], metrics: str) -> Start:
    """Where the run starts, the same on every rank of `group` (a ProcessGroup): rank 0 decides
    and sets aside (`begin_run`), under the output_dir's lock, with its job's identity; its
    refusal is raised by every rank alike (EveryRankError: said once, by rank 0)."""
    start = (begin_run(output_dir, spec, overwrite=overwrite, restarted=group.restarts > 0,
                       files=files, metrics=metrics, job=job_identity())
             if group.is_main else None)
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
              restarted: bool, files: tuple[str, ...], metrics: str, job: str) -> Start:
    """`plan_start`, then, for a run from the beginning, `set_aside`, its line joined to the
    note; `job` goes with the answer. Rank 0 only, under the output_dir's lock; raises nothing
    of its own (Start.error)."""
    start = plan_start(output_dir, spec, overwrite=overwrite, restarted=restarted, job=job,
                       metrics=metrics)
    if start.fresh:
        try:
            moved = set_aside(output_dir, files)
        except InputError as exc:
            return Start(error=str(exc))
        if moved is not None:
            start = replace(start, note=f"{start.note or 'starting from the beginning'}; {moved}")
    return replace(start, job=job)


def set_aside(output_dir: str | os.PathLike, files: tuple[str, ...]) -> str | None:
    """Move what an earlier run left in `output_dir` (its checkpoint-N folders, final/ and
    `files`) into a folder of its own, SET_ASIDE_DIR/run-N, beside the runs an earlier start set
    aside (each kept whole); return a line saying what moved, or None when nothing did. Rank 0
    only, under the output_dir's lock."""
    out = Path(output_dir)
    names = dict.fromkeys((FINAL_DIR, *files))
    moving = [*checkpoint_folders(out), *(out / name for name in names if (out / name).exists())]
    if not moving:
        return None
    folders = sum(1 for path in moving if path.name.startswith("checkpoint-"))
    said = ([_count(folders, "checkpoint")] if folders else []) + [
        f"{path.name}/" if path.is_dir() else path.name for path in moving[folders:]]
    aside = out / SET_ASIDE_DIR
    try:
        aside.mkdir(exist_ok=True)
        numbers = [int(m.group(1)) for child in aside.iterdir()
                   if (m := re.fullmatch(r"run-(\d+)", child.name))]
        target = aside / f"run-{max(numbers, default=0) + 1}"
        target.mkdir()
        for path in moving:
            os.replace(path, target / path.name)
    except OSError as exc:
        raise InputError(f"output_dir {out} cannot be written: {exc.strerror} "
                         f"({exc.filename})") from None
    return (f"the earlier run's {', '.join(said)} set aside in {target} until this run has a "
            f"checkpoint or its {FINAL_DIR}/ on disk")


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
