"""`hputrain doctor SCRIPT [ARGS]`: a dry run of Gaudi's lazy mode on the CPU.

The user's script runs unmodified; every hputrain Trainer it makes is switched to lazy mode on
PyTorch's own lazy tensor backend (output to a temporary folder, no checkpoints), and each of the
first N optimizer steps is watched for what makes lazy mode slow on a Gaudi:

- recompilation: new graphs after warm-up, because shapes change from step to step;
- host_sync: values read back to the host inside a step (`.item()`, `bool(t)`, `.cpu()`, print),
  each of which cuts the graph short and stalls the device;
- fallback: operations the lazy backend cannot put in a graph, run eagerly instead.

The trainer's own reads (logging, evaluation) happen between steps and are not counted.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from . import execution
from .accelerators.cpu_lazy import HostReads, lazy_counters
from .config import TrainingArguments
from .errors import InputError

_PACKAGE = str(Path(__file__).parent)


class DoctorFinished(Exception):
    """Raised after the last watched step to stop the user's script."""


def _user_frame() -> str:
    """file:line of the innermost frame of the user's code (not torch's, not hputrain's)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not frame.filename.startswith(_PACKAGE) and f"{os.sep}torch{os.sep}" not in frame.filename:
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "?"


class DoctorWatch(execution.StepWatch):
    """Per step: new graph compilations, host reads, fallback ops, and the batch's shapes."""

    def __init__(self, steps: int, reads: HostReads) -> None:
        self.steps, self.reads = steps, reads
        self.records: list[dict] = []
        self._before: dict[str, int] = {}
        self._reads_before = 0

    def step_begin(self, step: int) -> None:
        self._before = lazy_counters()
        self._reads_before = self.reads.count
        self.reads.in_step = True

    def step_end(self, step: int, batch) -> None:
        self.reads.in_step = False
        after = lazy_counters()
        new = {k: v - self._before.get(k, 0) for k, v in after.items() if v != self._before.get(k, 0)}
        self.records.append({
            "step": step,
            "compiles": new.get("UncachedCompile", 0),
            "host_syncs": self.reads.count - self._reads_before,
            # aten:: counters are ops run eagerly; _local_scalar_dense is a read, counted above
            "fallbacks": {k[6:]: v for k, v in new.items()
                          if k.startswith("aten::") and k != "aten::_local_scalar_dense"},
            "shapes": _shapes(batch),
        })
        if len(self.records) >= self.steps:
            raise DoctorFinished


def _shapes(batch) -> dict:
    if isinstance(batch, dict):
        return {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    if isinstance(batch, (list, tuple)):
        return {str(i): list(v.shape) for i, v in enumerate(batch) if isinstance(v, torch.Tensor)}
    return {"batch": list(batch.shape)} if isinstance(batch, torch.Tensor) else {}


class DoctorSession(execution.Session):
    def __init__(self, steps: int, output_dir: str, reads: HostReads) -> None:
        self.steps, self.output_dir, self.reads = steps, output_dir, reads
        self.watches: list[DoctorWatch] = []

    def adjust(self, args: TrainingArguments) -> TrainingArguments:
        return dataclasses.replace(args, accelerator="cpu", execution_mode="lazy", torch_compile=False,
                                   use_graphs_for_training=False, output_dir=self.output_dir,
                                   save_steps=0, eval_steps=0, disable_tqdm=True,
                                   resume_from_checkpoint=None)

    def watch(self, args, accelerator) -> DoctorWatch:
        self.watches.append(DoctorWatch(self.steps, self.reads))
        return self.watches[-1]


def diagnose(records: list[dict], warmup: int, reads: HostReads) -> dict:
    """The report: per-step figures and findings, each naming the problem and the fix."""
    after = records[warmup:]
    findings = []
    late = sum(r["compiles"] for r in after)
    if late:
        shapes = sorted({json.dumps(r["shapes"], sort_keys=True) for r in records})
        findings.append({"kind": "recompilation", "message": (
            f"{late} new graph compilation(s) after the {warmup} warm-up step(s): the step's shapes "
            f"change from step to step (batch shapes seen: {', '.join(shapes)}). Each new shape "
            "compiles a new graph on Gaudi; pad or bucket sequence lengths to a few fixed sizes.")})
    syncs = [r["host_syncs"] for r in records]
    if any(syncs):
        where = ", ".join(f"{name} ({n}x)" for name, n in sorted(reads.where.items()))
        findings.append({"kind": "host_sync", "message": (
            f"values read back to the host inside the step: {max(syncs)} per step ({where}). Each read "
            "cuts the graph short and waits for the device; keep values on the device and read "
            "them at logging steps.")})
    fallback_ops: dict[str, int] = {}
    for record in records:
        for op, n in record["fallbacks"].items():
            fallback_ops[op] = fallback_ops.get(op, 0) + n
    if fallback_ops:
        ops = ", ".join(f"{op} ({n}x)" for op, n in sorted(fallback_ops.items()))
        findings.append({"kind": "fallback", "message": (
            f"operations that fell back to eager execution, outside the graph: {ops}. Replace "
            "them with graph-friendly ops (fixed-shape masks instead of nonzero or boolean "
            "indexing, for example).")})
    return {"steps": len(records), "compiles_per_step": [r["compiles"] for r in records],
            "host_syncs_per_step": syncs, "fallback_ops": fallback_ops, "findings": findings}


def run(script: str, script_args: list[str], steps: int, warmup: int) -> dict:
    path = Path(script)
    if not path.is_file():
        raise InputError(f"script {script} does not exist")
    os.environ["HPUTRAIN_ACCELERATOR"] = "cpu"
    reads = HostReads(locate=_user_frame)
    with tempfile.TemporaryDirectory(prefix="hputrain-doctor-") as output_dir:
        session = DoctorSession(steps, output_dir, reads)
        execution.install_session(session)
        saved_argv, sys.argv = sys.argv, [str(path), *script_args]
        sys.path.insert(0, str(path.resolve().parent))
        try:
            with reads:
                runpy.run_path(str(path), run_name="__main__")
        except DoctorFinished:
            pass
        finally:
            sys.argv = saved_argv
            sys.path.remove(str(path.resolve().parent))
            execution.install_session(None)
    records = [r for watch in session.watches for r in watch.records]
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
