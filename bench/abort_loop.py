"""Run a multi-process command many times and keep the logs of every run that fails: the hunt for a
rank that dies now and then (issue 22: "rank 1 failed (exit code -6): Signal 6 (SIGABRT)", and
"terminate called without an active exception" at exit).

    python bench/abort_loop.py --runs 50 --out /tmp/abort            # the issue's 4-process fsdp run
    python bench/abort_loop.py --runs 50 --devices 2 --strategy ddp  # a 2-process variant
    python bench/abort_loop.py --runs 100 --probe --devices 2     # only how a worker ends (fast)
    python bench/abort_loop.py --runs 20 --cmd "python -m pytest -x -q tests/distributed/test_fsdp.py -k accumulation"

Each run gets a fresh output_dir (OUTPUT_DIR in --cmd is replaced by it), Python's faulthandler
(stacks of every thread on SIGABRT / SIGSEGV) and torch's C++ stack traces, and torchrun's per-rank
log files (PET_LOG_DIR, PET_TEE=3: each rank's stdout and stderr, as well as the console). A run
that exits non-zero, or whose output says a process aborted, keeps its folder OUT/run-NNN/
(launcher.out, launcher.err, logs/.../attempt_0/RANK/stderr.log); a clean run's folder is removed.
OUT/tally.jsonl gets one line per run; the tally is printed at the end. Not a benchmark: nothing is
timed but the wall time of each run, which is recorded to show the load the runs met.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: Text in a run's output that means some process aborted, whatever its exit code.
ABORT_MARKS = ("terminate called", "SIGABRT", "Fatal Python error", "Aborted", "core dumped")


def train_command(args) -> list[str]:
    """The issue's command (devices and strategy as asked), writing to OUTPUT_DIR."""
    return [sys.executable, "-m", "hputrain.cli", "train", "--cpu", "--no-bf16", "--logging-steps", "2",
            "--seed", "5", "--max-steps", "8", "--save-steps", "4", "--devices", str(args.devices),
            "--strategy", args.strategy, "--per-device-train-batch-size", "1", "--disable-tqdm",
            "--output-dir", "OUTPUT_DIR", *args.extra]


#: --probe: what a rank of `hputrain train` does last (save_model's agreement on the host group),
#: and nothing else, then it ends.
PROBE = """
from hputrain.distributed import ProcessGroup

group = ProcessGroup.from_env("gloo")
group.init(60, "cpu")
for _ in range(20):
    group.host_sum([1.0])
"""


def probe_command(args, out: Path) -> list[str]:
    script = out / "probe.py"
    script.write_text(PROBE)
    return [sys.executable, "-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node", str(args.devices),
            str(script)]


def one_run(command: list[str], folder: Path, timeout: float) -> dict:
    output_dir = folder / "output"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1", "TORCH_SHOW_CPP_STACKTRACES": "1",
           "PET_LOG_DIR": str(folder / "logs"), "PET_TEE": "3"}
    argv = [part.replace("OUTPUT_DIR", str(output_dir)) for part in command]
    start = time.monotonic()
    with open(folder / "launcher.out", "w") as out, open(folder / "launcher.err", "w") as err:
        try:
            code = subprocess.run(argv, stdout=out, stderr=err, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = round(time.monotonic() - start, 1)
    text = "".join(path.read_text(errors="replace") for path in folder.rglob("*")
                   if path.is_file() and path.suffix in (".out", ".err", ".log"))
    marks = sorted({mark for mark in ABORT_MARKS if mark in text})
    return {"exit": code, "seconds": seconds, "marks": marks, "argv": shlex.join(argv)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--out", default="/tmp/hputrain-abort-loop", help="where logs and the tally go")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--strategy", default="fsdp")
    p.add_argument("--cmd", help="run this shell-split command instead of `hputrain train`")
    p.add_argument("--probe", action="store_true", help="launch --devices processes that join the "
                   "group, sum a host value 20 times and end (see PROBE)")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a run counts as hung")
    p.add_argument("--keep-all", action="store_true", help="keep the folders of clean runs too")
    p.add_argument("extra", nargs="*", help="more flags for hputrain train (after --)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = (shlex.split(args.cmd) if args.cmd else probe_command(args, out) if args.probe
               else train_command(args))
    tally: dict[str, int] = {}
    for index in range(args.runs):
        folder = out / f"run-{index:03d}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        result = {"run": index, **one_run(command, folder, args.timeout)}
        failed = result["exit"] != 0 or result["marks"]
        key = f"exit {result['exit']}" + (f" ({', '.join(result['marks'])})" if result["marks"] else "")
        tally[key] = tally.get(key, 0) + 1
        with open(out / "tally.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"run {index}: {key}, {result['seconds']} s" + (f"; kept {folder}" if failed else ""), flush=True)
        if not failed and not args.keep_all:
            shutil.rmtree(folder)
    print(f"{args.runs} runs: " + ", ".join(f"{n} × {key}" for key, n in sorted(tally.items())))
    return 0 if set(tally) == {"exit 0"} else 1


if __name__ == "__main__":
    sys.exit(main())
