"""Kernel substitution (kernels.py): a Hugging Face Llama-architecture model (about 31M
parameters, built from a config: nothing downloaded) trained with fused_kernels=True and False,
in eager and compile mode, interleaved repeats, median step time after warm-up.

What it decides: fused_kernels="auto" is on for a device where "on" is no slower in any mode
(Accelerator.prefers_fused_kernels); the last line says whether this run agrees. On the CPU and on
CUDA the attention kernel is torch's SDPA either way (transformers' default), so the difference is
the RMSNorm swap: one F.rms_norm where LlamaRMSNorm runs five ops. Gaudi figures (FusedSDPA,
FusedRMSNorm) need a Gaudi; the fake runtime of the tests times nothing.

    python bench/kernels.py [--modes eager compile] [--steps 30] [--warmup 10] [--repeats 3]
    python bench/kernels.py --quick      # a tiny model, a few steps: checks that it runs
"""
from __future__ import annotations

import statistics

import torch

from hputrain.accelerators import detect_accelerator

from common import bf16_where_native, machine, parser, trainer_step_time

# hidden 512, 8 layers, grouped-query attention (8 heads, 4 key/value heads), 8192 tokens: 31M
FULL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
QUICK = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def llama(shape: dict, seq_len: int):
    import transformers

    config = transformers.LlamaConfig(**shape, max_position_embeddings=seq_len)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def token_rows(vocab: int, seq_len: int, count: int = 512) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (count, seq_len), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    p = parser(__doc__, steps=30, repeats=3)
    p.add_argument("--modes", nargs="+", default=["eager", "compile"])
    p.add_argument("--quick", action="store_true", help="a tiny model and 4 steps, once")
    p.set_defaults(seq_len=256, batch=8)
    opts = p.parse_args()
    if opts.quick:
        opts.steps, opts.warmup, opts.repeats, opts.seq_len, opts.batch = 4, 1, 1, 32, 2
    shape = QUICK if opts.quick else FULL
    accelerator = detect_accelerator()
    opts.bf16 = bf16_where_native(accelerator, opts.bf16)
    data = token_rows(shape["vocab_size"], opts.seq_len)
    parameters = sum(p.numel() for p in llama(shape, opts.seq_len).parameters())
    runs = {(mode, fused): [] for mode in opts.modes for fused in (False, True)}
    for _ in range(opts.repeats):  # interleaved: drift in the machine's speed hits every variant
        for mode, fused in runs:
            runs[mode, fused].append(trainer_step_time(
                llama(shape, opts.seq_len), data, opts, execution_mode=mode, fused_kernels=fused,
                bf16=opts.bf16))
    print(f"machine: {machine(accelerator)}")
    print(f"model: Hugging Face Llama, {parameters / 1e6:.1f}M parameters, seq {opts.seq_len}, batch "
          f"{opts.batch}, bf16={opts.bf16}, {opts.steps} steps, first {opts.warmup} left out, "
          f"{opts.repeats} interleaved repeats")
    print("| mode | fused_kernels | median step (ms) | time vs off |")
    print("|---|---|---|---|")
    ratios = []
    for mode in opts.modes:
        off = statistics.median(runs[mode, False])
        for fused in (False, True):
            median = statistics.median(runs[mode, fused])
            print(f"| {mode} | {fused} | {median * 1e3:.2f} | {median / off:.3f}x |")
        ratios.append(statistics.median(runs[mode, True]) / off)
    print({f"{mode} {fused}": [round(v * 1e3, 2) for v in values] for (mode, fused), values in runs.items()})
    # within 2 %: the noise of interleaved repeats on a shared machine
    print(f"on no slower in every mode (auto may be on here): {'yes' if max(ratios) <= 1.02 else 'no'}")


if __name__ == "__main__":
    main()
