"""`hputrain doctor [--steps N] [--json] SCRIPT [ARGS]`: rehearse Gaudi's lazy mode on the CPU
(rehearsal/doctor/__init__.py) and print what it found."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from ..errors import InputError
from ..rehearsal.doctor import PADDING, run

DESCRIPTION = """`hputrain doctor SCRIPT [ARGS]`: a dry run of Gaudi's lazy mode on the CPU."""


def cmd_doctor(args) -> int:
    if args.steps < 1 or not 0 <= args.warmup < args.steps:
        raise InputError(f"need --steps >= 1 and 0 <= --warmup < --steps, got {args.steps} and {args.warmup}")
    with _stdout_to_stderr() if args.json else contextlib.nullcontext():
        report = run(args.script, args.script_args, args.steps, args.warmup)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"hputrain doctor: {report['steps']} steps of {args.script} in lazy mode on the CPU")
    print(f"  graph compilations per step: {report['compiles_per_step']}")
    print(f"  host syncs per step:         {report['host_syncs_per_step']}")
    print(f"  eager fallbacks:             {report['fallback_ops'] or 'none'}")
    if (walk := report["run_shapes"]) and "count" in walk:
        bound = "at least " if walk["lower_bound"] else ""
        print(f"  batch shapes in the run:     {bound}{walk['count']}: {walk['listing']}")
        print(f"    ({walk['walked']}, {walk['micro_batches']} micro-batches walked in "
              f"{walk['seconds']:.2f} s; padded: {PADDING[walk['padding']]})")
    for note in report["notes"]:
        print(f"  note: {note}")
    for finding in report["findings"]:
        print(f"- {finding['kind']}: {finding['message']}")
    if not report["findings"]:
        print("no problems found: the step reaches a steady state with cached graphs")
    return 0


@contextlib.contextmanager
def _stdout_to_stderr():
    """The script's own output to stderr while it runs, so that stdout holds the JSON report
    alone: its prints, and what is written to file descriptor 1 from below Python too."""
    with contextlib.ExitStack() as stack:
        sys.stdout.flush()
        try:
            out, err = sys.stdout.fileno(), sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):  # not a file (a test's capture): Python's prints only
            out = None
        if out is not None:
            saved = os.dup(out)
            os.dup2(err, out)
            stack.callback(os.close, saved)
            stack.callback(os.dup2, saved, out)
            stack.callback(sys.stdout.flush)
        stack.enter_context(contextlib.redirect_stdout(sys.stderr))
        yield


def add_doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="lazy-mode dry run on CPU: compiles per step, host syncs, fallbacks",
                       description=DESCRIPTION)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps to watch (default 6)")
    p.add_argument("--warmup", type=int, default=2,
                   help="first steps whose graph compilations are expected (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("script", help="a training script: hputrain's Trainer, a Hugging Face Trainer, or a "
                   "plain PyTorch loop written for Gaudi (habana_frameworks, the hpu device)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=cmd_doctor)
