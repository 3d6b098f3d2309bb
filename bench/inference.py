"""Generation speed of the built-in GPT: eager vs captured graphs (torch.compile on the CPU, CUDA
graphs on NVIDIA, HPU graphs on Gaudi), batch 1 and 8; decode tokens/s per sequence and time to
first token, median of interleaved repeats, graph capture done before timing.

    python bench/inference.py [--size tiny] [--prompt-len 64] [--new-tokens 128] [--repeats 5]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from hputrain.accelerators import detect_accelerator
from hputrain.execution.inference import Generator
from hputrain.models.gpt import GPT, GPTConfig

from common import machine


def one_run(generator, prompts, opts):
    result = generator.generate(prompts, opts.new_tokens)
    decode = result.seconds - result.time_to_first_token
    return (opts.new_tokens - 1) / decode, result.time_to_first_token


def measure(generators: dict, batch: int, opts) -> dict:
    """Interleaved repeats (eager, graphs, eager, ...) so that machine drift hits both alike."""
    prompts = [[(7 * i + j) % 256 for j in range(opts.prompt_len)] for i in range(batch)]
    for generator in generators.values():
        generator.generate(prompts, 4)  # capture (or warm up) the prompt's bucket and the decode step
    runs = {mode: [] for mode in generators}
    for _ in range(opts.repeats):
        for mode, generator in generators.items():
            runs[mode].append(one_run(generator, prompts, opts))
    return {mode: (statistics.median(r for r, _ in values), statistics.median(f for _, f in values))
            for mode, values in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    opts = p.parse_args()
    accelerator = detect_accelerator()
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_size(opts.size, block_size=opts.block_size)).to(accelerator.setup(0))
    print(f"machine: {machine(accelerator)}")
    print(f"model: {opts.size} GPT (context {opts.block_size}), prompt {opts.prompt_len} tokens, "
          f"{opts.new_tokens} new tokens, greedy, median of {opts.repeats}")
    print("| batch | mode | tokens/s per sequence | tokens/s (batch) | time to first token (ms) | graphs vs eager |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 8):
        generators = {mode: Generator(model, accelerator, graphs=mode == "graphs")
                      for mode in ("eager", "graphs")}
        results = measure(generators, batch, opts)
        for mode, (rate, first) in results.items():
            print(f"| {batch} | {mode} | {rate:,.0f} | {rate * batch:,.0f} | {first * 1e3:.1f} | "
                  f"{rate / results['eager'][0]:.2f}x |")


if __name__ == "__main__":
    main()
