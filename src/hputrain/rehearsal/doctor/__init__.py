"""`hputrain doctor SCRIPT [ARGS]`: a dry run of Gaudi's lazy mode on the CPU.

The user's script runs unmodified; every hputrain Trainer it makes gets a `DoctorWatch` callback
(callbacks.added_to_every_trainer), which switches it to lazy mode on PyTorch's own lazy tensor
backend (output to a temporary folder, no checkpoints) and watches each of the first N optimizer
steps for what makes lazy mode slow on a Gaudi:

- recompilation: new graphs after warm-up because something other than the shapes changes the
  graph; or batch shapes that are not a bounded set. A few steps cannot tell that (a short window
  with no new shape in its last steps is luck, not proof), so before the first step the doctor
  walks the run's own batches, collated as the Trainer collates them and in its order, without
  the model (shapes.py): one epoch, or the run's steps when it stops sooner (max_steps). A
  bounded set, such as length buckets or one fixed length, is "N shapes, each compiled once":
  fine; more than a few shapes, or padding to each batch's longest row of ragged data, is the
  finding, with the fix (length_buckets, pad_to_multiple_of, fixed-length padding);
- host_sync: values read back to the host inside a step (`.item()`, `bool(t)`, `.cpu()`, print),
  each of which cuts the graph short and stalls the device; named by the user's own line, and by
  the library's when the read is inside one, with the fix where one is known. Reads on a plain
  loop's logging steps only (never two steps in a row) are a note, not a finding, and the graphs
  of the steps around them are judged by the logging period (rehearsal/doctor/loop.py);
- fallback: operations that would run eagerly, outside the graph, on Gaudi too. The CPU lazy
  backend's own gaps (cpu_lazy.BACKEND_FALLBACKS) are left out, and the report says so.

The trainer's own reads (logging, evaluation) happen between steps and are not counted. Under
GRPO the batches are rollouts the model generates: their shapes are described from the prompts
and prompt_buckets instead of walked (the Trainer's `described_batches`, GRPOTrainer's:
methods/grpo/doctor.py), and the graphs compiled between steps (generation's) are counted too.
"""
from __future__ import annotations

import contextlib
import os
import runpy
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path


from ...accelerators.cpu_lazy import HostReads, lazy_counters
from ...callbacks import Callback, added_to_every_trainer
from ...data.batching import LoaderOptions, PadToBuckets, default_collate
from ...distributed.launch import ONE_PROCESS
from ...errors import InputError
from ...models.kind import registered
from .loop import LoopRehearsal
from .hf import HFRehearsal, optimum_missing
from ..findings import (_PACKAGE, PADDING, DoctorFinished, Rehearsal, RunShapes, SyncSite,
                        _library_path, diagnose, mask_layout, random_state_kept, sync_site)
from ..shapes import batch_shapes, take_census
from ..standin import NOT_COVERED, StandIn, real_gaudi_present

__all__ = ["PADDING", "DoctorFinished", "DoctorWatch", "RunShapes", "SyncSite", "diagnose", "run",
           "walk_run_batches"]


class DoctorWatch(Callback):
    """Moves the trainer's run to lazy mode on the CPU, in `output_dir`, without checkpoints;
    before the first step, the shapes of the whole run's batches (RunShapes); then per step: new
    graph compilations, host reads, fallback ops, and the batch's shapes."""

    def __init__(self, steps: int, output_dir: str, reads: HostReads) -> None:
        self.steps, self.output_dir, self.reads = steps, output_dir, reads
        self.records: list[dict] = []
        self.run_shapes: RunShapes | None = None
        self.processes = 1  # what the run asked for (devices × num_nodes); one is rehearsed
        self._before: dict[str, int] = {}
        self._ended: dict[str, int] = {}  # the counters when the last step ended
        self._reads_before = 0

    def rehearsal_dir(self) -> str:
        return self.output_dir

    def on_train_begin(self, trainer) -> None:
        self.processes = trainer.args.devices * trainer.args.num_nodes
        if self.run_shapes is None:  # a second train() of the same trainer walks nothing new
            self.run_shapes = walk_run_batches(trainer)
        self._ended = lazy_counters()

    def on_step_begin(self, trainer) -> None:
        self._before = lazy_counters()
        self._reads_before = self.reads.count
        self.reads.in_step = True

    def on_step_end(self, trainer) -> None:
        self.reads.in_step = False
        after = lazy_counters()
        new = {k: v - self._before.get(k, 0) for k, v in after.items() if v != self._before.get(k, 0)}
        batch = trainer.step_inputs
        self.records.append({
            "step": trainer.global_step,
            "compiles": new.get("UncachedCompile", 0),
            # what was built since the last step: its batch (GRPO: a rollout), logging's reads
            "compiles_between": _compiles(self._before) - _compiles(self._ended),
            "host_syncs": self.reads.count - self._reads_before,
            # aten:: counters are ops run eagerly; _local_scalar_dense is a read, counted above
            "fallbacks": {k[6:]: v for k, v in new.items()
                          if k.startswith("aten::") and k != "aten::_local_scalar_dense"},
            "shapes": batch_shapes(batch),
            "attention_mask": mask_layout(batch),
        })
        self._ended = after
        if len(self.records) >= self.steps:
            raise DoctorFinished


