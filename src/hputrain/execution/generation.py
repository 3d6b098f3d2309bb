"""Static-shape generation for Hugging Face causal LMs: the rollout engine of GRPO and of
`hputrain generate --model DIR --chat Q`.

transformers' `model.generate` on a left-padded batch changes shapes at every call (the prompt
length) and at every token (the cache grows, finished rows stop the loop), which on Gaudi means a
graph compile each time. Here every shape is fixed after warm-up:

- prompts are left-padded to the smallest length bucket that holds the longest;
- the key/value cache holds bucket + C positions (C = max_completion_length), allocated once per
  (rows, bucket) and reused; our own buffers, not transformers' StaticCache, whose API changed
  between 4.x and 5.x (cache_position in 4.x, a counter in 5.x), while `update(key, value,
  layer_idx, ...)` is all a model asks of its cache in both;
- the attention mask is 4-D and made by us from the prompt mask and the write position, so that
  transformers builds none (its sdpa mask reads the mask back to the host to skip it);
- prefill is one call (with what a prompt brings beside its tokens, `Prefill`: an
  image-text-to-text model's images, Qwen's 3-D positions, Gemma 3's image blocks that attend
  both ways); then exactly C - 1 decode calls of the same shapes, which read images only through
  the cache. Finished rows keep
  decoding (masked, fed pad_token_id as generate feeds them): no row is dropped and the loop never
  stops early, so every rank of a sharded model calls forward the same number of times;
- the decode step is one module captured once per (rows, bucket) (`wrap_graph_inference`:
  torch.compile on the CPU, CUDA graphs, HPU graphs), the sampler one per (rows, Sampling);
- sampling runs on the device (repetition penalty, temperature, top-k, top-p, min-p in generate's
  order, then the inverse of the filtered distribution's cumulative sum at one uniform draw per
  row, drawn outside the graphs from the caller's generator, which may be a CPU one where the
  device has none: uniform_noise), and nothing is read back to the host until the rollout is over.
  One number a row, not one per vocabulary entry (Gumbel-max's exponential noise): at a 32k
  vocabulary those draws alone took a quarter of a rollout's time on the CPU.
"""
from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass

import torch

from ..data.batching import base_model
from ..errors import InputError
from ..models.gpt import MIN_TEMPERATURE
from .inference import bucket_for, max_length, text_config

DEFAULT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)

BOOLEAN_MASKS = ("sdpa", "hputrain")
"""Attention implementations that take sdpa's boolean masks (True attends); "eager" takes an
additive one; the rest (flash, flex, paged) build their own masks and are refused."""


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen, with transformers' meaning of each field."""

    temperature: float = 1.0
    """0 is greedy; otherwise at least MIN_TEMPERATURE."""
    top_p: float = 1.0
    """Keep the most likely tokens whose probabilities add up to top_p (1: off)."""
    top_k: int = 0
    """Keep the top_k most likely tokens (0: off)."""
    min_p: float | None = None
    """Drop tokens less likely than min_p times the most likely one (None: off)."""
    repetition_penalty: float = 1.0
    """Divide positive (multiply negative) logits of tokens already seen (1: off)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check(self) -> Sampling:
        """Raise InputError (one line) unless every field is in range; return self."""
        t, p, k, m, r = (self.temperature, self.top_p, self.top_k, self.min_p,
                         self.repetition_penalty)
        if not (t == 0 or (_finite(t) and t >= MIN_TEMPERATURE)):
            raise InputError(f"temperature must be 0 (greedy) or a finite number >= "
                             f"{MIN_TEMPERATURE:g}, got {t!r}")
        if not (_finite(p) and 0 < p <= 1):
            raise InputError(f"top_p must be in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0: off), got {k!r}")
        if m is not None and not (_finite(m) and 0 <= m <= 1):
            raise InputError(f"min_p must be in [0, 1] (or None: off), got {m!r}")
        if not (_finite(r) and r > 0):
            raise InputError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        return self


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def process_logits(logits: torch.Tensor, sampling: Sampling,
                   seen: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) logits as float32 after repetition penalty (tokens where `seen` (B, V) is True),
    then, unless greedy, temperature, top-k, top-p and min-p: transformers' processors in
    generate's order, filtered tokens at -inf (each keeps at least one token)."""
    logits = logits.float()
    penalty = sampling.repetition_penalty
    if penalty != 1.0 and seen is not None:
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(seen, penalized, logits)
    if sampling.greedy:
        return logits
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(logits, min(sampling.top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if sampling.top_p < 1.0:
        ascending, order = logits.sort(dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - sampling.top_p
        drop[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), -math.inf)
    if sampling.min_p is not None:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True),
                                    -math.inf)
    return logits


