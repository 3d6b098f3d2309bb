"""fp8 training: step time and memory of the built-in GPT in bf16, fp8, and fp8 + minimize_memory.

Each run is a fresh process (so that its peak memory is its own), repeated and interleaved; the
table gives median step times after warm-up, the bytes one forward pass keeps for backward
(telemetry.SavedForBackward: each storage once, parameters left out), and the device's peak memory (peak RSS on a
CPU, torch.cuda.max_memory_allocated on a GPU).

    python bench/fp8.py [--size small] [--seq-len 256] [--batch 8] [--steps 20] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

import torch

from hputrain import Trainer, TrainingArguments
from hputrain.accelerators import detect_accelerator
from hputrain.models.gpt import GPT
from hputrain.data.batching import to_device
from hputrain.training.telemetry import SavedForBackward

from common import StepTimes, bf16_where_native, machine, median_step, model_and_data, parser

SETTINGS = {
    "bf16": {"bf16": True},
    "fp8": {"fp8": True},
    "fp8 + minimize_memory": {"fp8": True, "minimize_memory": True},
}


def saved_bytes(trainer, batch) -> int:
    """Bytes one training forward pass keeps for backward (storages once, parameters left out)."""
    with SavedForBackward() as saved:
        trainer._loss(to_device(batch, trainer.device))
    return saved.nbytes


def one_run(opts, setting: str) -> dict:
    """Train with `setting` in this process; its step time and memory."""
    config, data = model_and_data(opts)
    times = StepTimes()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(output_dir=scratch, max_steps=opts.steps, learning_rate=1e-3,
                                 logging_steps=10, save_steps=0, disable_tqdm=True,
                                 per_device_train_batch_size=opts.batch, **SETTINGS[setting])
        trainer = Trainer(GPT(config), args, train_dataset=data, callbacks=[times])
        trainer.train()
    peak = trainer.accelerator.memory_stats()["max_memory_allocated_gb"]
    batch = trainer.collate([data[i] for i in range(opts.batch)])
    return {"step_s": median_step(times.stamps, opts.warmup), "peak_gb": peak,
            "saved_bytes": saved_bytes(trainer, batch), "fp8_layers": len(getattr(trainer.precision, "layers", []))}


def main() -> None:
    p = parser(__doc__, steps=20, repeats=3)
    p.set_defaults(size="small", batch=8, warmup=5)
    p.add_argument("--one", choices=list(SETTINGS), help=argparse.SUPPRESS)  # a child run
    opts = p.parse_args()
    if opts.one:
        print(json.dumps(one_run(opts, opts.one)))
        return
    accelerator = detect_accelerator()
    if not bf16_where_native(accelerator, True):  # fp8 runs its other layers in bf16
        print("fp8 runs the layers it does not convert in bf16, which this device only emulates: "
              "nothing comparable to measure here")
        return
    runs = {name: [] for name in SETTINGS}
    for _ in range(opts.repeats):
        for name in SETTINGS:
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", name], check=True,
                                 capture_output=True, text=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    print(f"machine: {machine(accelerator)}")
    print(f"model: {opts.size} GPT, seq {opts.seq_len}, batch {opts.batch}, {opts.steps} steps, first "
          f"{opts.warmup} left out, {opts.repeats} interleaved repeats (one process each)")
    base = runs["bf16"]
    base_step = statistics.median(r["step_s"] for r in base)
    base_saved = base[0]["saved_bytes"]
    print("| precision | fp8 layers | median step (ms) | time vs bf16 | saved for backward (MiB) | vs bf16 "
          "| peak memory (GiB, median) |")
    print("|---|---|---|---|---|---|---|")
    for name, values in runs.items():
        step = statistics.median(r["step_s"] for r in values)
        saved = values[0]["saved_bytes"]
        peak = statistics.median(r["peak_gb"] for r in values)
        print(f"| {name} | {values[0]['fp8_layers']} | {step * 1e3:.1f} | {step / base_step:.2f}x | "
              f"{saved / 2**20:.1f} | {saved / base_saved:.3f} | {peak:.3f} |")
    print({name: [round(r["step_s"] * 1e3, 1) for r in values] for name, values in runs.items()})


if __name__ == "__main__":
    main()
