"""Each rank of the 2-process combination cases: `hputrain launch --nproc-per-node 2 THIS PLAN`
runs the plan's `hputrain train` argument lists one after the other in the same two processes, so
that the interpreter, torch and transformers start once for all of them (on 2 cores, starting a
run's processes costs ten times its two steps). Each run is `hputrain.cli.main(["train", ...])`
as a launched rank calls it: the flags are the user's (--devices 2 --strategy ...).

For every run, each rank appends a line to PLAN.rankR.jsonl when it starts and when it ends
(status, seconds), with its output in NAME.rankR.log next to the run's output folder. A run that
does not end with 0 on a rank ends this process with that status: the launcher then stops the
other rank, and the test starts the runs left in new processes (tests/test_combinations.py)."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path


def _note(progress: Path, **record) -> None:
    with open(progress, "a") as f:
        f.write(json.dumps(record) + "\n")


def run_one(run: dict, rank: int, progress: Path) -> int | str:
    from hputrain.cli import main

    _note(progress, name=run["name"], event="start", time=time.time())
    out = Path(run["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"{out.name}.rank{rank}.log"
    start, status = time.perf_counter(), None
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            status = main(["train", *run["argv"], "--output-dir", run["out"]])
        except BaseException as exc:  # noqa: BLE001  (the run's outcome, SystemExit included)
            status = f"raised {type(exc).__name__}"
            traceback.print_exc()
    _note(progress, name=run["name"], event="end", status=status,
          seconds=time.perf_counter() - start)
    return status


def main(plan_path: str) -> int:
    rank = int(os.environ["RANK"])
    plan = json.loads(Path(plan_path).read_text())
    progress = Path(f"{plan_path}.rank{rank}.jsonl")
    for run in plan:
        status = run_one(run, rank, progress)
        if status != 0:
            return status if isinstance(status, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
