"""SIGTERM to a real two-process `hputrain train`, again and again, at a moment that moves from run
to run: as a user stops a job. Each run must exit 143 (as a shell reports it: 128 + SIGTERM, also
for a process the signal ended) and leave exactly one whole checkpoint, with no rank crashing (no
traceback, no Gloo error) and none hanging. Every run's output (stdout and stderr of the launch:
every rank's lines) is kept in OUT/run-NN/.

    python bench/stop_loop.py [--runs 20] [--first 8] [--last 25] [--since launch|training]
                              [--out DIR] [--timeout 120]

The n-th SIGTERM goes to the launcher `first + (last - first) * n / (runs - 1)` seconds after the
launch started (--since training: after rank 0 printed its header line, just before train(); on
a loaded machine start-up alone can take longer than 25 s). A signal that lands before training
began finds nothing to save: such a run must exit 143 with no checkpoint and no crash, and is
counted apart. Prints one line per run and the tally; exits 1 if any run failed.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = ["train", "--cpu", "--devices", "2", "--max-steps", "100000", "--logging-steps", "10",
           "--save-steps", "100000", "--per-device-train-batch-size", "4"]
CRASHES = ("Traceback", "terminate called", "EnforceNotMet", "gloo::", "Timed out", "Connection closed",
           "Segmentation fault", "core dumped")
HEADER = "hputrain: tiny GPT"  # rank 0's line just before trainer.train()


def one_run(folder: Path, delay: float, timeout: float, since_training: bool) -> dict:
    folder.mkdir(parents=True)
    out = folder / "output"
    stdout, stderr = open(folder / "stdout.log", "w"), open(folder / "stderr.log", "w")
    hputrain = [sys.executable, "-m", "hputrain.cli"]
    start = time.monotonic()
    proc = subprocess.Popen([*hputrain, *COMMAND, "--output-dir", str(out)], stdout=stdout, stderr=stderr,
                            cwd=ROOT, start_new_session=True)
    header_at = None  # seconds from the start to rank 0's header line

    def watch_header() -> None:
        nonlocal header_at
        if header_at is None and HEADER in (folder / "stdout.log").read_text(errors="replace"):
            header_at = time.monotonic() - start
        time.sleep(0.05)

    while since_training and header_at is None and proc.poll() is None:
        watch_header()
    signal_at = start + delay + (header_at or 0.0 if since_training else 0.0)
    while time.monotonic() < signal_at:
        watch_header()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout)
        hung = False
    except subprocess.TimeoutExpired:  # a hang: end the whole session, keep the logs
        os.killpg(proc.pid, signal.SIGKILL)
        code, hung = proc.wait(), True
    stdout.close(), stderr.close()
    if code < 0:
        code = 128 - code  # killed by the signal (nothing caught it yet): the shell says 128 + N too
    text = (folder / "stdout.log").read_text(errors="replace") + (folder / "stderr.log").read_text(errors="replace")
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*")) if out.is_dir() else []
    whole = all((out / name / "rng_state_1.pt").exists() and (out / name / "trainer_state.json").exists()
                for name in checkpoints)
    stop = re.search(r"signal 15 received: saving a checkpoint at step (\d+)", text)
    return {"delay": delay, "header_at": header_at, "seconds": time.monotonic() - start, "exit": code, "hung": hung,
            "training": header_at is not None, "checkpoints": checkpoints, "whole": whole,
            "stop_step": int(stop.group(1)) if stop else None,
            "crashes": [word for word in CRASHES if word in text]}


def verdict(run: dict) -> str:
    """'ok', 'ok (start-up)' or what went wrong."""
    problems = []
    if run["hung"]:
        problems.append("hung")
    if run["exit"] != 143:
        problems.append(f"exit {run['exit']}")
    if run["crashes"]:
        problems.append("crash: " + ", ".join(run["crashes"]))
    wanted = 1 if run["training"] else 0  # before training there is nothing to save
    if len(run["checkpoints"]) != wanted or not run["whole"]:
        problems.append(f"checkpoints {run['checkpoints']}{'' if run['whole'] else ' (not whole)'}")
    if problems:
        return "FAILED: " + "; ".join(problems)
    return "ok" if run["training"] else "ok (start-up: signalled before training began)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--first", type=float, default=8.0, help="seconds after the start of the first signal")
    p.add_argument("--last", type=float, default=25.0, help="seconds after the start of the last signal")
    p.add_argument("--since", choices=["launch", "training"], default="launch",
                   help="count the delay from the launch (as a user does) or from the start of training")
    p.add_argument("--out", help="where the runs' folders go (default: a new temporary folder)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a run may take to end after SIGTERM")
    opts = p.parse_args()
    out = Path(opts.out or tempfile.mkdtemp(prefix="stop_loop-"))
    print(f"hputrain {' '.join(COMMAND)} --output-dir {out}/run-NN/output, SIGTERM to the launcher "
          f"{opts.first:g}-{opts.last:g} s after the {opts.since} began; logs in {out}", flush=True)
    tally = {"ok": 0, "start-up": 0, "failed": 0}
    for n in range(opts.runs):
        delay = opts.first + (opts.last - opts.first) * n / max(opts.runs - 1, 1)
        run = one_run(out / f"run-{n:02d}", delay, opts.timeout, opts.since == "training")
        result = verdict(run)
        tally["failed" if result.startswith("FAILED") else "start-up" if "start-up" in result else "ok"] += 1
        started = "never" if run["header_at"] is None else f"{run['header_at']:.1f} s"
        print(f"run {n:02d}: SIGTERM at {delay:5.1f} s (training began at {started}), exit {run['exit']}, checkpoints {run['checkpoints']}, "
              f"{run['seconds']:.1f} s: {result}", flush=True)
    print(f"{tally['ok'] + tally['start-up']} of {opts.runs} exited 143 as they should: {tally['ok']} with exactly "
          f"one checkpoint, {tally['start-up']} signalled during start-up (none); {tally['failed']} failed")
    return 1 if tally["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