def _compiles(counters: dict[str, int]) -> int:
    return counters.get("UncachedCompile", 0)


def walk_run_batches(trainer) -> RunShapes:
    """The census of the micro-batches this trainer's run will take, from the Trainer's own batch
    source: the same samples, collator and order, this rank's share, from the step it starts at,
    for one epoch or the run's steps if fewer (max_steps). Collated here, without worker
    processes (loading.py: the same batches), with the random generators put back afterwards,
    so that a collator that draws random numbers leaves the run's draws as they were."""
    dataset = trainer.train_dataset
    if isinstance(dataset, Iterator):
        return RunShapes(None, skipped="the train_dataset is a one-pass iterator, which walking "
                         "its batches ahead would use up")
    batches = trainer.train_batches()  # the run's own batch source, as train() builds it
    steps, per_epoch = trainer.total_steps - trainer.global_step, batches.steps_per_epoch
    if per_epoch is not None and per_epoch < steps:
        steps, walked = per_epoch, f"an epoch of {per_epoch} steps"
    else:
        walked = f"the run's {steps} steps" + (" (max_steps)" if trainer.args.max_steps > 0 else "")
    # batches the model generates (GRPO's rollouts) are described by the trainer, not walked
    if (described := trainer.described_batches(batches, steps, walked)) is not None:
        return described
    batches.loading = LoaderOptions()
    collate = trainer.collate
    collator = ("default" if collate is default_collate else
                "buckets" if isinstance(collate, PadToBuckets) else "yours")
    with random_state_kept():
        census = take_census(batches.iterate(trainer.global_step), steps * batches.accumulate)
    return RunShapes(census, walked, collator)




class TrainerRehearsal(Rehearsal):
    """The hputrain Trainer path: a DoctorWatch for every Trainer the script makes; `claimed`
    once one was made (the plain-loop watch then leaves the steps to it)."""

    def __init__(self, steps: int, reads: HostReads, output_dir: str) -> None:
        self.steps, self.reads, self.output_dir = steps, reads, output_dir
        self.watches: list[DoctorWatch] = []
        self._hook = added_to_every_trainer(self._watch)

    def _watch(self) -> DoctorWatch:
        if not self.watches:  # what a plain-loop watch counted before is not this Trainer's
            self.reads.where.clear()
            self.reads.in_step = False  # the Trainer's steps begin at its on_step_begin
        self.watches.append(DoctorWatch(self.steps, self.output_dir, self.reads))
        return self.watches[-1]

    def __enter__(self) -> TrainerRehearsal:
        self._hook.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hook.__exit__(*exc)

    def report(self, warmup: int, experts=()) -> dict:
        found = diagnose(self.records, warmup, self.reads,
                         _widest(w.run_shapes for w in self.watches if w.records), experts)
        processes = max((w.processes for w in self.watches if w.records), default=1)
        if processes > 1:
            found["notes"].insert(0, f"the run asks for {processes} processes (devices × "
                                  "num_nodes): rehearsed as one, rank 0 alone (the lazy dry run "
                                  "is one process); no process was started")
        return found


