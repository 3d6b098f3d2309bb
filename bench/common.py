"""What the benchmarks share: the built-in GPT set-up flags, the machine line (with the CPU flags
and measured matmul rates that decide bf16), bf16 only where it is native, and the median step time."""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from hputrain import Trainer, TrainingArguments
from hputrain.callbacks import Callback
from hputrain.data.batching import load_corpus
from hputrain.models.gpt import GPTConfig


def parser(doc: str, steps: int, repeats: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=10, help="first steps left out")
    p.add_argument("--repeats", type=int, default=repeats, help="interleaved repeats")
    p.add_argument("--size", default="tiny", help="GPT size: tiny, small, base")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--bf16", action="store_true")
    return p


def model_and_data(opts) -> tuple[GPTConfig, object]:
    """The GPT shape and the training windows (the first 4 MB of the standard library)."""
    config = GPTConfig.from_size(opts.size, block_size=opts.seq_len)
    data, _ = load_corpus(seq_len=opts.seq_len, max_bytes=4_000_000)
    return config, data


def machine(accelerator) -> str:
    """The device, versions and threads, and what decides bf16 here: whether it is native, the
    CPU flags, torch's CPU capability and the measured matmul rates (`hputrain env` shows the same)."""
    import platform

    def shown(value) -> str:
        if isinstance(value, dict):
            return ", ".join(f"{k} {v}" for k, v in value.items())
        return " ".join(value) if isinstance(value, list) else str(value)

    facts = accelerator.bf16_facts()
    details = "; ".join(f"{key} {shown(value)}" for key, value in facts.items() if key != "native_bf16")
    return (f"{accelerator.device_name()} ({accelerator.name}), torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, python {platform.python_version()}; native bf16 "
            f"{'yes' if facts['native_bf16'] else 'no'}" + (f" ({details})" if details else ""))


def bf16_where_native(accelerator, bf16: bool) -> bool:
    """`bf16`, unless the device only emulates it: then float32, saying so (emulated bf16 on a
    CPU without AVX512-BF16/AMX runs tens of times slower, and a benchmark would not finish)."""
    if bf16 and not accelerator.native_bf16():
        reason = accelerator.bf16_shortfall() or f"bf16 is not native on {accelerator.device_name()}"
        print(f"note: {reason}: running in fp32 instead")
        return False
    return bf16


def median_step(stamps: list[float], warmup: int) -> float:
    """Median time between consecutive step stamps, leaving out the first `warmup` steps."""
    return statistics.median(b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:]))


def print_table(accelerator, opts, runs: dict[str, list[float]], baseline: str, column: str) -> None:
    """The machine, the set-up, and a Markdown table of median step times relative to `baseline`
    (time ratio: below 1 is faster); then every repeat's figure."""
    base = statistics.median(runs[baseline])
    print(f"machine: {machine(accelerator)}")
    print(f"model: {opts.size} GPT, seq {opts.seq_len}, batch {opts.batch}, bf16={opts.bf16}, "
          f"{opts.steps} steps, first {opts.warmup} left out, {opts.repeats} interleaved repeats")
    print(f"| {column} | median step (ms) | time vs {baseline} |")
    print("|---|---|---|")
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e3:.2f} | {median / base:.3f}x |")
    print({name: [round(v * 1e3, 2) for v in values] for name, values in runs.items()})


class StepTimes(Callback):
    """Stamps the end of every optimizer step, once the device has finished it."""

    def __init__(self):
        self.stamps = []

    def on_step_end(self, trainer):
        trainer.accelerator.synchronize()
        self.stamps.append(time.perf_counter())


def trainer_step_time(model, data, opts, accelerator_config=None, output_dir=None, **training) -> float:
    """Median step time of `model` trained by hputrain's Trainer, timed by a callback's step hook.
    `output_dir` (a temporary one when None) must be shared by all ranks of a multi-process run."""
    times = StepTimes()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(output_dir=output_dir or scratch, max_steps=opts.steps,
                                 learning_rate=1e-3, logging_steps=10, save_steps=0,
                                 disable_tqdm=True, per_device_train_batch_size=opts.batch, **training)
        Trainer(model, args, train_dataset=data, accelerator_config=accelerator_config,
                callbacks=[times]).train()
    return median_step(times.stamps, opts.warmup)
