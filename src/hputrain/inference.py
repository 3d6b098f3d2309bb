"""Graph-captured inference and generation.

Each device captures graphs its own way (HPU graphs on Gaudi, CUDA graphs on NVIDIA, torch.compile
on the CPU: `accelerator.wrap_graph_inference`). Captured graphs want static shapes, so inputs are
padded to a few length buckets and each bucket is captured once. Generation for the built-in GPT
keeps a preallocated key/value cache, so the decode step has the same shapes at every position and
is captured once.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import PAD_VALUES
from .errors import InputError

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024)


def bucket_for(length: int, buckets=DEFAULT_BUCKETS) -> int:
    """The smallest bucket that holds `length` (beyond the largest: the next multiple of it)."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    return -(-length // buckets[-1]) * buckets[-1]


class GraphedModel(torch.nn.Module):
    """A model run through captured graphs: sequence inputs (dim 1 of the length of input_ids)
    are padded to a bucket (labels with -100, so the loss is unchanged) and the logits cut back."""

    def __init__(self, model: torch.nn.Module, capture, buckets=DEFAULT_BUCKETS) -> None:
        super().__init__()
        self.model, self.buckets = model, tuple(buckets)
        self.captured = capture(model)

    def forward(self, input_ids: torch.Tensor, **inputs):
        length = input_ids.shape[1]
        target = bucket_for(length, self.buckets)
        padded = {key: _pad(value, length, target, PAD_VALUES.get(key, 0)) for key, value in
                  {"input_ids": input_ids, **inputs}.items()}
        output = self.captured(**padded)
        if isinstance(output, dict) and "logits" in output:
            output = {**output, "logits": output["logits"][:, :length]}
        return output


def _pad(value, length: int, target: int, fill: int):
    if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length):
        return value
    shape = (value.shape[0], target - length, *value.shape[2:])
    return torch.cat([value, value.new_full(shape, fill)], dim=1)


def wrap_for_inference(model: torch.nn.Module, accelerator, buckets=DEFAULT_BUCKETS,
                       capture=None) -> GraphedModel:
    """`model` behind the device's graph capture, one graph per length bucket."""
    return GraphedModel(model.eval(), capture or accelerator.wrap_graph_inference, buckets)


# -- generation with a static key/value cache ---------------------------------------------------------

class DecodeStep(torch.nn.Module):
    """GPT.decode over a cache held as buffers (fixed addresses, what CUDA and HPU graphs want)."""

    def __init__(self, model, batch: int, max_len: int) -> None:
        super().__init__()
        self.model = model
        for i, (keys, values) in enumerate(model.new_cache(batch, max_len)):
            self.register_buffer(f"k{i}", keys, persistent=False)
            self.register_buffer(f"v{i}", values, persistent=False)
        self.layers = len(model.blocks)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor,
                greedy: bool = False) -> torch.Tensor:
        """Logits (B, vocab) at column `last` (B,) of each row, after caching the whole input; with
        `greedy`, the most likely next token (B, 1) instead, picked inside the graph."""
        cache = [(getattr(self, f"k{i}"), getattr(self, f"v{i}")) for i in range(self.layers)]
        logits = self.model.decode(input_ids, positions, cache)
        logits = logits[torch.arange(logits.shape[0], device=logits.device), last]
        return logits.argmax(dim=-1, keepdim=True) if greedy else logits


@dataclass
class Generation:
    tokens: list[list[int]]  # the new tokens of each prompt
    seconds: float  # the whole generation
    time_to_first_token: float  # prefill and the first token


