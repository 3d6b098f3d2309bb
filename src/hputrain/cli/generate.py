"""`hputrain generate`: text from a trained checkpoint through graph-captured inference
(execution/inference.py)."""
from __future__ import annotations

import json
import sys
import time

import torch

from ..accelerators import detect_accelerator
from ..errors import InputError
from ..execution.inference import Generation, Generator, load_for_generation
from ..models.gpt import check_sampling


def cmd_generate(args) -> int:
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    check_sampling(args.temperature, args.top_k)  # before the checkpoint loads
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise InputError(f"--seed must be in 0..2**64-1, got {args.seed}")
    accelerator = detect_accelerator("cpu" if args.cpu else args.accelerator)
    model = load_for_generation(args.checkpoint, accelerator)
    if args.seed is not None:
        torch.manual_seed(args.seed)
    prompts = [list(p.encode()) for p in (args.prompt or ["\n"])]
    generator = Generator(model, accelerator, graphs=not args.no_graphs)
    capture = time.perf_counter()
    if not args.no_graphs:  # capture the prompt's bucket and the decode step before the clock runs
        generator.generate(prompts, min(2, args.max_new_tokens))
    capture = time.perf_counter() - capture
    result = generator.generate(prompts, args.max_new_tokens, args.temperature, args.top_k)
    _print_generation(prompts, result, capture, args.json)
    return 0


def _print_generation(prompts, result: Generation, capture: float, as_json: bool) -> None:
    records = []
    for prompt, new in zip(prompts, result.tokens):
        records.append({
            "text": bytes(prompt + new).decode("utf-8", errors="replace"),
            "tokens": len(new),
            "tokens_per_second": len(new) / result.seconds,
            "time_to_first_token_ms": result.time_to_first_token * 1e3,
        })
    if as_json:
        print(json.dumps(records[0] if len(records) == 1 else records, indent=2))
    else:
        for record in records:
            print(record["text"])
        print(f"({sum(r['tokens'] for r in records)} tokens, {records[0]['tokens_per_second']:.1f} "
              f"tokens/s per prompt, first token after {records[0]['time_to_first_token_ms']:.1f} ms; "
              f"graph capture before that: {capture:.1f} s)", file=sys.stderr)


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="graph-captured text generation from a trained checkpoint")
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder written by hputrain train")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8,
                   help="0 is greedy; otherwise at least 1e-4 (MIN_TEMPERATURE)")
    p.add_argument("--top-k", "--top_k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-graphs", action="store_true", help="run eagerly, without graph capture")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--cpu", action="store_true", help="force the CPU")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_generate)
