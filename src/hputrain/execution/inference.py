"""Graph-captured inference and generation.

Each device captures graphs its own way (HPU graphs on Gaudi, CUDA graphs on NVIDIA, torch.compile
on the CPU: `accelerator.wrap_graph_inference`). Captured graphs want static shapes, so inputs are
padded to a few length buckets and each bucket is captured once. Generation for the built-in GPT
keeps a preallocated key/value cache, so the decode step has the same shapes at every position and
is captured once.
"""
from __future__ import annotations

import inspect
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..data.batching import PAD_VALUES, base_model
from ..errors import InputError
from ..files import NotARegularFile, read_regular_file

DEFAULT_BUCKETS = (32, 64, 128, 256, 512, 1024)

MAX_LENGTH_FIELDS = ("n_positions", "max_position_embeddings", "block_size", "n_ctx", "max_seq_len",
                     "seq_length")
"""Config fields that name a model's longest input (GPT-2, most Hugging Face models, the built-in
GPT, ...), in the order they are asked."""

DECODER_KEYS = ("decoder_input_ids", "decoder_attention_mask", "labels")
"""An encoder-decoder model's inputs whose length is the target's, not the source's."""


def bucket_for(length: int, buckets=DEFAULT_BUCKETS) -> int:
    """The smallest bucket that holds `length` (beyond the largest: the next multiple of it)."""
    for bucket in buckets:
        if length <= bucket:
            return bucket
    return -(-length // buckets[-1]) * buckets[-1]


def max_length(model) -> tuple[int, str] | None:
    """The longest input `model` takes and the config field that says so; None when its config
    names none (T5's relative positions, a model without a config)."""
    config = getattr(model, "config", None)
    config = text_config(config)
    for field in MAX_LENGTH_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, field
    return None


def text_config(config):
    """An image-text-to-text model's config: its language model's (where the length and the
    attention window are); any other config itself."""
    try:
        return config.get_text_config() if hasattr(config, "get_text_config") else config
    except ValueError:  # several text configs (an encoder's and a decoder's): the whole one
        return config


def capped_buckets(buckets, limit: int | None) -> tuple[int, ...]:
    """`buckets` cut at `limit`, which becomes the last bucket (no cut without a limit)."""
    if limit is None:
        return tuple(buckets)
    return tuple(b for b in buckets if b < limit) + (limit,)


class GraphedModel(torch.nn.Module):
    """A model run through captured graphs. Sequence inputs (dim 1 of the length of input_ids) are
    padded to a bucket (labels with -100, so the loss is unchanged) and the logits cut back. The
    buckets stop at the model's maximum length; a longer input is an InputError. An
    encoder-decoder model's decoder inputs are bucketed by their own length. A model whose
    forward takes an attention_mask gets one of ones when none is given, so that padding is
    masked out of bidirectional attention."""

    def __init__(self, model: torch.nn.Module, capture, buckets=DEFAULT_BUCKETS) -> None:
        super().__init__()
        self.model, self.limit = model, max_length(model)
        self.buckets = capped_buckets(buckets, self.limit and self.limit[0])
        self.encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
        self.masks = "attention_mask" in _forward_parameters(model)
        self.captured = capture(model)

    def forward(self, input_ids: torch.Tensor, **inputs):
        if self.masks and inputs.get("attention_mask") is None:
            inputs["attention_mask"] = torch.ones_like(input_ids)
        decoder = {key: inputs.pop(key) for key in DECODER_KEYS
                   if self.encoder_decoder and isinstance(inputs.get(key), torch.Tensor)}
        length = input_ids.shape[1]
        padded = self._pad({"input_ids": input_ids, **inputs}, length, "input")
        target = length
        if decoder:
            target = next(iter(decoder.values())).shape[1]  # decoder_input_ids, else labels
            padded.update(self._pad(decoder, target, "decoder input"))
        output = self.captured(**padded)
        if isinstance(output, dict):  # a Hugging Face ModelOutput is one too
            cut = {"logits": target, "encoder_last_hidden_state": length}
            output = {**output, **{key: output[key][:, :n] for key, n in cut.items()
                                   if isinstance(output.get(key), torch.Tensor)}}
        return output

    def _pad(self, tensors: dict, length: int, what: str) -> dict:
        """`tensors` whose dim 1 is `length`, padded to its bucket; the others as they are."""
        if self.limit is not None and length > self.limit[0]:
            limit, field = self.limit
            raise InputError(f"{what} of {length} tokens is longer than the model's maximum of "
                             f"{limit} (config.{field}); truncate the data to {limit} tokens")
        bucket = bucket_for(length, self.buckets)
        return {key: _pad(value, length, bucket, PAD_VALUES.get(key, 0))
                for key, value in tensors.items()}


def _forward_parameters(model: torch.nn.Module) -> set[str]:
    """The names the model's forward takes (under PEFT's adapters, its base model's)."""
    try:
        return set(inspect.signature(base_model(model).forward).parameters)
    except (TypeError, ValueError):
        return set()


def _pad(value, length: int, target: int, fill: int):
    if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length):
        return value
    # a copy even when nothing is added: inputs that alias each other (labels=input_ids) would
    # be captured as another graph than the same inputs padded
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
        if not 0 < self.max_len <= model.config.block_size:
            raise InputError(f"max_len must be in 1..{model.config.block_size} (the model's "
                             f"block_size), got {self.max_len}")
        self.buckets = capped_buckets(buckets, self.max_len)
        self.capture = (capture or accelerator.wrap_graph_inference) if graphs else (lambda m: m)
        self.steps: dict[int, torch.nn.Module] = {}  # batch size -> captured DecodeStep

    def _step(self, batch: int):
        if batch not in self.steps:
            self.steps[batch] = self.capture(DecodeStep(self.model, batch, self.max_len))
        return self.steps[batch]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None) -> Generation:
        from ..models.gpt import check_sampling, pick_next_token

        check_sampling(temperature, top_k)
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        if not prompts or min(len(p) for p in prompts) == 0:
            raise InputError("every prompt needs at least one token")
        device = self.model.wte.weight.device
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        longest = int(lengths.max())
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

