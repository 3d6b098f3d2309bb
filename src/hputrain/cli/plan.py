"""`hputrain plan [train's flags] --target NAME [--json]`: will one training step fit on the
target device? The step traced on fake tensors at the asked rank count (rehearsal/plan/__init__.py): the
peak memory per rank by category, and the cheapest changes that make it fit.

The run is described exactly as `hputrain train` takes it (the built-in GPT, or `--model DIR`,
where a folder holding only config.json is enough: no weight is read); `--dataset` is not read.
"""
from __future__ import annotations

import json

from ..errors import InputError, did_you_mean
from .planning import plan_run
from .train import add_train_flags

GIB = 2**30


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="will it fit? one training step traced on fake tensors: the "
                                    "peak memory per rank against a device's",
                       description=__doc__.split("\n\n")[0],
                       usage="hputrain plan [train's FLAGS] --target NAME [--json]")
    p.add_argument("--target", default="cpu",
                   help="the device planned for: gaudi2, gaudi3, h100, h200, a100, or cpu (this "
                        "machine's memory; the default)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_train_flags(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from ..accelerators.registry import target_memory

    targets = target_memory()
    if args.target not in targets:
        raise InputError(f"--target {args.target!r} is not one hputrain plans for: "
                         f"{', '.join(targets)}{did_you_mean(args.target, targets)}")
    result, name = plan_run(vars(args), args.target, targets[args.target])
    print(json.dumps(result.as_json(), indent=2) if args.json else describe(result, name))
    return 0


def describe(result, name: str = "") -> str:
    """The plan for people: the peak and its parts, whether it fits, what would make it fit."""
    def gib(n: int) -> str:
        return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / 2**20:,.1f} MiB"

    verdict = "fits" if result.fits else "does NOT fit"
    lines = [f"hputrain plan: one training step per rank ({result.ranks} rank"
             f"{'s' if result.ranks > 1 else ''}){': ' + name if name else ''}",
             f"  peak {gib(result.peak_bytes)} of {result.target}'s {gib(result.target_bytes)}: "
             f"{verdict}"]
    if getattr(result, "moe", None) is not None:
        lines.insert(1, f"  {result.moe.describe()}")
    if getattr(result, "vision", None) is not None:
        lines.insert(1, f"  {result.vision.describe()}")
    for category, value in result.breakdown.items():
        lines.append(f"    {category:<12} {gib(value):>14}")
    for suggestion in result.suggestions:
        mark = "fits" if suggestion["fits"] else "still too big"
        lines.append(f"  {suggestion['change']}: peak {gib(suggestion['peak_bytes'])} ({mark}): "
                     f"{' '.join(suggestion['flags'])}")
    lines.append(f"  (traced on fake tensors in {result.seconds:.1f} s)")
    return "\n".join(lines)

