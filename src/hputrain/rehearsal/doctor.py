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
  the library's when the read is inside one, with the fix where one is known;
- fallback: operations that would run eagerly, outside the graph, on Gaudi too. The CPU lazy
  backend's own gaps (cpu_lazy.BACKEND_FALLBACKS) are left out, and the report says so.

The trainer's own reads (logging, evaluation) happen between steps and are not counted.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import runpy
import sys
import sysconfig
import tempfile
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from ..accelerators.cpu_lazy import BACKEND_FALLBACKS, HostReads, lazy_counters
from ..callbacks import Callback, added_to_every_trainer
from ..data.batching import LoaderOptions, PadToBuckets, default_collate
from ..errors import InputError
from .shapes import MAX_SHAPES, ShapeCensus, batch_shapes, shape_text, take_census

_PACKAGE = str(Path(__file__).parents[1])  # hputrain itself: its frames are not the user's


class DoctorFinished(BaseException):
    """Raised after the last watched step to stop the user's script. A BaseException, as
    KeyboardInterrupt is, so that the script's own `except Exception:` does not swallow it."""


@dataclasses.dataclass(frozen=True)
class SyncSite:
    """Where a value was read back to the host."""

    read: str
    """The tensor method that read it: item, __bool__, cpu, ..."""
    user: str
    """file:line of the innermost frame of the user's own code (not a library's, torch's or
    hputrain's); "?" when there is none."""
    library: str | None = None
    """package/file.py:line of the innermost library frame when the read is inside a library
    (transformers/masking_utils.py:307), else None."""
    function: str | None = None
    """The library function that read it."""


def _library_path(filename: str) -> str | None:
    """The path below site-packages of an installed library's file, "" for a file of the standard
    library, None for the user's own."""
    parts = Path(filename).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1:])
    return "" if filename.startswith(sysconfig.get_paths()["stdlib"] + os.sep) else None


def _sync_site(read: str) -> SyncSite:
    """The user's line and the library's (torch's own frames and hputrain's are skipped)."""
    user, library = "?", None
    for frame in reversed(traceback.extract_stack()[:-1]):
        in_torch = f"{os.sep}torch{os.sep}" in frame.filename
        if frame.filename.startswith(_PACKAGE) or in_torch or frame.filename.startswith("<"):
            continue
        path = _library_path(frame.filename)
        if path is None:
            user = f"{Path(frame.filename).name}:{frame.lineno}"
            break
        if path and library is None:
            library = (f"{path}:{frame.lineno}", frame.name)
    return SyncSite(read, user, *(library or (None, None)))


class DoctorWatch(Callback):
    """Moves the trainer's run to lazy mode on the CPU, in `output_dir`, without checkpoints;
    before the first step, the shapes of the whole run's batches (RunShapes); then per step: new
    graph compilations, host reads, fallback ops, and the batch's shapes."""

    def __init__(self, steps: int, output_dir: str, reads: HostReads) -> None:
        self.steps, self.output_dir, self.reads = steps, output_dir, reads
        self.records: list[dict] = []
        self.run_shapes: RunShapes | None = None
        self._before: dict[str, int] = {}
        self._reads_before = 0

    def rehearsal_dir(self) -> str:
        return self.output_dir

    def on_train_begin(self, trainer) -> None:
        if self.run_shapes is None:  # a second train() of the same trainer walks nothing new
            self.run_shapes = walk_run_batches(trainer)

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
            "host_syncs": self.reads.count - self._reads_before,
            # aten:: counters are ops run eagerly; _local_scalar_dense is a read, counted above
            "fallbacks": {k[6:]: v for k, v in new.items()
                          if k.startswith("aten::") and k != "aten::_local_scalar_dense"},
            "shapes": batch_shapes(batch),
            "attention_mask": _mask_layout(batch),
        })
        if len(self.records) >= self.steps:
            raise DoctorFinished


@dataclasses.dataclass
class RunShapes:
    """The census of a run's batches (shapes.py), with what the doctor needs to word it."""

    census: ShapeCensus | None
    """None when the batches could not be walked ahead (see `skipped`)."""
    walked: str = ""
    """What was walked: "an epoch of 64 steps", "the run's 20 steps (max_steps)"."""
    collator: str = "yours"
    """The Trainer's collator: "default" (default_collate), "buckets" (PadToBuckets, from
    length_buckets / pad_to_multiple_of or given), or "yours"."""
    skipped: str | None = None

    def as_dict(self) -> dict:
        if self.census is None:
            return {"skipped": self.skipped}
        return {**self.census.as_dict(), "walked": self.walked, "collator": self.collator}


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
    batches.loading = LoaderOptions()
    steps, per_epoch = trainer.total_steps - trainer.global_step, batches.steps_per_epoch
    if per_epoch is not None and per_epoch < steps:
        steps, walked = per_epoch, f"an epoch of {per_epoch} steps"
    else:
        walked = f"the run's {steps} steps" + (" (max_steps)" if trainer.args.max_steps > 0 else "")
    collate = trainer.collate
    collator = ("default" if collate is default_collate else
                "buckets" if isinstance(collate, PadToBuckets) else "yours")
    with _random_state_kept():
        census = take_census(batches.iterate(trainer.global_step), steps * batches.accumulate)
    return RunShapes(census, walked, collator)


