"""How close `hputrain plan` comes: the plan of one training step (traced on fake tensors) against
the same step measured in a real run of hputrain's Trainer on this CPU.

The measurement: the run's third step (the optimizer's states exist, as the plan assumes, and
DistributedDataParallel has rebuilt its buckets, which it does in the second step's forward) with
rehearsal.plan.StepPeak, which counts every live tensor by kind with torch.distributed._tools'
MemTracker (FSDPMemTracker under fsdp) around the Trainer's real step, and adds ddp's gradient
buckets from DistributedDataParallel's own account of them. Two-process cases are started with
`hputrain launch --cpu --nproc-per-node 2`; rank 0's figure is reported.

Cases: the built-in GPT and a Hugging Face Llama (built from a config, random weights), fp32 and
bf16, with and without gradient checkpointing and LoRA, 1 process, and 2 processes under ddp and
fsdp; and DPO steps on preference pairs (`--method dpo`, as the columns prompt / chosen /
rejected pick it; DPOTrainer measured, rehearsal/plan/measure.py) with each reference: a frozen
copy, --ref-model, the adapter-disabled base under LoRA, precomputed log-probs.

    python bench/plan_accuracy.py [--cases NAME,...] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

FP32, BF16 = ["--precision", "fp32"], ["--precision", "bf16-mixed"]
GPT = ["--model-size", "small", "--seq-len", "256"]
LLAMA = ["--model", "{llama}", "--block-size", "256"]
DPO = ["--method", "dpo"]  # what the columns prompt, chosen, rejected pick
CASES = {
    # name: (flags of `hputrain train`, processes)
    "gpt fp32": ([*GPT, "--per-device-train-batch-size", "8", *FP32], 1),
    "gpt fp32 checkpointing": ([*GPT, "--per-device-train-batch-size", "8", *FP32,
                                "--gradient-checkpointing"], 1),
    "gpt bf16": ([*GPT, "--per-device-train-batch-size", "8", *BF16], 1),
    "llama fp32": ([*LLAMA, "--per-device-train-batch-size", "4", *FP32], 1),
    "llama fp32 checkpointing": ([*LLAMA, "--per-device-train-batch-size", "4", *FP32,
                                  "--gradient-checkpointing"], 1),
    "llama bf16": ([*LLAMA, "--per-device-train-batch-size", "4", *BF16], 1),
    "llama bf16 checkpointing": ([*LLAMA, "--per-device-train-batch-size", "4", *BF16,
                                  "--gradient-checkpointing"], 1),
    "llama LoRA fp32": ([*LLAMA, "--per-device-train-batch-size", "4", *FP32, "--lora-r", "8"], 1),
    "llama LoRA fp32 checkpointing": ([*LLAMA, "--per-device-train-batch-size", "4", *FP32,
                                       "--lora-r", "8", "--gradient-checkpointing"], 1),
    "gpt ddp 2 processes fp32": ([*GPT, "--per-device-train-batch-size", "4", *FP32,
                                  "--strategy", "ddp"], 2),
    "gpt fsdp 2 processes fp32": ([*GPT, "--per-device-train-batch-size", "4", *FP32,
                                   "--strategy", "fsdp"], 2),
    "llama ddp 2 processes bf16": ([*LLAMA, "--per-device-train-batch-size", "2", *BF16,
                                    "--strategy", "ddp"], 2),
    "llama fsdp 2 processes fp32": ([*LLAMA, "--per-device-train-batch-size", "2", *FP32,
                                     "--strategy", "fsdp"], 2),
    "llama fsdp 2 processes bf16 checkpointing": ([*LLAMA, "--per-device-train-batch-size", "2",
                                                   *BF16, "--strategy", "fsdp",
                                                   "--gradient-checkpointing"], 2),
    "llama fsdp 2 processes LoRA fp32": ([*LLAMA, "--per-device-train-batch-size", "2", *FP32,
                                          "--strategy", "fsdp", "--lora-r", "8"], 2),
    "llama ddp 2 processes LoRA bf16 checkpointing": ([*LLAMA, "--per-device-train-batch-size",
                                                       "2", *BF16, "--strategy", "ddp",
                                                       "--lora-r", "8",
                                                       "--gradient-checkpointing"], 2),
    "llama DPO frozen copy fp32": ([*LLAMA, *DPO, "--per-device-train-batch-size", "2", *FP32], 1),
    "llama DPO frozen copy bf16 checkpointing": ([*LLAMA, *DPO, "--per-device-train-batch-size",
                                                  "2", *BF16, "--gradient-checkpointing"], 1),
    "llama DPO --ref-model bf16": ([*LLAMA, *DPO, "--per-device-train-batch-size", "2", *BF16,
                                    "--ref-model", "{llama}"], 1),
    "llama DPO LoRA fp32": ([*LLAMA, *DPO, "--per-device-train-batch-size", "2", *FP32,
                             "--lora-r", "8"], 1),
    "llama DPO precomputed fp32": ([*LLAMA, *DPO, "--per-device-train-batch-size", "2", *FP32,
                                    "--precompute-ref-log-probs"], 1),
    "llama DPO fsdp 2 processes bf16": ([*LLAMA, *DPO, "--per-device-train-batch-size", "2", *BF16,
                                         "--strategy", "fsdp"], 2),
    "llama DPO fsdp 2 processes LoRA fp32": ([*LLAMA, *DPO, "--per-device-train-batch-size", "2",
                                              *FP32, "--strategy", "fsdp", "--lora-r", "8"], 2),
    "llama DPO ddp 2 processes fp32": ([*LLAMA, *DPO, "--per-device-train-batch-size", "2", *FP32,
                                        "--strategy", "ddp"], 2),
}


def llama_folder(root: Path) -> Path:
    """A config-only Llama folder (hidden 512, 4 layers, vocab 8192): all the plan reads; the
    measured run builds the same architecture with random weights."""
    import transformers

    folder = root / "llama"
    folder.mkdir(parents=True, exist_ok=True)
    transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                             max_position_embeddings=1024).save_pretrained(folder)
    return folder


def parsed(flags: list[str]):
    """(StepModel, TrainingArguments) of the step `hputrain train` with these flags takes."""
    from hputrain.cli import build_parser
    from hputrain.cli.planning import planned_step

    return planned_step(vars(build_parser().parse_args(["plan", *flags])))


def planned(flags: list[str]) -> dict:
    """`hputrain plan --json` of the run, in its own process as a user runs it."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "plan", "--json", *flags],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    plan = json.loads(proc.stdout[proc.stdout.index("{"):])
    return {"peak": plan["peak_bytes"], "breakdown": plan["breakdown"],
            "seconds": time.perf_counter() - start}


def measured(flags: list[str], out: str) -> dict | None:
    """Rank 0's StepPeak of a real 3-step run (None on other ranks)."""
    from hputrain.rehearsal.plan.measure import measure_step

    trace, main_rank = measure_step(*parsed(flags), out)
    if not main_rank:
        return None
    return {"peak": trace.peak_bytes, "breakdown": trace.breakdown}


def run_case(name: str, root: Path) -> dict:
    flags, devices = CASES[name]
    flags = [f.format(llama=root / "llama") for f in flags]  # as each rank runs it
    plan = planned(flags + (["--devices", str(devices)] if devices > 1 else []))
    with tempfile.TemporaryDirectory() as out:
        if devices == 1:
            real = measured(flags, out)
        else:
            result = Path(out) / "measured.json"
            proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "launch", "--cpu",
                                   "--nproc-per-node", str(devices), __file__, "--child",
                                   json.dumps(flags), "--result", str(result)],
                                  capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            real = json.loads(result.read_text())
    return {"case": name, "plan": plan, "measured": real,
            "error": plan["peak"] / real["peak"] - 1}


