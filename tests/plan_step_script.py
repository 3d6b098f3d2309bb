"""One rank of a measured training step for tests/rehearsal/plan/test_plan_accuracy.py, started by `hputrain
launch`: a 3-step run of hputrain's Trainer (DPOTrainer for a DPO step) on the run `hputrain train
FLAGS` describes (random weights, one repeated batch), whose third step rehearsal.plan.StepPeak
counts (rehearsal/plan/measure.py). Rank 0 writes {"peak_bytes", "breakdown"} to RESULT.

    plan_step_script.py RESULT FLAG...
"""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hputrain.cli import build_parser  # noqa: E402
from hputrain.cli.planning import planned_step  # noqa: E402
from hputrain.rehearsal.plan.measure import measure_step  # noqa: E402


def settings(flags: list[str]):
    """(StepModel, TrainingArguments) of `hputrain plan FLAGS` (train's flags): the step the run
    takes (DPO's on preference pairs)."""
    return planned_step(vars(build_parser().parse_args(["plan", *flags])))


def measure(flags: list[str], output_dir: str):
    """The third step's StepPeak trace on this rank (every rank takes part)."""
    step, args = settings(flags)
    return measure_step(step, args, output_dir)


def planned(flags: list[str]):
    """The plan's trace of that step, in this process, for this machine (the cpu target)."""
    from hputrain.accelerators import detect_accelerator
    from hputrain.rehearsal.plan import trace_step

    step, args = settings(flags)
    return trace_step(step, args, detect_accelerator("cpu", "eager"))


def measured(flags: list[str]):
    """The same step measured in a real run, in this process (one rank)."""
    with tempfile.TemporaryDirectory() as out:
        return measure(flags, out)[0]


def main(argv: list[str]) -> None:
    result, flags = argv[0], argv[1:]
    with tempfile.TemporaryDirectory() as out:
        trace, main_rank = measure(flags, out)
    if main_rank:
        with open(result, "w") as f:
            json.dump({"peak_bytes": trace.peak_bytes, "breakdown": trace.breakdown}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
