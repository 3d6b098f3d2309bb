"""`hputrain doctor SCRIPT [ARGS]`: a dry run of Gaudi's lazy mode on the CPU.

The user's script runs unmodified; every hputrain Trainer it makes gets a `DoctorWatch` callback
(callbacks.added_to_every_trainer), which switches it to lazy mode on PyTorch's own lazy tensor
backend (output to a temporary folder, no checkpoints) and watches each of the first N optimizer
steps for what makes lazy mode slow on a Gaudi:

- recompilation: new graphs after warm-up, because the batch shapes keep growing (a bounded set,
  such as length buckets, is "N shapes, each compiled once": fine), or because something other
  than the shapes changes the graph;
- host_sync: values read back to the host inside a step (`.item()`, `bool(t)`, `.cpu()`, print),
  each of which cuts the graph short and stalls the device; named by the user's own line, and by
  the library's when the read is inside one, with the fix where one is known;
- fallback: operations that would run eagerly, outside the graph, on Gaudi too. The CPU lazy
  backend's own gaps (cpu_lazy.BACKEND_FALLBACKS) are left out, and the report says so.

The trainer's own reads (logging, evaluation) happen between steps and are not counted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import sys
import sysconfig
import tempfile
import traceback
from collections.abc import Mapping
from pathlib import Path

import torch

from .accelerators.cpu_lazy import BACKEND_FALLBACKS, HostReads, lazy_counters
from .callbacks import Callback, added_to_every_trainer
from .config import TrainingArguments
from .errors import InputError

_PACKAGE = str(Path(__file__).parent)


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
    then per step: new graph compilations, host reads, fallback ops, and the batch's shapes."""

    def __init__(self, steps: int, output_dir: str, reads: HostReads) -> None:
        self.steps, self.output_dir, self.reads = steps, output_dir, reads
        self.records: list[dict] = []
        self._before: dict[str, int] = {}
        self._reads_before = 0

    def adjust_args(self, args: TrainingArguments) -> TrainingArguments:
        return dataclasses.replace(args, accelerator="cpu", execution_mode="lazy", torch_compile=False,
                                   use_graphs_for_training=False, output_dir=self.output_dir,
                                   save_steps=0, eval_steps=0, disable_tqdm=True,
                                   resume_from_checkpoint=None, load_best_model_at_end=False,
                                   eval_strategy=None, save_strategy=None, logging_strategy=None)

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
            "shapes": _shapes(batch),
            "attention_mask": _mask_layout(batch),
        })
        if len(self.records) >= self.steps:
            raise DoctorFinished


