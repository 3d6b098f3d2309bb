"""Execution modes: eager vs compile (torch.compile, inductor) vs lazy (torch._lazy on the CPU) step
time for the built-in GPT, interleaved repeats, median step time after warm-up.

Steps are timed by the trainer's own step hook (execution.StepWatch), so set-up, compilation
before the first step ends, and the end of the run do not count.

    python bench/execution_modes.py [--modes eager compile lazy] [--steps 40] [--warmup 10] [--repeats 3] [--bf16]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from hputrain import Trainer, TrainingArguments, execution
from hputrain.accelerators import detect_accelerator
from hputrain.data import load_corpus
from hputrain.models.gpt import GPT, GPTConfig


class StepTimes(execution.StepWatch):
    def __init__(self, synchronize):
        self.synchronize, self.stamps = synchronize, []

    def step_end(self, step, batch):
        self.synchronize()
        self.stamps.append(time.perf_counter())


class Timing(execution.Session):
    def __init__(self):
        self.watches = []

    def watch(self, args, accelerator):
        self.watches.append(StepTimes(accelerator.synchronize))
        return self.watches[-1]


def run(mode, opts, data, config) -> float:
    session = Timing()
    execution.install_session(session)
    try:
        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(output_dir=out, max_steps=opts.steps, learning_rate=1e-3,
                                     logging_steps=10, save_steps=0, disable_tqdm=True, bf16=opts.bf16,
                                     per_device_train_batch_size=opts.batch, execution_mode=mode)
            Trainer(GPT(config), args, train_dataset=data).train()
    finally:
        execution.install_session(None)
    stamps = session.watches[-1].stamps
    return statistics.median(b - a for a, b in zip(stamps[opts.warmup:], stamps[opts.warmup + 1:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=["eager", "compile", "lazy"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--size", default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--bf16", action="store_true")
    opts = p.parse_args()
    accelerator = detect_accelerator()
    config = GPTConfig.from_size(opts.size, block_size=opts.seq_len)
    data, _ = load_corpus(seq_len=opts.seq_len, max_bytes=4_000_000)
    times = {mode: [] for mode in opts.modes}
    for _ in range(opts.repeats):
        for mode in opts.modes:
            times[mode].append(run(mode, opts, data, config))
    eager = statistics.median(times["eager"]) if "eager" in times else None
    print(f"machine: {accelerator.device_name()} ({accelerator.name}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"model: {opts.size} GPT, seq {opts.seq_len}, batch {opts.batch}, bf16={opts.bf16}, "
          f"{opts.steps} steps, first {opts.warmup} left out, {opts.repeats} interleaved repeats")
    print("| mode | median step (ms) | speed vs eager |")
    print("|---|---|---|")
    for mode, values in times.items():
        median = statistics.median(values)
        ratio = f"{eager / median:.2f}x" if eager else "-"
        print(f"| {mode} | {median * 1e3:.1f} | {ratio} |")
    print({mode: [round(v * 1e3, 1) for v in values] for mode, values in times.items()})


if __name__ == "__main__":
    main()
