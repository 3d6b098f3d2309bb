"""Activation checkpointing: a block keeps only its inputs for backward and recomputes the rest.

`gradient_checkpointing=True` (the Hugging Face name) checkpoints every transformer block (see
blocks.py), `gradient_checkpointing_every=K` every K-th one, with torch.utils.checkpoint,
non-reentrant. A Hugging Face model turns its own checkpointing on (gradient_checkpointing_enable,
which also makes the embeddings' output need a gradient where PEFT freezes them); any other model
has each chosen block's `forward` replaced on the instance, so parameter names and state_dict keys
stay as they were and a checkpoint loads with or without checkpointing.

Both paths call `checkpoint` below, which adds two things to torch.utils.checkpoint:

- the recomputation runs under the torch-function modes the forward ran under (lazy mode's
  backend-gap replacements, op-list autocast, context-parallel attention), which backward, outside
  the trainer's forward context, would otherwise run without;
- a device torch has no module for (the CPU's lazy tensors: there is no `torch.lazy`) cannot have
  its RNG stashed by torch.utils.checkpoint, which looks the module up and fails. Such a device
  draws its random numbers from the CPU generator, so its tensors are handed over in a closure:
  torch.utils.checkpoint then sees no device tensor and stashes the CPU generator's state.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils import checkpoint as torch_checkpoint

from ..config.sections import ActivationCheckpointing
from ..errors import InputError
from .blocks import block_modules, every


def apply_activation_checkpointing(model: nn.Module, settings: ActivationCheckpointing) -> list[nn.Module]:
    """Checkpoint `model`'s blocks as `settings` ask; return the checkpointed
    blocks. A Hugging Face model whose checkpointing its script already turned on gets
    `checkpoint` below in place of torch's, so that it runs in lazy mode too."""
    if not settings.gradient_checkpointing:
        _route_through_checkpoint(model)
        return []
    blocks = block_modules(model, settings.fsdp_block_classes)
    if not blocks:
        raise InputError(f"gradient_checkpointing=True, but {type(model).__name__} has no "
                         "transformer blocks hputrain can find: name their class in "
                         "fsdp_block_classes")
    chosen = every(blocks, settings.gradient_checkpointing_every)
    # the model's own switch where each block has one (a Hugging Face GradientCheckpointingLayer)
    own = _has_own_checkpointing(model) and all(hasattr(b, "gradient_checkpointing") for b in blocks)
    if own:
        _enable_own_checkpointing(model)
    for block in blocks:
        if own:
            block.gradient_checkpointing = any(block is c for c in chosen)
        elif any(block is c for c in chosen):
            checkpoint_block(block)
    return chosen


def checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint.checkpoint(function, *args, **kwargs), non-reentrant, with the two
    additions in this module's docstring."""
    modes = () if torch.compiler.is_compiling() else tuple(_get_current_function_mode_stack())
    function = _Region(function, modes)
    if not _rng_stashable(args):
        function, args = functools.partial(function, *args), ()
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def checkpoint_block(module: nn.Module) -> None:
    """Recompute `module`'s activations in backward: its forward is replaced on the instance."""
    if not isinstance(module.__dict__.get("forward"), CheckpointedForward):
        module.forward = CheckpointedForward(module)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `module` recomputes its activations in backward (either way of checkpointing)."""
    return (isinstance(module.__dict__.get("forward"), CheckpointedForward)
            or getattr(module, "gradient_checkpointing", False) is True)


class CheckpointedForward:
    """A module's forward, checkpointed in training with gradients on. An object, not a closure,
    so that copy.deepcopy and pickle of the module carry it to the copy."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args, **kwargs):
        module = self.module
        forward = type(module).forward.__get__(module)
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, **kwargs)


# -- pieces ----------------------------------------------------------------------------------------

class _Region:
    """The checkpointed function: its first call is the forward, any later one the recomputation
    in backward, which runs under the torch-function modes of the forward that are missing from
    the stack then (outermost first), with `recomputing()` true."""

    def __init__(self, function, modes: tuple) -> None:
        self.function, self.modes, self.calls = function, modes, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            return self.function(*args, **kwargs)
        current = _get_current_function_mode_stack() if self.modes else ()
        token = _RECOMPUTING.set(True)
        try:
            with contextlib.ExitStack() as stack:
                for mode in self.modes:
                    if not any(mode is active for active in current):
                        stack.enter_context(mode)
                return self.function(*args, **kwargs)
        finally:
            _RECOMPUTING.reset(token)


_RECOMPUTING = contextvars.ContextVar("hputrain_recomputing", default=False)


def recomputing() -> bool:
    """Whether the code running is a checkpointed region's recomputation in backward: a layer
    that records state in its forward (fp8's amax history) must not record it twice."""
    return _RECOMPUTING.get()


def _rng_stashable(args) -> bool:
    """Whether torch.utils.checkpoint can stash the RNG of every device among the tensors in
    `args`: it looks up torch.<device type> for it."""
    devices = {value.device.type for value in _tensors(args)} - {"cpu", "meta"}
    return all(hasattr(torch, device) for device in devices)


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)
        elif isinstance(value, dict):
            yield from _tensors(value.values())


def _has_own_checkpointing(model: nn.Module) -> bool:
    """A Hugging Face model (or a PEFT wrapper of one) that checkpoints its own layers."""
    return (callable(getattr(model, "gradient_checkpointing_enable", None))
            and bool(getattr(model, "supports_gradient_checkpointing", False)))


def _enable_own_checkpointing(model: nn.Module) -> None:
    """The model's own gradient_checkpointing_enable (by its newer name where it has one), then
    `checkpoint` below as the function its layers call."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = checkpoint


def _route_through_checkpoint(model: nn.Module) -> None:
    """Layers whose own checkpointing is on with torch's checkpoint (as gradient_checkpointing_
    enable() sets it) call `checkpoint` below instead: the same, and it runs in lazy mode."""
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        torch_func = isinstance(func, functools.partial) and func.func is torch_checkpoint.checkpoint
        if torch_func or func is torch_checkpoint.checkpoint:
            module._gradient_checkpointing_func = checkpoint
