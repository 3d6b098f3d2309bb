"""What `hputrain doctor` reports, whatever ran the steps: the findings and notes built from the
per-step records of a rehearsal (doctor.py's hputrain Trainer path, rehearsal/doctor/loop.py's plain Gaudi
loop), and where in the user's code a host read or an eager op happened.

A record is one watched step: {"step", "compiles" (new lazy graphs), "host_syncs" (reads back to
the host), "fallbacks" (aten op -> count, ops run eagerly), "shapes" (the batch's tensors by name),
"attention_mask" (its layout or None)}; a plain loop's records may add "fallback_sites" (op ->
the user's file:line list). `diagnose` turns them into the report every doctor run prints.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sysconfig
import traceback
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from ..accelerators.cpu_lazy import BACKEND_FALLBACKS, HostReads
from ..models.kind import registered
from .shapes import MAX_SHAPES, ShapeCensus, shape_text

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


def sync_site(read: str) -> SyncSite:
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
    fix: str | None = None
    """How to pad to a few lengths, in the words of the script's own trainer (rehearsal/doctor/hf.py words
    it in transformers' arguments); None: in hputrain's TrainingArguments (shape_fix)."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What the doctor knows about this batch source, for the report's notes (GRPO's shapes)."""
    between_steps: str | None = None
    """What the run does between steps that builds graphs of its own (GRPO: "the rollouts"); when
    set, the graphs compiled between steps are counted and noted too."""

    def as_dict(self) -> dict:
        if self.census is None:
            return {"skipped": self.skipped}
        return {**self.census.as_dict(), "walked": self.walked, "collator": self.collator}

def mask_layout(batch) -> str | None:
    """"all ones", "right padded" (each row ones, then zeros), "other", or None (no mask). Read
    between steps, so it is not counted as the step's host sync."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    mask = mask.cpu()
    if bool(mask.all()):
        return "all ones"
    return "right padded" if bool((mask[:, 1:] <= mask[:, :-1]).all()) else "other"


@contextlib.contextmanager
def random_state_kept():
    """Python's, numpy's and torch's random generators put back as they were on leaving: walking
    a run's batches ahead (a collator may draw) leaves the run's own draws unchanged."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


class Rehearsal:
    """What a trainer's rehearsal shares (doctor.TrainerRehearsal, doctor_hf.HFRehearsal): the
    watches of the trainers the script made, `claimed` once there is one (the plain-loop watch
    then leaves the steps to it), and their records in order."""

    watches: list

    @property
    def claimed(self) -> bool:
        return bool(self.watches)

    @property
    def records(self) -> list[dict]:
        return [r for watch in self.watches for r in watch.records]


# -- the report ----------------------------------------------------------------------------------------

def diagnose(records: list[dict], warmup: int, reads: HostReads, run: RunShapes | None = None,
             experts: list = ()) -> dict:
    """The report: per-step figures, the shapes of the whole run (`run`, when its batches were
    walked), findings (each naming the problem and the fix) and notes (what was seen and is fine,
    and what was left out). `experts`: what the model kinds' watches saw run inside their modules
    (ModelKind.doctor_watch: MoE experts, kinds/moe/doctor.py); those whose shapes follow the
    routing are their kind's finding (ModelKind.doctor_findings), which explains the
    recompilations, and their reads (each with its own fix) and eager ops are left to it."""
    shapes = _shape_history(records, warmup)
    census = run.census if run is not None else None
    fallback_ops, backend_gaps = _fallback_ops(records)
    routed = [e for e in experts if e.routing_dependent]
    in_experts = {site: e.read_fix for e in routed for site in e.reads}
    of_kinds = [found for kind in registered() for found in kind.doctor_findings(records, warmup, routed)]
    findings = [*of_kinds,
                *_recompilation(records, warmup, shapes, judge_growth=census is None, explained=bool(routed)),
                *_unbounded_shapes(run, shapes), *_host_syncs(records, reads, run, in_experts),
                *_fallbacks(_outside(fallback_ops, routed), _fallback_sites(records))]
    notes = [*_run_shapes_notes(run), *_bounded_shapes(shapes, run, findings),
             *_logging_period(records, warmup), *_logging_reads(records, reads),
             *_between_steps(records, warmup, run), *_left_out(backend_gaps)]
    return {"steps": len(records), "compiles_per_step": [r["compiles"] for r in records],
            "compiles_between_steps": [r.get("compiles_between", 0) for r in records],
            "host_syncs_per_step": [r["host_syncs"] for r in records], "shapes": shapes,
            "run_shapes": None if run is None else run.as_dict(),
            "fallback_ops": fallback_ops, "backend_gaps_left_out": backend_gaps,
            "experts": [e.as_dict() for e in experts], "findings": findings, "notes": notes}


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