def _shapes(batch) -> dict:
    if isinstance(batch, Mapping):
        return {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if isinstance(batch, (list, tuple)):
        return {str(i): list(v.shape) for i, v in enumerate(batch) if isinstance(v, torch.Tensor)}
    return {"batch": list(batch.shape)} if isinstance(batch, torch.Tensor) else {}


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

def diagnose(records: list[dict], warmup: int, reads: HostReads) -> dict:
    """The report: per-step figures, findings (each naming the problem and the fix) and notes
    (what was seen and is fine, and what was left out)."""
    shapes = _shape_history(records, warmup)
    fallback_ops, backend_gaps = _fallback_ops(records)
    findings = [*_recompilation(records, warmup, shapes), *_host_syncs(records, reads),
                *_fallbacks(fallback_ops)]
    notes = [*_bounded_shapes(records, shapes, findings), *_left_out(backend_gaps)]
    return {"steps": len(records), "compiles_per_step": [r["compiles"] for r in records],
            "host_syncs_per_step": [r["host_syncs"] for r in records], "shapes": shapes,
            "fallback_ops": fallback_ops, "backend_gaps_left_out": backend_gaps,
            "findings": findings, "notes": notes}


def _shape_history(records: list[dict], warmup: int) -> dict:
    """The distinct batch shapes, the steps that brought a new one, and whether new ones still
    came in the second half of the steps after warm-up (the set is still growing)."""
    seen: list[str] = []
    new_at = []
    for record in records:
        key = _shape_text(record["shapes"])
        if key not in seen:
            seen.append(key)
            new_at.append(record["step"])
    after = [r["step"] for r in records[warmup:]]
    tail = after[len(after) // 2:]
    return {"distinct": seen, "new_at_steps": new_at, "growing": any(s in tail for s in new_at[1:])}


def _shape_text(shapes: dict) -> str:
    """A batch's shapes: "[4, 32]" when all its tensors have that shape, else per tensor."""
    distinct = {json.dumps(shape) for shape in shapes.values()}
    if len(distinct) == 1:
        return distinct.pop()
    return "{" + ", ".join(f"{name}: {shape}" for name, shape in sorted(shapes.items())) + "}"


def _recompilation(records: list[dict], warmup: int, shapes: dict) -> list[dict]:
    late = [r for r in records[warmup:] if r["compiles"]]
    if not late:
        return []
    known = [r["step"] for r in late if r["step"] not in shapes["new_at_steps"]]
    count = sum(r["compiles"] for r in late)
    findings = []
    if known:
        findings.append({"kind": "recompilation", "message": (
            f"step(s) {known} compiled new graphs for batch shapes already compiled: something other "
            "than the shapes changes the graph from step to step, such as a Python number that "
            "changes every step (a step count, a random draw on the host) used in the forward, which "
            "the graph holds as a constant. Make it a tensor.")})
    if shapes["growing"]:
        findings.append({"kind": "recompilation", "message": (
            f"the batch shapes keep growing: {len(shapes['distinct'])} shapes in {len(records)} steps, "
            f"a new one at steps {shapes['new_at_steps']}, still after the warm-up, and each new shape "
            f"compiles new graphs ({count} after the {warmup} warm-up step(s)). Gaudi compiles the "
            "same way for every new shape; pad or bucket sequence lengths to a few fixed sizes "
            "(padding to a multiple of 64, say), so that the set stops growing. Batch shapes seen: "
            f"{', '.join(shapes['distinct'])}. (If your lengths do come from a small fixed set, "
            "watch more --steps to see each of them compiled once.)")})
    return findings


def _bounded_shapes(records: list[dict], shapes: dict, findings: list[dict]) -> list[str]:
    if len(shapes["distinct"]) < 2 or any(f["kind"] == "recompilation" for f in findings):
        return []
    return [f"{len(shapes['distinct'])} batch shapes, each compiled once (new at steps "
            f"{shapes['new_at_steps']}, none in the last steps): a bounded set, such as length "
            "buckets, is fine: after its first step each shape runs from the graph cache. Shapes: "
            f"{', '.join(shapes['distinct'])}"]


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
    return diagnose(records, warmup, reads)


def cmd_doctor(args) -> int:
    if args.steps < 1 or not 0 <= args.warmup < args.steps:
        raise InputError(f"need --steps >= 1 and 0 <= --warmup < --steps, got {args.steps} and {args.warmup}")
    report = run(args.script, args.script_args, args.steps, args.warmup)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"hputrain doctor: {report['steps']} steps of {args.script} in lazy mode on the CPU")
    print(f"  graph compilations per step: {report['compiles_per_step']}")
    print(f"  host syncs per step:         {report['host_syncs_per_step']}")
    print(f"  eager fallbacks:             {report['fallback_ops'] or 'none'}")
    for note in report["notes"]:
        print(f"  note: {note}")
    for finding in report["findings"]:
        print(f"- {finding['kind']}: {finding['message']}")
    if not report["findings"]:
        print("no problems found: the step reaches a steady state with cached graphs")
    return 0


def add_doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="lazy-mode dry run on CPU: compiles per step, host syncs, fallbacks",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="optimizer steps to watch (default 6)")
    p.add_argument("--warmup", type=int, default=2,
                   help="first steps whose graph compilations are expected (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("script", help="a Python script that trains with hputrain's Trainer")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=cmd_doctor)