def child(flags: list[str], result: str) -> None:
    """One rank of a multi-process measurement (under `hputrain launch`)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = os.environ.get("HPUTRAIN_BENCH_OUT", scratch)
        real = measured(flags, out)
    if real is not None:
        Path(result).write_text(json.dumps(real))


def machine() -> str:
    import platform

    from hputrain.accelerators import detect_accelerator

    cpu = detect_accelerator("cpu", "eager")
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        flags = []
    bf16 = "avx512_bf16 present" if "avx512_bf16" in flags else "no avx512_bf16"
    return (f"{cpu.device_name()}, {os.cpu_count()} cores, {bf16}, torch {torch.__version__}, "
            f"python {platform.python_version()}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.child:
        return child(json.loads(opts.child), opts.result)
    with tempfile.TemporaryDirectory() as root:
        llama_folder(Path(root))
        records = [run_case(name.strip(), Path(root)) for name in opts.cases.split(",")]
    mib = lambda n: n / 2**20  # noqa: E731
    print(f"machine: {machine()}")
    print("| case | plan (MiB) | measured (MiB) | plan vs measured | `hputrain plan` (s) |")
    print("|---|---|---|---|---|")
    for r in records:
        print(f"| {r['case']} | {mib(r['plan']['peak']):.1f} | {mib(r['measured']['peak']):.1f} | "
              f"{r['error']:+.1%} | {r['plan']['seconds']:.1f} |")
    if opts.json:
        Path(opts.json).write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
