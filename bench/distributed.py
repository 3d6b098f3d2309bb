"""Data parallelism on CPU processes (gloo): one process vs two with ddp and with fast_ddp, the
built-in GPT, the same batch per process (weak scaling: one core per process on a 2-core machine);
interleaved repeats, median step time after warm-up, tokens/s of the whole job.

    python bench/distributed.py [--steps 40] [--warmup 10] [--repeats 3] [--batch 16]
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hputrain.accelerators import detect_accelerator
from hputrain.models.gpt import GPT

from common import machine, model_and_data, parser, trainer_step_time

HERE = Path(__file__).parent


def worker(opts) -> None:
    """One process of a run: train, then rank 0 writes its median step time."""
    config, data = model_and_data(opts)
    seconds = trainer_step_time(GPT(config), data, opts, output_dir=os.path.dirname(opts.result),
                                strategy=opts.strategy, accelerator="cpu")
    if int(os.environ.get("RANK", "0")) == 0:
        Path(opts.result).write_text(json.dumps(seconds))


def run(opts, processes: int, strategy: str, threads: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        args = [str(HERE / "distributed.py"), "--worker", "--strategy", strategy, "--result", result,
                "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--batch", str(opts.batch),
                "--seq-len", str(opts.seq_len), "--size", opts.size]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(HERE)}
        if processes == 1:
            command = [sys.executable, *args]
        else:
            command = [sys.executable, "-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node",
                       str(processes), *args]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(Path(result).read_text())


RUNS = {  # name: (processes, strategy, threads per process)
    "1 process, 1 thread": (1, "single", 1),
    "1 process, 2 threads": (1, "single", 2),
    "2 processes, ddp": (2, "ddp", 1),
    "2 processes, fast_ddp": (2, "fast_ddp", 1),
}


def main() -> None:
    p = parser(__doc__, steps=40, repeats=3)
    p.add_argument("--worker", action="store_true", help=argparse_hidden())
    p.add_argument("--strategy", default="single", help=argparse_hidden())
    p.add_argument("--result", help=argparse_hidden())
    opts = p.parse_args()
    if opts.worker:
        return worker(opts)
    times = {name: [] for name in RUNS}
    for _ in range(opts.repeats):
        for name, (processes, strategy, threads) in RUNS.items():
            times[name].append(run(opts, processes, strategy, threads))
    tokens = opts.batch * opts.seq_len
    base = statistics.median(times["1 process, 1 thread"])
    print(f"machine: {machine(detect_accelerator('cpu'))}, {os.cpu_count()} cores")
    print(f"model: {opts.size} GPT, seq {opts.seq_len}, batch {opts.batch} per process, {opts.steps} steps, "
          f"first {opts.warmup} left out, {opts.repeats} interleaved repeats")
    print("| run | median step (ms) | tokens/s (job) | throughput vs 1 process, 1 thread |")
    print("|---|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        processes = RUNS[name][0]
        print(f"| {name} | {median * 1e3:.1f} | {processes * tokens / median:,.0f} | "
              f"{processes * base / median:.2f}x |")
    print({name: [round(v * 1e3, 1) for v in values] for name, values in times.items()})


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
