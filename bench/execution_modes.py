"""Execution modes: eager vs compile (torch.compile, inductor) vs lazy (torch._lazy on the CPU) step
time for the built-in GPT, interleaved repeats, median step time after warm-up.

Steps are timed by a callback's on_step_end (common.StepTimes), so set-up, compilation
before the first step ends, and the end of the run do not count.

    python bench/execution_modes.py [--modes eager compile lazy] [--steps 40] [--warmup 10] [--repeats 3] [--bf16]
"""
from __future__ import annotations


from hputrain.accelerators import detect_accelerator
from hputrain.models.gpt import GPT

from common import bf16_where_native, model_and_data, parser, print_table, trainer_step_time


def run(mode, opts, data, config) -> float:
    return trainer_step_time(GPT(config), data, opts, execution_mode=mode, bf16=opts.bf16)


def main() -> None:
    p = parser(__doc__, steps=40, repeats=3)
    p.add_argument("--modes", nargs="+", default=["eager", "compile", "lazy"])
    opts = p.parse_args()
    accelerator = detect_accelerator()
    opts.bf16 = bf16_where_native(accelerator, opts.bf16)
    config, data = model_and_data(opts)
    times = {mode: [] for mode in opts.modes}
    for _ in range(opts.repeats):
        for mode in opts.modes:
            times[mode].append(run(mode, opts, data, config))
    print_table(accelerator, opts, times, baseline=opts.modes[0], column="mode")

if __name__ == "__main__":
    main()