class Sampler(torch.nn.Module):
    """The next token (B,) from (B, V) logits: argmax when greedy, else drawn from the processed
    distribution by its inverse cumulative sum at `uniform` (B, 1), draws in (0, 1]. The draws
    come in as an input, so that a captured graph replays new ones."""

    def __init__(self, sampling: Sampling) -> None:
        super().__init__()
        self.sampling = sampling

    def forward(self, logits: torch.Tensor, seen: torch.Tensor | None = None,
                uniform: torch.Tensor | None = None) -> torch.Tensor:
        logits = process_logits(logits, self.sampling, seen)
        if uniform is None:
            return logits.argmax(dim=-1)
        return inverse_cdf(logits, uniform)


def inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token j of each row where the cumulative sum of softmax(logits) first reaches
    `uniform` (B, 1) in (0, 1]: token j is drawn with probability softmax(logits)[j] exactly
    (up to float32 rounding of the sum). A filtered (-inf) token adds 0 to the sum, so the sum
    never first reaches the draw there; the draw is never 0 and the sum ends at its total, so
    some token always does. Comparisons and a count, not searchsorted: ops every backend has,
    lazy mode's included."""
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()  # unnormalised: max is 1
    cdf = weights.cumsum(dim=-1)
    return (cdf < uniform * cdf[:, -1:]).sum(dim=-1)


@dataclass
class Prefill:
    """What prompts bring beside their tokens, for the prefill only (the decode steps read it
    through the cache): an image-text-to-text model's images and the positions they take."""

    inputs: dict
    """Model inputs of the prefill besides the tokens: pixel_values, image_grid_thw, ..."""
    positions: list[torch.Tensor] | None = None
    """Per prompt, its tokens' positions: (L,) or (3, L) (Qwen's multimodal RoPE); None: 0..L-1.
    Decoding continues from the largest position + 1, the same on every row of a 3-D one (text
    after the prompt, as transformers' rope deltas give it)."""
    image_groups: list[torch.Tensor] | None = None
    """Per prompt (L,): the image each token belongs to (0, 1, ...) where the tokens of one image
    attend to each other both ways in the prefill (Gemma 3), -1 for other tokens; None: causal."""


@dataclass
class Rollout:
    """One batch of prompts and their completions, on the model's device."""

    prompt_ids: torch.Tensor
    """(B, P) prompts left-padded with pad_token_id to the bucket P."""
    prompt_mask: torch.Tensor
    """(B, P) 1 on prompt tokens, 0 on padding."""
    completion_ids: torch.Tensor
    """(B, C) generated tokens; pad_token_id after a row's first end token."""
    completion_mask: torch.Tensor
    """(B, C) int: 1 up to and including the first end token, 0 after; all ones for a row that
    never ends (TRL's rule)."""
    seconds: float
    """Wall time of the rollout, up to the tokens being ready."""


