"""Mixture of experts: a training step (forward, backward, AdamW) of a small Hugging Face MoE model
with each experts implementation (transformers' "eager", "batched_mm", "grouped_mm" and hputrain's
static-shape "hputrain", kinds/moe/experts/), on the same device: median step time of interleaved
repeats, and the step's peak of live tensor bytes (rehearsal/plan/tracking.py's tracker, the one
`hputrain plan` is checked against; on a GPU also the allocator's peak).

The model is built from a config (nothing downloaded): Qwen3-MoE by default (or Mixtral), hidden
256, 16 experts of intermediate 512, top-2, 4 layers, vocabulary 2048, batch 4 x 512 tokens
(2,048 tokens a step). Every variant gets the same weights, the same batch and the same other
kernels (hputrain's attention and RMSNorm substitution, execution/kernels.py), so that the experts
are the only difference; the first step's loss of each is checked against eager's.

    python bench/moe.py [--device auto|cpu|cuda] [--dtype fp32|bf16] [--json out.json]
    python bench/moe.py --profile hputrain       # torch.profiler's table of one variant's steps
    python bench/moe.py --quick                  # a tiny model, a few steps: checks that it runs

bf16 runs only where the device has it natively (the CPU flags are in the machine line); on a CPU
run it with OMP_NUM_THREADS set and `nice` on a shared machine: the load average is recorded.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch

from hputrain.accelerators import detect_accelerator

from common import bf16_where_native, machine

TRANSFORMERS = ("eager", "batched_mm", "grouped_mm")
OURS = "hputrain"
FULL = dict(hidden_size=256, moe_intermediate_size=512, intermediate_size=512, num_experts=16,
            num_local_experts=16, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=2048)
QUICK = dict(FULL, hidden_size=64, moe_intermediate_size=64, intermediate_size=64, num_experts=8,
             num_local_experts=8, num_hidden_layers=2, head_dim=16, vocab_size=256)


def options() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto (the first of hpu, cuda, mps, cpu), cpu, cuda, ...")
    p.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "mixtral"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--experts", type=int, help="experts per layer (default 16)")
    p.add_argument("--layers", type=int, help="decoder layers (default 4)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=6, help="timed steps a repeat")
    p.add_argument("--warmup", type=int, default=2, help="steps before the timed ones")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats")
    p.add_argument("--implementations", nargs="+", default=[*TRANSFORMERS, OURS])
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--profile", metavar="IMPLEMENTATION",
                   help="profile that variant's steps with torch.profiler instead of timing all")
    p.add_argument("--quick", action="store_true", help="a tiny model and 2 steps, once")
    opts = p.parse_args()
    if opts.quick:
        opts.steps, opts.warmup, opts.repeats, opts.batch, opts.seq_len = 2, 1, 1, 2, 64
    return opts


def config(opts):
    import transformers

    shape = dict(QUICK if opts.quick else FULL)
    if opts.experts:
        shape["num_experts"] = shape["num_local_experts"] = opts.experts
    if opts.layers:
        shape["num_hidden_layers"] = opts.layers
    if opts.family == "mixtral":  # its experts are intermediate_size wide
        shape["intermediate_size"] = shape["moe_intermediate_size"]
    cls = transformers.Qwen3MoeConfig if opts.family == "qwen3_moe" else transformers.MixtralConfig
    names = set(cls().to_dict())
    return cls(**{k: v for k, v in shape.items() if k in names}, max_position_embeddings=opts.seq_len,
               tie_word_embeddings=False, output_router_logits=False)


def build(cfg, implementation: str, accelerator, device, dtype):
    """The model with `implementation`'s experts, hputrain's other kernels, on `device`."""
    import transformers

    from hputrain.execution.kernels import substitute

    torch.manual_seed(0)
    # a config of its own: the experts read the implementation from the config they share
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).to(device=device, dtype=dtype)
    substitute(model, accelerator, True)  # attention and RMSNorm for all; ours for the experts
    if implementation != OURS:
        model.set_experts_implementation(implementation)
    elif model.config._experts_implementation != OURS:
        raise SystemExit(f"hputrain's experts are not registered here (the model runs "
                         f"{model.config._experts_implementation!r}): kinds/moe/experts/ is missing")
    model.train()
    return model


def batch(cfg, opts, device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (opts.batch, opts.seq_len), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def step(model, optimizer, rows) -> float:
    loss = model(**rows, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


class Variant:
    """One experts implementation's model and optimizer, kept across the interleaved repeats."""

    def __init__(self, name, cfg, accelerator, device, dtype):
        self.name = name
        self.model = build(cfg, name, accelerator, device, dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.times: list[float] = []
        self.first_loss: float | None = None

    def run(self, rows, accelerator, warmup: int, steps: int) -> None:
        for index in range(warmup):
            loss = step(self.model, self.optimizer, rows)
            if self.first_loss is None and index == 0:
                self.first_loss = float(loss)
        accelerator.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step(self.model, self.optimizer, rows)
        accelerator.synchronize()
        self.times.append((time.perf_counter() - start) / steps)

    def peak(self, rows, accelerator, device) -> dict:
        """One step's peak of live tensor bytes by kind (the plan's tracker), and on a device
        with an allocator that keeps one, that allocator's peak of the same step."""
        from hputrain.rehearsal.plan.tracking import breakdown, tracker

        allocator = _allocator(device)
        if allocator is not None:
            accelerator.synchronize()
            allocator.reset_peak_memory_stats()
            before = allocator.memory_allocated()
            step(self.model, self.optimizer, rows)
            accelerator.synchronize()
            device_peak = allocator.max_memory_allocated()
        found = tracker(self.model, self.optimizer, False, tuple(rows.values()))
        with found:
            step(self.model, self.optimizer, rows)
        trace = breakdown(found)
        result = {"peak_bytes": trace.peak_bytes, "breakdown": trace.breakdown}
        if allocator is not None:
            result["allocator_peak_bytes"] = device_peak
            result["allocator_held_before_bytes"] = before
        return result


def _allocator(device):
    """torch.accelerator's memory counters for `device` (None on the CPU, which keeps none)."""
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if current is None or current.type != device.type or not hasattr(torch.accelerator, "max_memory_allocated"):
        return None
    return torch.accelerator


def profile(opts, cfg, accelerator, device, dtype) -> None:
    variant = Variant(opts.profile, cfg, accelerator, device, dtype)
    rows = batch(cfg, opts, device)
    variant.run(rows, accelerator, opts.warmup, 1)
    with torch.profiler.profile(activities=accelerator.profiler_activities()) as prof:
        variant.run(rows, accelerator, 0, opts.steps)
    on_device = any(a != torch.profiler.ProfilerActivity.CPU for a in accelerator.profiler_activities())
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25))


