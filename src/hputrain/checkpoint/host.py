"""The model's tensors on the host (the CPU), each once: what every writer of weights starts from.

Device tensors (lazy ones above all) cannot be serialised where they are, a sharded model's
parameters (fsdp's DTensors) must be gathered first, and safetensors refuses two names for one
tensor (a tied weight: an embedding shared with the output layer). Three views serve the writers:
- `model_state`: this process's tensors, each once under its first name, and apart from them the
  layers' extra state (not tensors; fp8 scaling), for FullState (full.py);
- `gathered_state`: the whole tensors, gathered onto the main rank when the model is sharded, a
  tied weight one tensor under both names, for the libraries' writers (export.py) and for the
  files a sharded checkpoint writes whole (sharded.py);
- `each_once`: such a state with each tensor once, as safetensors takes it.
"""
from __future__ import annotations

import torch

EXTRA_SUFFIX = "_extra_state"  # the suffix torch gives layers' get_extra_state() in state_dict()

STATE_VIEWS = "hputrain_state_views"
"""The attribute under which a model whose parameters are this rank's part of larger tensors
without being DTensors (expert parallelism's experts, kinds/moe/expert_parallel.py) carries
their views: `names` (state-dict names), `whole(tensor)` (a DTensor of the whole tensor over
`tensor`'s storage) and `local(tensor)` (back). Checkpoints (DCP) save and reshard them as
fsdp's shards, and the writers of whole weights gather them."""


def whole_views(model: torch.nn.Module, state: dict) -> dict:
    """`state` (by state-dict name) with the tensors the model's STATE_VIEWS name seen whole."""
    views = getattr(model, STATE_VIEWS, None)
    if views is None:
        return state
    return {name: views.whole(value.detach()) if name in views.names else value
            for name, value in state.items()}


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module that owns the weights, under DDP (`.module`) and torch.compile (`._orig_mod`)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None:
            inner = getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def on_cpu(obj):
    """`obj` with every tensor copied to the CPU: device tensors (lazy ones above all) cannot be
    serialised where they are."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {key: on_cpu(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_cpu(value) for value in obj)
    return obj


def model_state(model: torch.nn.Module,
                trainable_only: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """The model's tensors on the CPU, each once (a tied weight under its first name; loading
    fills in the others), and apart from them the layers' extra state (names ending in
    EXTRA_SUFFIX). `trainable_only` keeps the parameters that require grad, named as
    `checks.trainable_names` names them."""
    seen, tensors, extra = set(), {}, {}
    for name, value in model.state_dict(keep_vars=True).items():
        if name.endswith(EXTRA_SUFFIX):
            extra[name] = on_cpu(value)
        elif trainable_only and not (isinstance(value, torch.nn.Parameter) and value.requires_grad):
            continue
        elif id(value) not in seen:
            seen.add(id(value))
            tensors[name] = value.detach().cpu().contiguous()
    return tensors, extra


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether parameters are DTensors (fsdp's shards): the state must then be gathered."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in model.parameters())


def gathered_state(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's tensors, whole and on the CPU, by state-dict name; non-tensor extra state
    (fp8 scaling) is left out. A sharded model is gathered onto the main rank, one tensor at a
    time (every rank calls this; the others get an empty dict). A tied weight stays one tensor
    under both names (`each_once` keeps one). `trainable_only` keeps parameters that require
    grad (a PEFT model's adapter), so a frozen base is never gathered."""
    if getattr(model, STATE_VIEWS, None) is not None:  # split experts: gathered onto the main rank
        import torch.distributed as dist

        main, state = dist.get_rank() == 0, {}
        mine = {name: value for name, value in model.state_dict(keep_vars=True).items()
                if isinstance(value, torch.Tensor) and (value.requires_grad or not trainable_only)}
        for name, value in whole_views(model, mine).items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            if main:
                state[name] = value.detach().cpu()
        return state
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True,
                                   ignore_frozen_params=trainable_only)
        state = get_model_state_dict(model, options=options)
        return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
    on_host, state = {}, {}
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor) or (trainable_only and not value.requires_grad):
            continue
        if id(value) not in on_host:
            on_host[id(value)] = value.detach().cpu()
        state[name] = on_host[id(value)]
    return state


def each_once(state: dict) -> dict[str, torch.Tensor]:
    """The tensors of a full state dict for safetensors: a tied weight (the same tensor under a
    second name, as an unsharded model gives it) under its first name only, as FullState writes
    it; any other tensor sharing memory copied."""
    tensors, seen = {}, {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        value = value.detach()
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if key in seen:
            continue
        shared = any(ptr == key[0] for ptr, _, _ in seen)
        tensors[name] = value.clone() if shared else value.contiguous()
        seen[key] = name
    return tensors