def end_token_ids(eos_token_id, generation_eos) -> list[int]:
    """Where a model's generation ends, as TRL's GRPOTrainer stops it: the tokenizer's eos
    (`eos_token_id`), then each id of its generation config's eos_token_id (`generation_eos`: an
    id or a list, where chat models name their end of turn: Llama 3's <|eot_id|>, Qwen's
    <|im_end|>); each once, None left out."""
    listed = generation_eos if isinstance(generation_eos, (list, tuple)) else [generation_eos]
    return list(dict.fromkeys(i for i in (eos_token_id, *listed) if isinstance(i, int)))


def completion_mask(completion_ids: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """TRL's completion mask of (B, C) ids: ones up to and including the first of `eos_ids`."""
    is_eos = (completion_ids[:, :, None] == eos_ids).any(dim=-1)
    columns = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    first = torch.where(is_eos, columns, completion_ids.shape[1]).amin(dim=1, keepdim=True)
    return (columns <= first).int()


# -- the decode step ----------------------------------------------------------------------------------

class KeyValueBuffers(torch.nn.Module):
    """A static key/value cache: per layer (rows, kv_heads, length, head_dim) buffers, written in
    place at `position` (set by the step before each forward) and returned whole. Made up front
    from the config where it names the shapes (so that lazy mode runs the allocation as a graph of
    its own, and the first rollout's graphs are the next ones'), else, or where a layer's keys turn
    out otherwise, at the first write (the prefill, outside any capture)."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length
        self.position: torch.Tensor | None = None

    def allocate(self, config, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        """Buffers for every layer as a Llama-like `config` describes them (none otherwise)."""
        heads = getattr(config, "num_attention_heads", None)
        layers = getattr(config, "num_hidden_layers", None)
        if not (isinstance(heads, int) and isinstance(layers, int)):
            return
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        for layer in range(layers):
            for name in (f"k{layer}", f"v{layer}"):
                self._register(name, torch.zeros(rows, kv_heads, self.length, dim, dtype=dtype,
                                                 device=device))

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the new keys and values at `position`; return the whole cache of `layer_idx`."""
        cached = []
        for name, new in ((f"k{layer_idx}", key), (f"v{layer_idx}", value)):
            buffer = getattr(self, name, None)
            wanted = (*new.shape[:2], self.length, new.shape[3])
            if buffer is None or tuple(buffer.shape) != wanted or buffer.dtype != new.dtype:
                buffer = self._register(name, new.new_zeros(wanted))
            buffer.index_copy_(2, self.position, new)
            cached.append(buffer)
        return tuple(cached)

    def _register(self, name: str, buffer: torch.Tensor) -> torch.Tensor:
        # a fixed address across replays: what CUDA graphs want (transformers' static cache too)
        torch._dynamo.mark_static_address(buffer)
        self.register_buffer(name, buffer, persistent=False)
        return buffer

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Asked by models only when no position ids are given; positions here always are."""
        return 0


class DecodeStep(torch.nn.Module):
    """One forward of the model over the static cache: (B, q) tokens at their position ids,
    written at cache columns `cache_position` (q,), attending to the prompt's tokens and to every
    column up to their own; returns the (B, V) float32 logits of the last column. Prefill (q =
    bucket) runs it as it is, decoding (q = 1) through its captured graph."""

    def __init__(self, model, rows: int, bucket: int, completion: int) -> None:
        super().__init__()
        self.model, self.length = model, bucket + completion
        self.cache = KeyValueBuffers(self.length)
        self.register_buffer("keys_valid", torch.ones(rows, self.length, dtype=torch.bool,
                                                      device=_device(model)), persistent=False)
        inner = base_model(model)
        implementation = getattr(inner.config, "_attn_implementation", None) or "eager"
        if implementation not in BOOLEAN_MASKS + ("eager",):
            raise InputError(f"static generation needs attention implementation sdpa or eager "
                             f"(it makes the 4-D mask itself); the model uses {implementation!r}")
        self.additive, self.mask_dtype = mask_kind(model)
        self.cache.allocate(inner.config, rows, self.mask_dtype, _device(model))
        names = _forward_parameters(inner)
        self.cache_name = "cache" if "cache" in names else "past_key_values"  # 5.x renamed it
        self.keep_last = {"logits_to_keep": 1} if "logits_to_keep" in names else {}
        if getattr(inner.config, "output_router_logits", False):
            # a mixture of experts' router loss over the cache-length mask is transformers' own
            # (a shape error here), and a decode step needs no loss
            self.keep_last["output_router_logits"] = False

    def set_prompt_mask(self, prompt_mask: torch.Tensor) -> None:
        """Which prompt columns are tokens (the completion columns always attend)."""
        self.keys_valid[:, :prompt_mask.shape[1]].copy_(prompt_mask.bool())

    def forward(self, input_ids, position_ids, cache_position, image_groups=None,
                **inputs) -> torch.Tensor:
        """`image_groups` and `inputs` (Prefill's) only in the prefill."""
        self.cache.position = cache_position
        output = self.model(input_ids=input_ids,
                            attention_mask=self._mask(cache_position, image_groups),
                            position_ids=position_ids, use_cache=True,
                            **{self.cache_name: self.cache}, **self.keep_last, **inputs)
        return output.logits[:, -1].float()

    def _mask(self, cache_position: torch.Tensor, image_groups=None) -> torch.Tensor:
        return attention_mask(self.keys_valid, cache_position, self.additive, self.mask_dtype,
                              image_groups)


def mask_kind(model) -> tuple[bool, torch.dtype]:
    """(additive, dtype) of the 4-D mask `model`'s attention takes: eager's is additive in the
    model's dtype; sdpa's and hputrain's kernel's are boolean."""
    inner = base_model(model)
    implementation = getattr(inner.config, "_attn_implementation", None) or "eager"
    return implementation == "eager", getattr(inner, "dtype", torch.float32)


def attention_mask(keys_valid: torch.Tensor, positions: torch.Tensor, additive: bool,
                   dtype: torch.dtype, image_groups: torch.Tensor | None = None) -> torch.Tensor:
    """(B, 1, q, K), made on the device: the query at each of `positions` (q of the K columns)
    sees the valid keys (`keys_valid`, (B, K)) up to its own column, and itself always (a padding
    query with nothing to see would make softmax NaN); with `image_groups` ((B, q), the queries
    being the first q columns: a prefill), also the later tokens of its own image (Gemma 3's
    rule: group ids >= 0, equal). Given 4-D, transformers uses it as it is: it reads no 2-D mask
    back to the host to see whether it may skip it (a graph break in lazy mode)."""
    columns = torch.arange(keys_valid.shape[1], device=positions.device)
    causal = columns[None, :] <= positions[:, None]
    itself = columns[None, :] == positions[:, None]
    allowed = (keys_valid.bool()[:, None, None, :] & causal) | itself
    if image_groups is not None:
        width = keys_valid.shape[1] - image_groups.shape[1]
        keys = torch.nn.functional.pad(image_groups, (0, width), value=-1)
        same = (image_groups[:, None, :, None] == keys[:, None, None, :]) & (
            image_groups >= 0)[:, None, :, None]
        allowed = allowed | same
    if not additive:
        return allowed
    blocked = allowed.eq(False)
    return torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill(
        blocked, torch.finfo(dtype).min)


def _forward_parameters(model) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _sliding_window(model, length: int) -> None:
    """Refuse a model whose attention slides over fewer tokens than the cache: the 4-D mask made
    here is full causal attention."""
    config = getattr(base_model(model), "config", None)
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ()
    uses = getattr(config, "use_sliding_window", True) is not False
    slides = "sliding_attention" in types or (not types and uses)
    if isinstance(window, int) and window < length and slides:
        raise InputError(f"static generation attends over the whole sequence, but this model "
                         f"slides over {window} tokens; prompt + completion ({length}) must fit "
                         f"in the window")


# -- the generator ------------------------------------------------------------------------------------

@dataclass
class _Slot:
    """What one (rows, bucket) keeps between rollouts: the step with its cache, and its capture."""

    step: DecodeStep
    decode: torch.nn.Module


class StaticGenerator:
    """Rollouts of fixed shapes from a Hugging Face causal LM (a PEFT model too): see the module
    docstring. `capture` replaces `accelerator.wrap_graph_inference` (tests count captures)."""

    def __init__(self, model, accelerator, *, max_completion_length: int, eos_token_ids,
                 pad_token_id: int, buckets=DEFAULT_BUCKETS, graphs: bool = True,
                 capture=None) -> None:
        if isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int) \
                or max_completion_length < 1:
            raise InputError(f"max_completion_length must be an integer >= 1, got "
                             f"{max_completion_length!r}")
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or ())
        if not eos or not all(isinstance(i, int) for i in eos) or not isinstance(pad_token_id, int):
            raise InputError("static generation needs the end token ids (eos_token_ids) and a "
                             "pad_token_id, as integers")
        self.model, self.accelerator = model, accelerator
        self.completion, self.pad = max_completion_length, pad_token_id
        self.buckets = tuple(sorted(buckets))
        self.device = _device(model)
        self.eos = torch.tensor(eos, device=self.device)
        self.capture = (capture or accelerator.wrap_graph_inference) if graphs else (lambda m: m)
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.samplers: dict[tuple[int, Sampling], torch.nn.Module] = {}

    def _slot(self, rows: int, bucket: int) -> _Slot:
        if (rows, bucket) not in self.slots:
            step = DecodeStep(self.model, rows, bucket, self.completion)
            self.slots[rows, bucket] = _Slot(step, self.capture(step))
        return self.slots[rows, bucket]

    def _sampler(self, rows: int, sampling: Sampling) -> torch.nn.Module:
        if (rows, sampling) not in self.samplers:
            self.samplers[rows, sampling] = self.capture(Sampler(sampling))
        return self.samplers[rows, sampling]

    def prepare(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, bucket) prompt ids left-padded with pad_token_id and their mask, on the device."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise InputError("every prompt needs at least one token")
        longest = max(len(p) for p in prompts)
        limit = max_length(base_model(self.model))
        if limit is not None and longest + self.completion > limit[0]:
            raise InputError(f"a prompt of {longest} tokens + {self.completion} completion tokens "
                             f"exceeds the model's maximum of {limit[0]} (config.{limit[1]})")
        bucket = bucket_for(longest, self.buckets)
        _sliding_window(self.model, bucket + self.completion)
        ids = torch.full((len(prompts), bucket), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), bucket), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, bucket - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, bucket - len(prompt):] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling = Sampling(),
                 generator: torch.Generator | None = None,
                 prefill: Prefill | None = None) -> Rollout:
        """Completions of exactly max_completion_length tokens for `prompts` (token ids), drawn
        with `sampling` and random numbers from `generator` (torch's default one when None);
        `prefill`: what the prompts bring beside their tokens (images)."""
        sampling.check()
        prompt_ids, prompt_mask = self.prepare(prompts)
        rows, bucket = prompt_ids.shape
        slot, sample = self._slot(rows, bucket), self._sampler(rows, sampling)
        # lazy mode: the inputs (and a new slot's cache) in a graph of their own, so that the
        # first rollout's graphs are the next ones'
        self.accelerator.mark_step()
        training = self.model.training
        self.model.eval()  # no dropout in a rollout; the caller's mode comes back after
        try:
            start = time.perf_counter()
            tokens = self._run(slot, sample, sampling, generator, prompt_ids, prompt_mask,
                               prefill)
            mask = completion_mask(tokens, self.eos)
            self.accelerator.mark_step()  # the rollout's last graph, the same every time
            self.accelerator.synchronize()
            seconds = time.perf_counter() - start
        finally:
            self.model.train(training)
        return Rollout(prompt_ids, prompt_mask, tokens, mask, seconds)

    def _run(self, slot: _Slot, sample, sampling: Sampling, generator, prompt_ids,
             prompt_mask, prefill: Prefill | None = None) -> torch.Tensor:
        """Prefill, then C - 1 decode steps of the same shapes; (B, C) completion ids."""
        rows, bucket = prompt_ids.shape
        slot.step.set_prompt_mask(prompt_mask)
        # positions as transformers' generate gives them under left padding
        positions = (prompt_mask.cumsum(dim=1) - 1).clamp_min(0)
        extra = {}
        if prefill is not None:
            positions, extra = self._prefill_inputs(prefill, positions, bucket)
        seen = None
        if sampling.repetition_penalty != 1.0:  # the prompt's tokens count, its padding not
            seen = torch.zeros(rows, _vocab_size(self.model), dtype=torch.bool, device=self.device)
            seen.scatter_(1, prompt_ids, prompt_mask.bool())
        finished = torch.zeros(rows, dtype=torch.long, device=self.device)
        with self.accelerator.forward_context():
            logits = slot.step(prompt_ids, positions,
                               torch.arange(bucket, device=self.device), **extra)
        last = positions[..., -1:]  # (B, 1), or (3, B, 1): text goes on from the largest
        position = (last.amax(dim=0) if last.dim() == 3 else last) + 1
        column = torch.tensor([bucket], device=self.device)
        out = []
        for step in range(self.completion):
            uniform = None if sampling.greedy else uniform_noise(rows, logits, generator)
            token = sample(logits, seen, uniform)
            token = token + (self.pad - token) * finished  # generate's rule: pad after the end
            finished = finished | (token[:, None] == self.eos).any(dim=-1).long()
            if seen is not None:
                seen.scatter_(1, token[:, None], True)
            out.append(token)
            if step + 1 < self.completion:
                with self.accelerator.forward_context():
                    logits = slot.decode(token[:, None], position, column)
                position, column = position + 1, column + 1
            self.accelerator.mark_step()
        return torch.stack(out, dim=1)

    def _prefill_inputs(self, prefill: Prefill, positions: torch.Tensor,
                        bucket: int) -> tuple[torch.Tensor, dict]:
        """(the prefill's position ids, its other inputs): Prefill's per-prompt positions and
        image groups left-padded to the bucket (padding at position 0, in no image), its model
        inputs on the device."""
        extra = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                 for k, v in prefill.inputs.items()}
        if prefill.positions is not None:
            positions = torch.stack([_left_pad(p, bucket, 0) for p in prefill.positions], dim=-2)
            positions = positions.to(self.device)  # (B, P), or (3, B, P)
        if prefill.image_groups is not None:
            extra["image_groups"] = torch.stack(
                [_left_pad(g, bucket, -1) for g in prefill.image_groups]).to(self.device)
        return positions, extra


def _left_pad(values: torch.Tensor, length: int, value: int) -> torch.Tensor:
    """`values` (..., L) left-padded with `value` to (..., length)."""
    return torch.nn.functional.pad(values.long(), (length - values.shape[-1], 0), value=value)


def uniform_noise(rows: int, like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(rows, 1) uniform draws in (0, 1] (1 - uniform_'s [0, 1)), of `like`'s dtype on its
    device, from `generator` (torch's default one when None). A generator on another device (a
    CPU one for the CPU's lazy backend, which has none of its own) draws where it lives and the
    draws are copied over: the same numbers as in eager mode, and in lazy mode a graph input,
    not an op."""
    where = like.device if generator is None else generator.device
    drawn = 1 - torch.empty((rows, 1), dtype=like.dtype, device=where).uniform_(generator=generator)
    return drawn.to(like.device)


def _vocab_size(model) -> int:
    """The width of the logits: the output embedding's rows (config.vocab_size may be smaller
    than a resized embedding)."""
    output = base_model(model).get_output_embeddings()
    return output.weight.shape[0] if output is not None else base_model(model).config.vocab_size
