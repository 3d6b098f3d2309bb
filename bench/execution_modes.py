"""Execution modes: eager vs compile (torch.compile, inductor) vs lazy (torch._lazy on the CPU) step
time for the built-in GPT, interleaved repeats, median step time after warm-up.

Steps are timed by the trainer's own step hook (execution.StepWatch), so set-up, compilation
before the first step ends, and the end of the run do not count.

    python bench/execution_modes.py [--modes eager compile lazy] [--steps 40] [--warmup 10] [--repeats 3] [--bf16]
"""
from __future__ import annotations

import tempfile
import time

import torch

from hputrain import Trainer, TrainingArguments, execution
from hputrain.accelerators import detect_accelerator
from hputrain.models.gpt import GPT

from common import median_step, model_and_data, parser, print_table


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
    return median_step(session.watches[-1].stamps, opts.warmup)


def main() -> None:
    p = parser(__doc__, steps=40, repeats=3)
    p.add_argument("--modes", nargs="+", default=["eager", "compile", "lazy"])
    opts = p.parse_args()
    accelerator = detect_accelerator()
    config, data = model_and_data(opts)
    times = {mode: [] for mode in opts.modes}
    for _ in range(opts.repeats):
        for mode in opts.modes:
            times[mode].append(run(mode, opts, data, config))
    print_table(accelerator, opts, times, baseline=opts.modes[0], column="mode")

if __name__ == "__main__":
    main()