class Generator:
    """Batched generation for the built-in GPT: prompts right-padded to a bucket and prefilled in
    one call, then one captured decode step per token."""

    def __init__(self, model, accelerator, graphs: bool = True, max_len: int | None = None,
                 buckets=DEFAULT_BUCKETS, capture=None) -> None:
        self.model, self.accelerator = model.eval(), accelerator
        self.max_len = max_len or model.config.block_size
        self.buckets = tuple(b for b in buckets if b < self.max_len) + (self.max_len,)
        self.capture = (capture or accelerator.wrap_graph_inference) if graphs else (lambda m: m)
        self.steps: dict[int, torch.nn.Module] = {}  # batch size -> captured DecodeStep

    def _step(self, batch: int):
        if batch not in self.steps:
            self.steps[batch] = self.capture(DecodeStep(self.model, batch, self.max_len))
        return self.steps[batch]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None) -> Generation:
        from .models.gpt import pick_next_token

        device = self.model.wte.weight.device
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        longest = int(lengths.max())
        if not prompts or min(len(p) for p in prompts) == 0:
            raise InputError("every prompt needs at least one token")
        if longest + max_new_tokens > self.max_len:
            raise InputError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds the "
                             f"model's context of {self.max_len}")
        step = self._step(len(prompts))
        start = time.perf_counter()
        width = bucket_for(longest, self.buckets)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = torch.tensor(prompt, device=device)
        positions = torch.arange(width, device=device).expand(len(prompts), width)
        greedy = temperature == 0

        def next_token(inputs, where, column):
            if greedy:  # picked inside the captured step
                return step(inputs, where, column, True)
            return pick_next_token(step(inputs, where, column), temperature, top_k)

        out = [next_token(ids, positions, lengths - 1)]
        first = time.perf_counter() - start
        # Outside the captured step the decode loop does one position update per token.
        position, column = lengths[:, None].clone(), torch.zeros_like(lengths)
        for _ in range(max_new_tokens - 1):
            out.append(next_token(out[-1], position, column))
            position += 1
        tokens = torch.cat(out, dim=1).tolist()
        return Generation(tokens, time.perf_counter() - start, first)


# -- `hputrain generate` ------------------------------------------------------------------------------

def load_for_generation(checkpoint_dir: str, accelerator):
    """The built-in GPT of a checkpoint written by `hputrain train`, on the accelerator's device."""
    from .checkpoint import CheckpointError, STATE_FILE, load_checkpoint
    from .models.gpt import GPT, GPTConfig

    folder = Path(checkpoint_dir)
    try:
        state = json.loads((folder / STATE_FILE).read_text())
        config = GPTConfig(**state["model_config"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{folder} is not a checkpoint of the built-in GPT ({STATE_FILE} "
                              f"missing, unreadable or without model_config: {exc})") from None
    model = GPT(config)
    load_checkpoint(folder, model=model, restore_rng=False)
    return model.to(accelerator.setup(0))


def cmd_generate(args) -> int:
    from .accelerators import detect_accelerator

    if args.max_new_tokens < 1 or args.temperature < 0 or (args.top_k is not None and args.top_k < 1):
        raise InputError("need --max-new-tokens >= 1, --temperature >= 0 and --top-k >= 1")
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
    records = []
    for prompt, new in zip(prompts, result.tokens):
        records.append({
            "text": bytes(prompt + new).decode("utf-8", errors="replace"),
            "tokens": len(new),
            "tokens_per_second": len(new) / result.seconds,
            "time_to_first_token_ms": result.time_to_first_token * 1e3,
        })
    if args.json:
        print(json.dumps(records[0] if len(records) == 1 else records, indent=2))
    else:
        for record in records:
            print(record["text"])
        print(f"({sum(r['tokens'] for r in records)} tokens, {records[0]['tokens_per_second']:.1f} "
              f"tokens/s per prompt, first token after {records[0]['time_to_first_token_ms']:.1f} ms; "
              f"graph capture before that: {capture:.1f} s)", file=sys.stderr)
    return 0


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="graph-captured text generation from a trained checkpoint")
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder written by hputrain train")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", "--top_k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-graphs", action="store_true", help="run eagerly, without graph capture")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--cpu", action="store_true", help="force the CPU")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_generate)