@contextlib.contextmanager
def _random_state_kept():
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def _mask_layout(batch) -> str | None:
    """"all ones", "right padded" (each row ones, then zeros), "other", or None (no mask). Read
    between steps, so it is not counted as the step's host sync."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    mask = mask.cpu()
    if bool(mask.all()):
        return "all ones"
    return "right padded" if bool((mask[:, 1:] <= mask[:, :-1]).all()) else "other"


# -- the report ----------------------------------------------------------------------------------------

def diagnose(records: list[dict], warmup: int, reads: HostReads, run: RunShapes | None = None) -> dict:
    """The report: per-step figures, the shapes of the whole run (`run`, when its batches were
    walked), findings (each naming the problem and the fix) and notes (what was seen and is fine,
    and what was left out)."""
    shapes = _shape_history(records, warmup)
    census = run.census if run is not None else None
    fallback_ops, backend_gaps = _fallback_ops(records)
    findings = [*_recompilation(records, warmup, shapes, judge_growth=census is None),
                *_unbounded_shapes(run, shapes), *_host_syncs(records, reads),
                *_fallbacks(fallback_ops)]
    notes = [*_run_shapes_notes(run), *_bounded_shapes(shapes, run, findings), *_left_out(backend_gaps)]
    return {"steps": len(records), "compiles_per_step": [r["compiles"] for r in records],
            "host_syncs_per_step": [r["host_syncs"] for r in records], "shapes": shapes,
            "run_shapes": None if run is None else run.as_dict(),
            "fallback_ops": fallback_ops, "backend_gaps_left_out": backend_gaps,
            "findings": findings, "notes": notes}


def _shape_history(records: list[dict], warmup: int) -> dict:
    """The distinct batch shapes of the steps watched, the steps that brought a new one, and
    whether new ones still came in the second half of the steps after warm-up."""
    seen: list[str] = []
    new_at = []
    for record in records:
        key = shape_text(record["shapes"])
        if key not in seen:
            seen.append(key)
            new_at.append(record["step"])
    after = [r["step"] for r in records[warmup:]]
    tail = after[len(after) // 2:]
    return {"distinct": seen, "new_at_steps": new_at, "growing": any(s in tail for s in new_at[1:])}


def _recompilation(records: list[dict], warmup: int, shapes: dict, judge_growth: bool) -> list[dict]:
    """Compiles after warm-up for shapes already compiled; and, when the run's batches could not
    be walked (`judge_growth`), shapes that kept coming in the steps watched."""
    late = [r for r in records[warmup:] if r["compiles"]]
    if not late:
        return []
    known = [r["step"] for r in late if r["step"] not in _steady_new_at(records)]
    count = sum(r["compiles"] for r in late)
    findings = []
    if known:
        findings.append({"kind": "recompilation", "message": (
            f"step(s) {known} compiled new graphs for batch shapes already compiled: something other "
            "than the shapes changes the graph from step to step, such as a Python number that "
            "changes every step (a step count, a random draw on the host) used in the forward, which "
            "the graph holds as a constant. Make it a tensor.")})
    if judge_growth and shapes["growing"]:
        findings.append({"kind": "recompilation", "message": (
            f"the batch shapes keep growing: {len(shapes['distinct'])} shapes in {len(records)} steps, "
            f"a new one at steps {shapes['new_at_steps']}, still after the warm-up, and each new shape "
            f"compiles new graphs ({count} after the {warmup} warm-up step(s)). Gaudi compiles the "
            "same way for every new shape; pad or bucket sequence lengths to a few fixed sizes "
            "(padding to a multiple of 64, say), so that the set stops growing. Batch shapes seen: "
            f"{', '.join(shapes['distinct'])}. (If your lengths do come from a small fixed set, "
            "watch more --steps to see each of them compiled once.)")})
    return findings


def _steady_new_at(records: list[dict]) -> set[int]:
    """The steps that compiled a shape's graphs for good: its first step, and its first after
    step 1. The first step's graphs also create the optimizer's state (AdamW's moments), so the
    shape of step 1 compiles again the next time it comes, and from then on runs from the cache."""
    seen: set[str] = set()
    steps = set()
    for record in records:
        key = shape_text(record["shapes"])
        if record["step"] == 1 or key not in seen:
            steps.add(record["step"])
        if record["step"] > 1:
            seen.add(key)
    return steps


def _unbounded_shapes(run: RunShapes | None, shapes: dict) -> list[dict]:
    """The run's batches are not a bounded set of shapes (shapes.py's rule)."""
    census = None if run is None else run.census
    if census is None or census.bounded:
        return []
    count = f"{'at least ' if census.lower_bound else ''}{len(census.shapes)}"
    return [{"kind": "recompilation", "message": (
        f"the run's batches come in {count} shapes ({run.walked}, {census.batches} micro-batches, "
        f"walked without the model; the steps watched here met {len(shapes['distinct'])} of them), "
        f"and Gaudi compiles the step's graphs again for each new shape: {count} times over in the "
        f"run. Not a bounded set: "
        f"{'; '.join(census.reasons())}. {_shape_fix(run)} Shapes: {census.listing()}. (Bounded "
        f"means at most {MAX_SHAPES} shapes, and, for padding to each batch's longest row, rows of "
        f"at most {MAX_SHAPES} lengths.)")}]


def _shape_fix(run: RunShapes) -> str:
    """How to pad to a few lengths, for the collator the run has."""
    census = run.census
    suggested = census.multiple_for()
    multiple = (f"pad_to_multiple_of={suggested[0]} (here at most {suggested[1]} shapes)"
                if suggested else "pad_to_multiple_of=64")
    fixed = (f"one fixed length, {max(census.widths)} tokens here (one shape)" if census.widths
             else "one fixed length")
    settings = f"length_buckets=4 (lengths spaced up to the model's maximum) or {multiple}"
    if run.collator == "default":
        return (f"Pad to a few lengths: with {settings} in TrainingArguments, and no "
                "data_collator given, the default collator pads input_ids, labels and "
                f"attention_mask to them; or pad every batch to {fixed}.")
    if run.collator == "buckets":
        return f"Pad to fewer lengths: fewer length_buckets, or a larger {multiple}."
    how = ("pads each batch to its longest row" if census.padding == "longest row"
           else "pads to more lengths than that")
    return (f"Your data_collator {how}: pad to a few lengths there (transformers' padding "
            f"collators take pad_to_multiple_of), or to {fixed} with padding=\"max_length\"; or "
            f"leave data_collator out and set {settings} in TrainingArguments: the default "
            "collator then pads to those lengths.")


def _run_shapes_notes(run: RunShapes | None) -> list[str]:
    """What limits the count: a walk that could not be made, or that stopped early."""
    if run is None:
        return []
    if run.census is None:
        return [f"the run's batches were not walked ahead ({run.skipped}): their shapes are "
                "judged from the steps watched only"]
    census = run.census
    if not census.lower_bound:
        return []
    return [f"the run's shape count ({len(census.shapes)}) is a lower bound: the walk over its "
            f"batches stopped after {census.batches} of {census.planned} micro-batches, at "
            f"{census.stopped}"]


def _bounded_shapes(shapes: dict, run: RunShapes | None, findings: list[dict]) -> list[str]:
    if any(f["kind"] == "recompilation" for f in findings):
        return []
    census = None if run is None else run.census
    if census is None:
        if len(shapes["distinct"]) < 2:
            return []
        return [f"{len(shapes['distinct'])} batch shapes, each compiled once (new at steps "
                f"{shapes['new_at_steps']}, none in the last steps): a bounded set, such as length "
                "buckets, is fine: after its first step each shape runs from the graph cache. "
                f"Shapes: {', '.join(shapes['distinct'])}"]
    if len(census.shapes) < 2:
        return []
    return [f"{len(census.shapes)} batch shapes in the run ({run.walked}, {census.batches} "
            f"micro-batches, walked without the model), each compiled once: a bounded set, such as "
            "length buckets, is fine: after its first step each shape runs from the graph cache. "
            f"Shapes: {census.listing()}"]


def _host_syncs(records: list[dict], reads: HostReads) -> list[dict]:
    per_step = [r["host_syncs"] for r in records]
    if not any(per_step):
        return []
    by_fix: dict[str, list[str]] = {}
    for site, n in sorted(reads.where.items(), key=lambda item: str(item[0])):
        by_fix.setdefault(_known_fix(site, records), []).append(f"{_describe(site)} ({n}x)")
    parts = [f"{', '.join(places)}: {fix}" for fix, places in by_fix.items()]
    return [{"kind": "host_sync", "message": (
        f"values read back to the host inside the step, {max(per_step)} per step. Each read cuts "
        f"the graph short and waits for the device. {' '.join(parts)}")}]


def _describe(site: SyncSite) -> str:
    if site.library is None:
        return f"{site.read} at {site.user}"
    return f"{site.read} in {site.library} ({site.function}), called from {site.user}"


_GENERIC_FIX = "keep values on the device and read them at logging steps."


def _known_fix(site: SyncSite, records: list[dict]) -> str:
    """The concrete fix for a read whose cause is known, else the general advice."""
    if site.library and site.library.startswith("transformers/masking_utils.py"):
        layouts = {r["attention_mask"] for r in records}
        if layouts == {"all ones"}:
            return ("transformers reads the attention_mask each step to see whether it can skip "
                    "it, and the batches' attention_mask is all ones: leave attention_mask out of "
                    "the batches (the model then builds its causal mask without a read).")
        return ("transformers reads the attention_mask each step to see whether it can skip it. "
                "For a causal LM with padding on the right and labels -100 on it, the mask changes "
                "nothing (no real token attends to a later one): leave it out of the batches.")
    if site.library is None and site.read in ("item", "tolist", "__float__", "__format__", "__repr__"):
        return ("keep the value a tensor (`loss.detach()`, summed on the device) and read it "
                "only on logging steps (every logging_steps), as the trainer does with the loss.")
    return _GENERIC_FIX


def _fallback_ops(records: list[dict]) -> tuple[dict[str, int], dict[str, int]]:
    """Eager ops summed over the steps: those that would fall back on Gaudi too, and the CPU lazy
    backend's own gaps."""
    ops: dict[str, int] = {}
    for record in records:
        for op, n in record["fallbacks"].items():
            ops[op] = ops.get(op, 0) + n
    gaps = {op: n for op, n in sorted(ops.items()) if op in BACKEND_FALLBACKS}
    return {op: n for op, n in sorted(ops.items()) if op not in gaps}, gaps