def _recompilation(records: list[dict], warmup: int, shapes: dict, judge_growth: bool,
                   explained: bool = False) -> list[dict]:
    """Compiles after warm-up for shapes already compiled (unless `explained`: by experts whose
    shapes follow the routing); and, when the run's batches could not be walked (`judge_growth`),
    shapes that kept coming in the steps watched."""
    late = [r for r in records[warmup:] if r["compiles"]]
    if not late:
        return []
    known = [r["step"] for r in late if r["step"] not in _steady_new_at(records)]
    count = sum(r["compiles"] for r in late)
    findings = []
    if known and not explained:
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


def _variant(records: list[dict], index: int) -> tuple[str, bool, bool]:
    """What the graphs of step `records[index]` are built for, besides the code: its batch
    shapes, and its place in the loop's logging period: a value read back in the step, and one
    in the step before. A loop that reads a running value on its logging steps and then resets
    it builds the graphs of the steps around the read apart from the others' (the reset is in
    them), once each, and runs them from the cache when the period comes round again."""
    record = records[index]
    return (shape_text(record["shapes"]), record["host_syncs"] > 0,
            index > 0 and records[index - 1]["host_syncs"] > 0)


def _steady_new_at(records: list[dict]) -> set[int]:
    """The steps that compiled a variant's graphs (_variant) for good: its first step, and its
    first after step 1. The first step's graphs also create the optimizer's state (AdamW's
    moments), so the variant of step 1 compiles again the next time it comes, and from then on
    runs from the cache."""
    seen: set[tuple] = set()
    steps = set()
    for index, record in enumerate(records):
        key = _variant(records, index)
        if record["step"] == 1 or key not in seen:
            steps.add(record["step"])
        if record["step"] > 1:
            seen.add(key)
    return steps


def period_compiles(records: list[dict], warmup: int) -> dict[int, int | None]:
    """The steps after warm-up that compiled graphs for batch shapes compiled before, because
    they stand elsewhere in the logging period (a variant's first step, _variant), each with the
    step where the same variant came round again (None: not in the steps watched). Such graphs
    are a bounded set, judged by the period: compiled once, then run from the cache."""
    variants = [_variant(records, index) for index in range(len(records))]
    found: dict[int, int | None] = {}
    for index in range(warmup, len(records)):
        record, variant, before = records[index], variants[index], variants[:index]
        if not (record["compiles"] and variant not in before and any(v[0] == variant[0] for v in before)):
            continue
        found[record["step"]] = next((records[later]["step"] for later in range(index + 1, len(records))
                                      if variants[later] == variant), None)
    return found


def period_unseen(records: list[dict], warmup: int) -> bool:
    """Whether a graph compiled for a new place in the logging period (period_compiles) has not
    come round again yet: more steps are needed to judge it."""
    return any(again is None for again in period_compiles(records, warmup).values())