def main() -> None:
    opts = options()
    accelerator = detect_accelerator(opts.device)
    device = accelerator.setup(0)
    bf16 = bf16_where_native(accelerator, opts.dtype == "bf16")
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = config(opts)
    if opts.profile:
        return profile(opts, cfg, accelerator, device, dtype)
    load_before = os.getloadavg()
    variants = [Variant(name, cfg, accelerator, device, dtype) for name in opts.implementations]
    rows = batch(cfg, opts, device)
    for _ in range(opts.repeats):  # interleaved: drift in the machine's speed hits every variant
        for variant in variants:
            variant.run(rows, accelerator, opts.warmup, opts.steps)
    peaks = {v.name: v.peak(rows, accelerator, device) for v in variants}
    report(opts, cfg, accelerator, dtype, variants, peaks, load_before, os.getloadavg())


def report(opts, cfg, accelerator, dtype, variants, peaks, load_before, load_after) -> None:
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    inner = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    parameters = sum(p.numel() for p in variants[0].model.parameters())
    reference = next((v.first_loss for v in variants if v.name == "eager"), variants[0].first_loss)
    setup = (f"{cfg.model_type}, {parameters / 1e6:.1f}M parameters: hidden {cfg.hidden_size}, "
             f"{experts} experts of intermediate {inner}, top-{cfg.num_experts_per_tok}, "
             f"{cfg.num_hidden_layers} layers, vocabulary {cfg.vocab_size}; batch {opts.batch} x "
             f"{opts.seq_len} tokens; {str(dtype).removeprefix('torch.')}; AdamW; {opts.warmup} "
             f"warm-up + {opts.steps} timed steps a repeat, {opts.repeats} interleaved repeats")
    load = f"load average {' '.join(f'{x:.2f}' for x in load_before)} before, " \
           f"{' '.join(f'{x:.2f}' for x in load_after)} after"
    medians = {v.name: statistics.median(v.times) for v in variants}
    theirs = {n: t for n, t in medians.items() if n in TRANSFORMERS}
    fastest = min(theirs, key=theirs.get) if theirs else None
    print(f"machine: {machine(accelerator)}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"{load}")
    print(f"model: {setup}")
    print(f"| experts | median step (ms) | time vs {fastest} | peak live tensors (MiB) | "
          "activations at the peak (MiB) | first loss - eager's |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        peak = peaks[v.name]
        ratio = f"{medians[v.name] / theirs[fastest]:.3f}x" if fastest else "-"
        print(f"| {v.name} | {medians[v.name] * 1e3:.1f} | {ratio} | {peak['peak_bytes'] / 2**20:.1f} | "
              f"{peak['breakdown']['activations'] / 2**20:.1f} | {v.first_loss - reference:+.1e} |")
    print("repeats (ms):", {v.name: [round(t * 1e3, 1) for t in v.times] for v in variants})
    if any("allocator_peak_bytes" in p for p in peaks.values()):
        print("allocator peak of a step (MiB):",
              {n: round(p["allocator_peak_bytes"] / 2**20, 1) for n, p in peaks.items()})
    if fastest and OURS in medians:
        faster = medians[OURS] < theirs[fastest]
        lower = peaks[OURS]["peak_bytes"] <= peaks[fastest]["peak_bytes"]
        print(f"{OURS} vs the fastest of transformers' ({fastest}): "
              f"{'faster' if faster else 'slower'}, peak {'no higher' if lower else 'higher'}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"machine": machine(accelerator), "load_average": {"before": load_before,
                       "after": load_after}, "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                       "model": setup, "fastest_transformers": fastest,
                       "results": {v.name: {"median_step_s": medians[v.name], "repeats_s": v.times,
                                            "first_loss": v.first_loss, **peaks[v.name]}
                                   for v in variants}}, f, indent=2)


if __name__ == "__main__":
    main()