def _fallbacks(fallback_ops: dict[str, int]) -> list[dict]:
    if not fallback_ops:
        return []
    ops = ", ".join(f"{op} ({n}x)" for op, n in fallback_ops.items())
    return [{"kind": "fallback", "message": (
        f"operations that fell back to eager execution, outside the graph: {ops}. Replace "
        "them with graph-friendly ops (fixed-shape masks instead of nonzero or boolean "
        "indexing, for example).")}]


def _left_out(backend_gaps: dict[str, int]) -> list[str]:
    if not backend_gaps:
        return []
    ops = "; ".join(f"{op} ({n}x): {BACKEND_FALLBACKS[op]}" for op, n in backend_gaps.items())
    return [f"left out of the findings: eager fallbacks of the CPU lazy backend that Gaudi does "
            f"not have: {ops}"]


def run(script: str, script_args: list[str], steps: int, warmup: int) -> dict:
    path = Path(script)
    if not path.is_file():
        raise InputError(f"script {script} does not exist")
    os.environ["HPUTRAIN_ACCELERATOR"] = "cpu"
    reads = HostReads(locate=_sync_site)
    watches: list[DoctorWatch] = []

    def watch() -> DoctorWatch:  # one for each Trainer the script makes
        watches.append(DoctorWatch(steps, output_dir, reads))
        return watches[-1]

    with tempfile.TemporaryDirectory(prefix="hputrain-doctor-") as output_dir:
        saved_argv, sys.argv = sys.argv, [str(path), *script_args]
        sys.path.insert(0, str(path.resolve().parent))
        try:
            with reads, added_to_every_trainer(watch):
                runpy.run_path(str(path), run_name="__main__")
        except DoctorFinished:
            pass
        finally:
            sys.argv = saved_argv
            sys.path.remove(str(path.resolve().parent))
    records = [r for watch in watches for r in watch.records]
    if not records:
        raise InputError(f"{script} trained no step with hputrain's Trainer, so there is nothing "
                         "to check")
    return diagnose(records, warmup, reads, _widest(w.run_shapes for w in watches if w.records))


def _widest(runs) -> RunShapes | None:
    """Of the watched trainers' runs (one, as a rule), the one whose batches have most shapes."""
    runs = [r for r in runs if r is not None]
    walked = [r for r in runs if r.census is not None]
    if walked:
        return max(walked, key=lambda r: len(r.census.shapes))
    return runs[0] if runs else None


PADDING = {"fixed": "one fixed length", "longest row": "each batch to its longest row",
            "other": "to set lengths (buckets, multiples)", "unknown": "not shown by the batches"}
