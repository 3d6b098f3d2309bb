"""Per-token log-probabilities (and entropies) of the scored positions, without the model's full
logits: what GRPO and DPO need of a forward.

`token_logps(call, module, inputs, labels)` runs the model through `call` (the Trainer's: packing,
forward context) with its output embedding (the lm_head) swapped, for that call only, for a head
that scores: for the positions from `start` on, in chunks of about `chunk` tokens, it projects the
hidden states, takes the log-softmax in float32 (after dividing by the sampling temperature, as
TRL's GRPOTrainer does) and keeps each position's label log-probability and, when asked, the
entropy of the distribution. Where there are several chunks, each runs under activation
checkpointing, so that the backward recomputes one chunk's logits at a time: the peak is one chunk's
logits, never rows x length x vocab (float32, plus autograd's copy) as with the full logits. A
single chunk (GRPO's completions, mostly) is not recomputed: its peak is one chunk's either way.
The head hands back a [rows, length, k] tensor as the model's "logits".

Why swap the head and not call it ourselves after the backbone: the head must run inside the
model's forward. Under fsdp the weights are gathered only there (and the backward gathers them
again for the recompute through the root's hooks), a PEFT wrapper may have LoRA on the head, and
the Trainer's call owns the rest of the forward. Only the head module's own `forward` attribute is
set and restored (no class of transformers is patched), and the original forward projects each
chunk, so whatever the head is (Linear, LoRA Linear, a tied embedding matrix) it computes what it
would have.

A model without a recognisable output embedding (the built-in GPT), or one whose forward scales or
soft-caps the logits after the head (Gemma 2's final_logit_softcapping, Cohere's logit_scale,
Granite's logits_scaling, ...: read from its config), takes the full logits path with the same
numbers. A model that changes the head's output in a way its config does not say is caught (its
"logits" are not what the head returned) and refused with one line.

Nothing is read back to the host and every shape is fixed by the batch's, so in lazy mode the
graph is the same every step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..distributed.activation_checkpointing import checkpoint
from ..errors import InputError
from .evaluation import logits_of
from .loss import IGNORE_INDEX

DEFAULT_CHUNK = 1024
"""Tokens per chunk: 1024 x a 32k vocabulary is 128 MiB of float32 logits (about three times that
while a chunk's softmax is taken)."""

SCALING_FIELDS = ("final_logit_softcapping", "logit_scale", "output_multiplier",
                  "lm_head_multiplier", "logits_scaling")
"""Config fields of architectures whose forward changes the logits after the head: with any of
them set (to other than 1), the full logits path."""


COPIES = ("CloneBackward0", "_DDPSinkBackward")
"""Autograd steps by which a wrapper hands the head's output back unchanged (DDP's _DDPSink)."""


@dataclass(frozen=True)
class TokenLogps:
    """Per-token results, [rows, length] float32, 0 where the position is not scored."""

    logps: torch.Tensor
    """log p(labels[:, t]) at temperature, position t predicting token t + 1."""
    entropy: torch.Tensor | None
    """The entropy (nats) of the tempered distribution at t; None unless asked for."""


def token_logps(call, module, inputs, labels: torch.Tensor, *, temperature: float = 1.0,
                entropy: bool = False, start: int = 0,
                chunk: int | None = DEFAULT_CHUNK) -> TokenLogps:
    """The log-probability (and entropy) of each scored token under `module`, run as
    `call(module, inputs)`. `labels` [rows, length]: at t the token to score there (the input's
    t + 1), or -100. Positions before `start` (a fixed number: a left-padded prompt's length) are
    not scored whatever `labels` holds, and cost nothing. `chunk`: tokens per chunk; None takes the
    full logits path."""
    _check(labels, temperature, start, chunk)
    options = dict(temperature=temperature, entropy=entropy, start=start,
                   chunk=chunk or DEFAULT_CHUNK)
    head = output_head(module) if chunk is not None else None
    if head is None:
        logits = logits_of(call(module, inputs))
        if logits.shape[:2] != labels.shape:
            raise InputError(f"the model's logits {tuple(logits.shape)} do not match the labels "
                             f"{tuple(labels.shape)} (rows, length)")
        scores = _chunked(logits, labels.to(logits.device), _as_is, **options)
    else:
        with scoring_head(head, labels, **options) as scored:
            output = call(module, inputs)
        scores = logits_of(output)
        if not scored or not _handed_back(scores, scored[-1]):
            raise InputError(f"{type(_unwrapped(module)).__name__} changes its head's output before "
                             "returning it as logits (scaling or soft-capping hputrain does not "
                             "know): score it with chunk=None (the full logits)")
    return TokenLogps(scores[..., 0], scores[..., 1] if entropy else None)


def shifted_labels(input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The labels `token_logps` takes for the tokens where `mask` is 1 (a completion mask): at t
    the token t + 1 when it is masked in, else -100 (the last position predicts nothing)."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    return labels


def output_head(module) -> torch.nn.Module | None:
    """The output embedding (lm_head) of `module`, through the DDP, torch.compile and PEFT
    wrappers (an fsdp root is the model itself); None without one, or when the model's forward
    scales or soft-caps the head's output (its config says so)."""
    model = _unwrapped(module)
    find = getattr(model, "get_output_embeddings", None)
    head = find() if callable(find) else None
    if not isinstance(head, torch.nn.Module) or _scales_logits(getattr(model, "config", None)):
        return None
    return head


@contextlib.contextmanager
def scoring_head(head: torch.nn.Module, labels: torch.Tensor, *, temperature: float,
                 entropy: bool, start: int, chunk: int):
    """Inside, `head` returns the [rows, length, 1 or 2] scores of `labels` (log-prob, entropy)
    in place of logits; yields the list its outputs are appended to. Its forward is restored on
    leaving, whatever happens inside."""
    if "forward" in vars(head) and getattr(head.forward, "_hputrain_scoring", False):
        raise InputError("token_logps is already scoring with this model: calls cannot nest")
    saved = vars(head).get("forward")  # an instance attribute of its own (accelerate's hooks)
    project = head.forward
    outputs: list[torch.Tensor] = []

    def score(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:2] != labels.shape:
            raise InputError(f"the hidden states reaching {type(head).__name__} "
                             f"{tuple(hidden.shape)} do not match the labels {tuple(labels.shape)}: "
                             "score this model with chunk=None (the full logits)")
        outputs.append(_chunked(hidden, labels.to(hidden.device), project, temperature=temperature,
                                entropy=entropy, start=start, chunk=chunk))
        return outputs[-1]

    score._hputrain_scoring = True
    head.forward = score
    try:
        yield outputs
    finally:
        if saved is None:
            del head.forward
        else:
            head.forward = saved


# -- the scoring itself ----------------------------------------------------------------------------

def _chunked(hidden: torch.Tensor, labels: torch.Tensor, project, *, temperature: float,
             entropy: bool, start: int, chunk: int) -> torch.Tensor:
    """[rows, length, k] float32 scores of `labels` from `hidden` ([rows, length, width]: hidden
    states that `project` turns into logits, or logits with `_as_is`), a slice of columns at a
    time: views, so no chunk copies its input. Each slice is checkpointed when autograd records:
    what it keeps is the slice it was given, not its logits or softmax (the project's checkpoint:
    the recomputation runs under the forward's torch-function modes, op-list autocast and lazy
    mode's replacements, and works on the CPU's lazy device)."""
    rows, length = labels.shape
    columns = max(1, chunk // max(rows, 1))
    parts = [hidden.new_zeros((rows, start, 1 + entropy), dtype=torch.float32)] if start else []
    # one chunk: what the forward keeps for the backward is what the recomputation would make at
    # the same moment (the backbone's activations are held either way), so the peak is one
    # chunk's either way and the recomputed projection would only cost time
    recompute = torch.is_grad_enabled() and length - start > columns
    for first in range(start, length, columns):
        args = (hidden[:, first:first + columns], labels[:, first:first + columns], project,
                temperature, entropy)
        if recompute:
            # no RNG in a chunk: nothing to save and restore
            parts.append(checkpoint(_scores, *args, preserve_rng_state=False))
        else:
            parts.append(_scores(*args))
    if not parts:  # start == length: nothing scored
        return hidden.new_zeros((rows, length, 1 + entropy), dtype=torch.float32)
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _scores(hidden, labels, project, temperature: float, entropy: bool) -> torch.Tensor:
    """One chunk: log_softmax(project(hidden) / temperature) in float32 at the labels (and the
    entropy), 0 where the label is -100."""
    logits = project(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logps = torch.log_softmax(logits, dim=-1)
    scored = labels != IGNORE_INDEX
    picked = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    values = [picked.masked_fill(~scored, 0.0)]
    if entropy:
        values.append(-(logps.exp() * logps).sum(-1).masked_fill(~scored, 0.0))
    return torch.stack(values, dim=-1)


def _as_is(logits: torch.Tensor) -> torch.Tensor:
    return logits


# -- helpers ---------------------------------------------------------------------------------------

def _check(labels: torch.Tensor, temperature: float, start: int, chunk: int | None) -> None:
    if labels.dim() != 2:
        raise InputError(f"labels must be [rows, length], not {tuple(labels.shape)}")
    if not temperature > 0:
        raise InputError(f"temperature must be positive, not {temperature}")
    if not 0 <= start <= labels.shape[1]:
        raise InputError(f"start {start} is outside the labels' length {labels.shape[1]}")
    if chunk is not None and chunk < 1:
        raise InputError(f"chunk must be a positive number of tokens (or None), not {chunk}")


def _unwrapped(module):
    """The model inside DDP (`.module`) and torch.compile (`._orig_mod`) wrappers. A PEFT model
    is kept: it forwards get_output_embeddings and config to its base."""
    while True:
        inner = getattr(module, "_orig_mod", None)
        if inner is None and isinstance(module, torch.nn.parallel.DistributedDataParallel):
            inner = module.module
        if not isinstance(inner, torch.nn.Module):
            return module
        module = inner


def _handed_back(returned: torch.Tensor, scores: torch.Tensor) -> bool:
    """Whether the model's "logits" are the head's scores: the very tensor, or a copy a wrapper
    made on the way out (DDP does, with find_unused_parameters or static_graph, and its copy must
    be the one the backward goes through). Told from the autograd graph: no value is read."""
    if returned is scores:
        return True
    step = returned.grad_fn
    return (returned.shape == scores.shape and step is not None and scores.grad_fn is not None
            and type(step).__name__ in COPIES
            and any(fn is scores.grad_fn for fn, _ in step.next_functions))


def _scales_logits(config) -> bool:
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return any(getattr(text, name, None) not in (None, 1, 1.0) for name in SCALING_FIELDS)
