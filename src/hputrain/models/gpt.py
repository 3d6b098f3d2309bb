"""A small GPT language model: byte-level, pre-LayerNorm, tied embeddings.

The shape follows GPT-2 (learned position embeddings, GELU MLP, weight tying), written plainly so
that each piece can be read on its own. Attention goes through one small function, `attend`, so a
context-parallel variant can replace it without touching the rest of the model, and positions can
be passed in explicitly so that a slice of a longer sequence keeps its global positions. Packed
examples (several short sequences in one row) pass positions restarting at each example and an
attention mask that keeps each to itself; without a mask the model runs sdpa's causal fast path.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError

_TIED = "lm_head.weight"  # the token embedding again (weight tying): saved once, as wte.weight
_WEIGHTS, _CONFIG = "model.safetensors", "config.json"  # the names save_pretrained gives them

IGNORE_INDEX = -100
"""Label value that `GPT.forward` leaves out of the loss."""

_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_head": 4, "n_embd": 128},
    "small": {"n_layer": 6, "n_head": 6, "n_embd": 384},
    "base": {"n_layer": 12, "n_head": 12, "n_embd": 768},  # the GPT-2 small shape
    "large": {"n_layer": 24, "n_head": 16, "n_embd": 1024},  # the GPT-2 medium shape: ~300M
}


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape and regularisation of a `GPT`; build a named size with `GPTConfig.from_size`."""

    vocab_size: int = 256
    """Number of token ids; 256 means one token per byte."""
    block_size: int = 256
    """Longest sequence the model accepts (the number of learned positions)."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide `n_embd`."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and residual branches (0 turns it off)."""
    bias: bool = False
    """Whether Linear and LayerNorm layers carry a bias."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}.")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}.")

    @classmethod
    def from_size(cls, name: str, **overrides) -> GPTConfig:
        """Return the config for a named size ("tiny", "small", "base", "large"), with fields
        overridden."""
        if name not in _SIZES:
            raise ValueError(f"Unknown GPT size {name!r}; valid sizes are {', '.join(_SIZES)}.")
        return cls(**{**_SIZES[name], **overrides})

    @classmethod
    def from_dict(cls, data: Any, max_parameters: int | None = None) -> GPTConfig:
        """A config read from a file (a checkpoint's config.json): only this class's fields, each of
        its type, sizes positive and, with `max_parameters`, a model no larger than that (so a
        hostile or mistyped file cannot make the caller allocate terabytes). Raises ValueError."""
        if not isinstance(data, dict):
            raise ValueError(f"GPTConfig must be a JSON object, got {type(data).__name__}.")
        fields = {field.name: field.type for field in dataclasses.fields(cls)}
        for name, value in data.items():
            if name not in fields:
                raise ValueError(f"GPTConfig has no field {name!r} (fields: {', '.join(fields)}).")
            if not _is_of_type(value, fields[name]):
                raise ValueError(f"GPTConfig.{name} must be of type {fields[name]}, got {value!r}.")
        config = cls(**data)
        parameters = config.num_parameters()
        if max_parameters is not None and parameters > max_parameters:
            raise ValueError(f"GPTConfig describes a model of {parameters:,} parameters "
                             f"({4 * parameters / 1e9:,.1f} GB of float32 weights), more than the "
                             f"limit of {max_parameters:,} parameters.")
        return config

    def num_parameters(self) -> int:
        """Parameters of the `GPT` this config builds (`GPT.num_parameters(non_embedding=False)`),
        counted without building it."""
        width, bias = self.n_embd, int(self.bias)
        # per block: two LayerNorms, q/k/v and output projections (4C^2), the 4x MLP (8C^2)
        block = 12 * width * width + 2 * width + bias * 11 * width
        embeddings = (self.vocab_size + self.block_size) * width  # lm_head is tied to wte
        return embeddings + self.n_layer * block + width * (1 + bias)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head


_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,)}


def _is_of_type(value: Any, annotation: str) -> bool:
    """Whether a JSON value fits a GPTConfig field annotated `annotation` (bool is no int here)."""
    if isinstance(value, bool):
        return annotation == "bool"
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, _TYPES[annotation])


AttendFn = Callable[..., torch.Tensor]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
           mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention over (batch, heads, time, head_dim) tensors: causal, or as
    `mask` allows ((batch, 1, time, time), boolean True where a key is visible, or additive).

    Without a mask, sdpa's `is_causal` flag says it all and picks its fused kernels; a mask (packed
    examples, padding) goes the masked way, which reads the (time x time) mask."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection.

    The attention itself is `self.attend` (the module-level `attend` by default), the one piece a
    context-parallel implementation needs to replace. It gets `mask=` only when a mask is given,
    so a replacement that knows only causal attention keeps working on unmasked batches.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.attend: AttendFn = attend

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Map (batch, time, n_embd) to (batch, time, n_embd), each position seeing only the past
        (or what `mask`, a (batch, 1, time, time) attention mask, allows)."""
        batch, time, width = x.shape
        # (B, T, 3C) -> three (B, n_head, T, head_dim) tensors.
        qkv = self.qkv(x).view(batch, time, 3, self.n_head, width // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        dropout_p = self.dropout if self.training else 0.0
        if mask is None:
            y = self.attend(q, k, v, dropout_p=dropout_p)
        else:
            y = self.attend(q, k, v, dropout_p=dropout_p, mask=mask)
        y = y.transpose(1, 2).reshape(batch, time, width)
        return self.resid_dropout(self.proj(y))

    def forward_cached(self, x: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor) -> torch.Tensor:
        """Inference with a static key/value cache: write this input's keys and values at their
        positions (B, T) into the (B, n_head, max_len, head_dim) caches, and attend over the whole
        cache, masked to positions at or before each query's. Every shape is fixed by the caches,
        so a decode step is the same graph at every position."""
        batch, time, width = x.shape
        qkv = self.qkv(x).view(batch, time, 3, self.n_head, width // self.n_head)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        index = positions[:, None, :, None].expand_as(k)
        k_cache.scatter_(2, index, k)
        v_cache.scatter_(2, index, v)
        key_pos = torch.arange(k_cache.shape[2], device=x.device)
        allowed = key_pos[None, None, None, :] <= positions[:, None, :, None]
        y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=allowed)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class MLP(nn.Module):
    """The position-wise feed-forward layer: widen 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the feed-forward layer to every position independently."""
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run attention (masked by `mask` when given) then the MLP, each added to the residual
        stream."""
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2 style decoder-only language model."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one matrix embeds and un-embeds
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) everywhere, residual projections scaled by 1/sqrt(2*n_layer)."""
        for module, step in self.init_steps():
            step(module)

    def init_steps(self) -> list[tuple[nn.Module, Callable[[nn.Module], None]]]:
        """The initialisation after construction as (module, step) pairs in the order they draw
        random numbers, each step touching only its module's own parameters: a model sharded on
        the meta device replays them one module at a time (distributed/fsdp.py)."""
        steps = []
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                steps.append((module, functools.partial(_normal_init, std=0.02)))
        # Each block adds two branches to the residual stream; scaling their output projections
        # keeps the stream's variance from growing with depth.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            for layer in (block.attn.proj, block.mlp.proj):
                steps.append((layer, functools.partial(_normal_init, std=residual_std, bias=False)))
        return steps

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Return {"logits": (B, T, vocab)} and, when labels are given, the mean "loss".

        `labels` has the shape of `input_ids`, already shifted (labels[:, t] is the token after
        input_ids[:, t]); positions labelled -100 are left out of the loss. `position_ids` (shape
        (T,) or (B, T)) defaults to 0..T-1; pass global positions when the input is a slice of a
        longer sequence, or positions restarting at 0 for each example packed into a row. They
        are not range-checked here (that would cost a device sync).

        `attention_mask`, as transformers takes it: None is causal attention (sdpa's fused path);
        (B, 1, T, T) is used as it is, boolean (True: may attend) or additive (0 or a large
        negative number, in the compute dtype), so it must be causal itself — packed examples
        get data.packing.block_causal_mask, which keeps each example to itself; (B, T) marks
        padding (1 or True: a real token), which no query attends to.
        """
        time = input_ids.shape[1]
        if time > self.config.block_size:
            raise ValueError(
                f"Sequence length {time} exceeds the model's block_size {self.config.block_size}."
            )
        if position_ids is None:
            position_ids = torch.arange(time, device=input_ids.device)
        mask = None if attention_mask is None else _attention_mask(attention_mask, time)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        logits = self.lm_head(self.ln_f(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = cross_entropy_loss(logits, labels)
        return out

    def save_pretrained(self, folder, state_dict: dict | None = None) -> None:
        """Write config.json (the GPTConfig's fields) and model.safetensors to `folder`, as
        transformers' save_pretrained lays a model out. The tied output layer is left out
        (safetensors refuses two names for one storage); `from_pretrained` ties it again.
        `state_dict` (default: the model's own) is what a sharded model's ranks gathered."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = self.state_dict() if state_dict is None else state_dict
        tensors = {name: value.detach().cpu().contiguous() for name, value in state.items()
                   if name != _TIED and isinstance(value, torch.Tensor)}
        save_file(tensors, str(folder / _WEIGHTS), metadata={"format": "pt"})
        (folder / _CONFIG).write_text(json.dumps(dataclasses.asdict(self.config), indent=2))

    @classmethod
    def from_pretrained(cls, folder, max_parameters: int | None = None) -> GPT:
        """The GPT that `save_pretrained` (or a full checkpoint) wrote to `folder`. A missing or
        unfit config.json or model.safetensors is one InputError line."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        folder = Path(folder)
        try:
            config = GPTConfig.from_dict(json.loads((folder / _CONFIG).read_text(encoding="utf-8")),
                                         max_parameters)
            tensors = load_file(str(folder / _WEIGHTS), device="cpu")
        except (OSError, ValueError) as exc:
            raise InputError(f"{folder} is not a saved GPT: {' '.join(str(exc).split())}") from None
        except SafetensorError as exc:  # a truncated or foreign file
            raise InputError(f"{folder / _WEIGHTS} cannot be read: {' '.join(str(exc).split())}") from None
        model = cls(config)
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        missing = [name for name in missing if name != _TIED]
        if missing or unexpected:
            raise InputError(f"{folder / _WEIGHTS} does not fit its config.json (missing: "
                             f"{', '.join(missing) or 'none'}; unexpected: "
                             f"{', '.join(unexpected) or 'none'}).")
        return model

    def new_cache(self, batch: int, max_len: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Preallocated (keys, values) per layer, each (batch, n_head, max_len, head_dim)."""
        config, param = self.config, self.wte.weight
        shape = (batch, config.n_head, max_len or config.block_size, config.head_dim)
        return [(param.new_zeros(shape), param.new_zeros(shape)) for _ in self.blocks]

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor,
               cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits (B, T, vocab) for input_ids (B, T) at `positions` (B, T), reading and extending
        the key/value `cache` (from `new_cache`): the prompt in one call, then one token a call."""
        x = self.wte(input_ids) + self.wpe(positions)
        for block, (k_cache, v_cache) in zip(self.blocks, cache):
            x = x + block.attn.forward_cached(block.ln_1(x), positions, k_cache, v_cache)
            x = x + block.mlp(block.ln_2(x))
        return self.lm_head(self.ln_f(x))

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Count parameters once each (the tied token embedding counts once).

        With non_embedding=True the position embedding is left out, as in the GPT-2/Kaplan
        convention; the token embedding stays in because it is also the output layer.
        """
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.wpe.weight.numel()
        return total

    def flops_per_token(self) -> int:
        """Training FLOPs per token by the standard 6N estimate (forward 2N, backward 4N).

        Attention's own score and weighted-sum FLOPs (which grow with sequence length) are left
        out, matching the usual model-FLOPs-utilisation (MFU) convention.
        """
        return 6 * self.num_parameters(non_embedding=True)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Extend (B, T) input_ids by max_new_tokens sampled tokens; return (B, T + max_new_tokens).

        Recomputes the whole (cropped to block_size) context every step. temperature 0 picks the
        most likely token; top_k keeps only the k most likely tokens before sampling.
        """
        check_sampling(temperature, top_k)
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                context = input_ids[:, -self.config.block_size :]
                logits = self(context)["logits"][:, -1, :]
                next_id = pick_next_token(logits, temperature, top_k)
                input_ids = torch.cat([input_ids, next_id], dim=1)
        finally:
            self.train(was_training)
        return input_ids


def _attention_mask(mask: torch.Tensor, time: int) -> torch.Tensor:
    """The (B, 1, T, T) mask sdpa takes, from a 4-D mask (as it is) or a (B, T) padding mask:
    causal, no key that is padding, and each token seeing itself, so that a padding query (left
    padding) still has one key and gives no NaN."""
    if mask.dim() == 4:
        return mask
    if mask.dim() != 2 or mask.shape[-1] != time:
        raise ValueError(f"attention_mask must be (batch, {time}) or (batch, 1, {time}, {time}), "
                         f"got {tuple(mask.shape)}.")
    causal = torch.ones(time, time, dtype=torch.bool, device=mask.device).tril()
    keys = mask.bool()[:, None, None, :]
    return (causal & keys) | torch.eye(time, dtype=torch.bool, device=mask.device)


def _normal_init(module: nn.Module, std: float, bias: bool = True) -> None:
    """N(0, std) weights and, with `bias`, zero biases."""
    nn.init.normal_(module.weight, mean=0.0, std=std)
    if bias and getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in fp32 over all positions not labelled IGNORE_INDEX."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
    )


MIN_TEMPERATURE = 1e-4
"""Smallest sampling temperature other than 0 (greedy): logits divided by much less overflow."""


def check_sampling(temperature: float, top_k: int | None) -> None:
    """Raise InputError unless `temperature` is 0 (greedy) or a finite number of at least
    MIN_TEMPERATURE, and `top_k` is None or at least 1."""
    if not (temperature == 0 or (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE)):
        raise InputError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, "
                         f"got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise InputError(f"top_k must be an integer >= 1 (or not given), got {top_k!r}")


def pick_next_token(logits: torch.Tensor, temperature: float, top_k: int | None) -> torch.Tensor:
    """Choose one token per row of (B, vocab) logits; return (B, 1) token ids."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth_best = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