def run(script: str, script_args: list[str], steps: int, warmup: int) -> dict:
    """Rehearse `script` for `steps` steps under the stand-in Gaudi runtime; the report of
    whichever trained: an hputrain Trainer, a Hugging Face Trainer, or a plain loop."""
    path = Path(script)
    if not path.is_file():
        raise InputError(f"script {script} does not exist")
    gaudi = real_gaudi_present()
    os.environ["HPUTRAIN_ACCELERATOR"] = "cpu"
    reads = HostReads(locate=sync_site)
    with (tempfile.TemporaryDirectory(prefix="hputrain-doctor-") as output_dir, StandIn() as runtime,
          _one_process()):
        trainer = TrainerRehearsal(steps, reads, output_dir)
        hf = HFRehearsal(steps, reads, runtime)
        paths = [trainer, hf]
        loop = LoopRehearsal(steps, reads, runtime, warmup, claimed=lambda: any(p.claimed for p in paths))
        # what runs inside the model kinds' modules (MoE experts), whichever path trains
        watches = [w for kind in registered() if (w := kind.doctor_watch(reads)) is not None]
        with contextlib.ExitStack() as stack:
            for rehearsal in (*paths, loop, *watches):
                stack.enter_context(rehearsal)
            _run_script(path, script_args, reads)
    used = next((p for p in paths if p.claimed), loop)
    if not used.records:
        raise InputError(f"{script} trained no step (no optimizer step, no hputrain or Hugging Face "
                         "Trainer step), so there is nothing to check")
    report = used.report(warmup, [seen for watch in watches for seen in watch.seen()])
    if gaudi:
        report["notes"].insert(0, "a Gaudi is present, and the doctor rehearsed on the CPU anyway: "
                               "its lazy backend stands in for the HPU")
    if runtime.ranks > 1:
        report["notes"].insert(0, f"started as one rank of WORLD_SIZE={runtime.ranks}: rehearsed as "
                               "rank 0 alone (DistributedDataParallel as the bare module)")
    return report


def _one_process():
    """For the time of the rehearsal, a run that asks for several processes (--devices N) runs as
    this one (distributed/launch.ONE_PROCESS): left to start them, it ran the real job to its
    end, checkpoints and final/ written, without the doctor."""
    from unittest import mock

    return mock.patch.dict(os.environ, {ONE_PROCESS: "1"})


def _run_script(path: Path, script_args: list[str], reads: HostReads) -> None:
    """Run the script as __main__ until it ends or the doctor has seen enough (DoctorFinished);
    an error of the script is one line naming its file:line."""
    saved_argv, sys.argv = sys.argv, [str(path), *script_args]
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        with reads:
            runpy.run_path(str(path), run_name="__main__")
    except DoctorFinished:
        pass
    except SystemExit as error:
        if error.code not in (None, 0):
            raise InputError(f"{path.name} exited with {error.code} in the rehearsal") from None
    except InputError:
        raise
    except Exception as error:
        raise InputError(optimum_missing(error) or _error_line(path, error)) from None
    finally:
        sys.argv = saved_argv
        sys.path.remove(folder)


def _error_line(path: Path, error: Exception) -> str:
    """One line: where in the user's code the script failed, what, and what the stand-in lacks."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if _users(f.filename)]
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else path.name
    text = " ".join(str(error).split())
    line = f"{path.name} failed in the rehearsal at {where}: {type(error).__name__}: {text}"
    missing = getattr(error, "name", None) or ""
    if isinstance(error, ModuleNotFoundError) and missing.startswith("habana_frameworks"):
        line += f" ({NOT_COVERED} the module {missing}; docs/doctor.md lists what it covers)"
    elif NOT_COVERED in text:
        line += " (docs/doctor.md lists what it covers)"
    return line


def _users(filename: str) -> bool:
    """A frame of the user's code: not hputrain's, torch's, a library's or the standard library's."""
    in_torch = f"{os.sep}torch{os.sep}" in filename
    return not (filename.startswith(_PACKAGE) or in_torch or filename.startswith("<")
                or _library_path(filename) is not None)


def _widest(runs) -> RunShapes | None:
    """Of the watched trainers' runs (one, as a rule), the one whose batches have most shapes."""
    runs = [r for r in runs if r is not None]
    walked = [r for r in runs if r.census is not None]
    if walked:
        return max(walked, key=lambda r: len(r.census.shapes))
    return runs[0] if runs else None