def _logging_period(records: list[dict], warmup: int) -> list[str]:
    found = period_compiles(records, warmup)
    if not found:
        return []
    steps = sorted(found)
    again = sorted(a for a in found.values() if a is not None)
    unseen = [step for step in steps if found[step] is None]
    verdict = []
    if again:
        verdict.append(f"The same graphs came round again at step(s) {again} and ran from the graph "
                       "cache: a bounded set, judged by the logging period.")
    if unseen:
        verdict.append(f"Step(s) {unseen} did not come round again in the {len(records)} steps watched: "
                       "watch more --steps to see them run from the cache.")
    return [f"step(s) {steps} compiled graphs of their own after the warm-up, for batch shapes compiled "
            f"before: they stand next to a value read back on a logging step, and what the loop does "
            f"there (resetting a running value, say) makes a graph of its own. {' '.join(verdict)}"]


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
    if run.fix is not None:
        return run.fix
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
        return [*run.notes, f"the run's batches were not walked ahead ({run.skipped}): their shapes are "
                "judged from the steps watched only"]
    census = run.census
    if not census.lower_bound:
        return list(run.notes)
    return [*run.notes, f"the run's shape count ({len(census.shapes)}) is a lower bound: the walk over its "
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


def _between_steps(records: list[dict], warmup: int, run: RunShapes | None) -> list[str]:
    """Graphs compiled between steps (before each watched step, since the previous one), where
    the run builds graphs there by design (`between_steps`: GRPO's rollouts)."""
    if run is None or run.between_steps is None:
        return []
    between = [r.get("compiles_between", 0) for r in records]
    late = [r["step"] for r in records[warmup:] if r.get("compiles_between")]
    verdict = (f"none after the {warmup} warm-up step(s)" if not late else
               f"{sum(between[warmup:])} after the warm-up, before steps {late}")
    return [f"graphs compiled between steps, by {run.between_steps}: {between} ({verdict})"]


def _read_steps(records: list[dict]) -> list[int]:
    """The steps with a value read back to the host."""
    return [r["step"] for r in records if r["host_syncs"]]


def _on_logging_steps(records: list[dict]) -> bool:
    """Reads back on some steps only, never on two steps in a row: a loop's logging steps, which
    read a value kept on the device every few steps (as Gaudi's docs teach), not a per-step sync."""
    steps = _read_steps(records)
    return 0 < len(steps) < len(records) and all(b - a > 1 for a, b in zip(steps, steps[1:]))


def _logging_reads(records: list[dict], reads: HostReads) -> list[str]:
    if not _on_logging_steps(records):
        return []
    steps = _read_steps(records)
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    period = f"every {gaps.pop()} steps" if len(gaps) == 1 else "on logging steps"
    places = ", ".join(f"{_describe(site)} ({n}x)" for site, n in sorted(reads.where.items(), key=lambda i: str(i[0])))
    return [f"values read back to the host at steps {steps} of {len(records)} ({period}): {places}. A read "
            "on a logging step is not a per-step sync: the steps between run without waiting for the device"]


def _host_syncs(records: list[dict], reads: HostReads, run: RunShapes | None = None,
                in_experts: Mapping | None = None) -> list[dict]:
    per_step = [r["host_syncs"] for r in records]
    if not any(per_step) or _on_logging_steps(records):
        return []
    by_fix: dict[str, list[str]] = {}
    for site, n in sorted(reads.where.items(), key=lambda item: str(item[0])):
        fix = in_experts[site] if site in (in_experts or {}) else _known_fix(site, records, run)
        by_fix.setdefault(fix, []).append(f"{_describe(site)} ({n}x)")
    parts = [f"{', '.join(places)}: {fix}" for fix, places in by_fix.items()]
    return [{"kind": "host_sync", "message": (
        f"values read back to the host inside the step, {max(per_step)} per step. Each read cuts "
        f"the graph short and waits for the device. {' '.join(parts)}")}]


def _describe(site: SyncSite) -> str:
    if site.library is None:
        return f"{site.read} at {site.user}"
    return f"{site.read} in {site.library} ({site.function}), called from {site.user}"


_GRPO_MASK_READ = (
    "transformers reads the attention_mask in each training forward to see whether it can skip "
    "it. GRPO's rows are left-padded prompts followed by completions, so the mask matters and "
    "cannot be left out; the forward is hputrain's own GRPO step (methods/grpo/trainer.py hands the model "
    "the 2-D mask), not a line of your script: the fix is for hputrain to hand the model a 4-D "
    "mask built on the device, as its generation does, so that transformers builds none.")
_GENERIC_FIX = "keep values on the device and read them at logging steps."


def _known_fix(site: SyncSite, records: list[dict], run: RunShapes | None = None) -> str:
    """The concrete fix for a read whose cause is known, else the general advice."""
    if site.library and site.library.startswith("transformers/masking_utils.py"):
        layouts = {r["attention_mask"] for r in records}
        if run is not None and run.collator == "rollouts":
            return _GRPO_MASK_READ
        if layouts == {"all ones"}:
            return ("transformers reads the attention_mask each step to see whether it can skip "
                    "it, and the batches' attention_mask is all ones: leave attention_mask out of "
                    "the batches (the model then builds its causal mask without a read).")
        return ("transformers reads the attention_mask each step to see whether it can skip it. "
                "For a causal LM with padding on the right and labels -100 on it, the mask changes "
                "nothing (no real token attends to a later one): leave it out of the batches.")
    if site.library is None and site.read == "__bool__":
        return ("a Python branch on a tensor (`if loss > x:`) reads it back to decide: keep the "
                "decision on the device (torch.where, a mask multiplied in), or take it from "
                "values read at logging steps.")
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


def _outside(fallback_ops: dict[str, int], experts: list) -> dict[str, int]:
    """The eager ops less those that ran inside the experts' forward (their finding's)."""
    left = dict(fallback_ops)
    for seen in experts:
        for op, n in seen.fallbacks.items():
            left[op] = left.get(op, 0) - n
    return {op: n for op, n in left.items() if n > 0}


def _fallback_sites(records: list[dict]) -> dict[str, list[str]]:
    """op -> the user's lines that ran it eagerly, where the records say (a plain loop's)."""
    sites: dict[str, list[str]] = {}
    for record in records:
        for op, lines in record.get("fallback_sites", {}).items():
            sites.setdefault(op, []).extend(line for line in lines if line not in sites.get(op, []))
    return sites


def _fallbacks(fallback_ops: dict[str, int], sites: dict[str, list[str]]) -> list[dict]:
    if not fallback_ops:
        return []
    ops = ", ".join(f"{op} ({n}x{', at ' + ', '.join(sites[op]) if sites.get(op) else ''})"
                    for op, n in fallback_ops.items())
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


PADDING = {"fixed": "one fixed length", "longest row": "each batch to its longest row",
            "other": "to set lengths (buckets, multiples)", "unknown": "not shown by the batches"}