MAX_JSON_BYTES = 1 << 20
"""Largest config.json / trainer_state.json read (each holds a few hundred bytes)."""

NO_MEMORY_LIMIT_PARAMETERS = 10**12
"""The parameter limit when neither the host nor the device says how much memory it has."""


def read_json_file(file: Path):
    """The JSON in `file`, or None when there is no such file. Anything but a regular file (a
    FIFO would block the reader forever, a device never end) and anything over MAX_JSON_BYTES is
    a CheckpointError: the file is opened without blocking and checked before it is read."""
    from ..checkpoint.folder import CheckpointError

    try:
        data = read_regular_file(file, MAX_JSON_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{file} cannot be read: {exc.strerror}") from None
    except NotARegularFile as exc:
        raise CheckpointError(str(exc)) from None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from None


def _parameter_limit(accelerator) -> int:
    """How many float32 parameters fit in the smaller of the host's and the device's memory (the
    model is built on the host, then moved)."""
    from ..accelerators.cpu import CPUAccelerator

    sizes = [stats.get("total_memory_available_gb") or 0
             for stats in (CPUAccelerator().memory_stats(), accelerator.memory_stats())]
    known = [gb for gb in sizes if gb > 0]
    return int(min(known) * 1e9 / 4) if known else NO_MEMORY_LIMIT_PARAMETERS


def read_gpt_config(folder: Path, max_parameters: int | None = None):
    """The GPTConfig of a checkpoint folder: its config.json (dataclasses.asdict(GPTConfig)), else
    the "model_config" of trainer_state.json (checkpoints written before config.json); validated,
    and no larger than `max_parameters`."""
    from ..checkpoint.folder import CONFIG_FILE, STATE_FILE, CheckpointError
    from ..models.gpt import GPTConfig

    if not folder.is_dir():
        raise CheckpointError(f"Checkpoint folder {folder} does not exist or is not a folder")
    state = read_json_file(folder / STATE_FILE)  # read first: a FIFO here would hang the loader
    if state is None:
        raise CheckpointError(f"{folder} is not a checkpoint folder: {STATE_FILE} is missing")
    file, data = folder / CONFIG_FILE, read_json_file(folder / CONFIG_FILE)
    if data is None:
        file, data = folder / STATE_FILE, state.get("model_config") if isinstance(state, dict) else None
        if data is None:
            raise CheckpointError(f"{folder} is not a checkpoint of the built-in GPT (no "
                                  f"{CONFIG_FILE}, and no model_config in {STATE_FILE})")
    if isinstance(data, dict) and "model_type" in data:
        raise CheckpointError(f"{file} is the config of a Hugging Face {data['model_type']!r} model; "
                              f"hputrain generate runs the built-in GPT only")
    try:
        return GPTConfig.from_dict(data, max_parameters)
    except ValueError as exc:
        raise CheckpointError(f"Checkpoint {file} cannot be used: {exc}") from None


def load_for_generation(checkpoint_dir: str, accelerator):
    """The built-in GPT of a checkpoint written by `hputrain train`, on the accelerator's device;
    a config whose float32 weights would not fit in memory is refused before anything is built."""
    from ..checkpoint.saving import load_checkpoint
    from ..models.gpt import GPT

    device = accelerator.setup(0)
    folder = Path(checkpoint_dir)
    model = GPT(read_gpt_config(folder, _parameter_limit(accelerator)))
    load_checkpoint(folder, model=model, restore_rng=False)
    return model.to(device)
