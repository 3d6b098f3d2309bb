"""A module on a device, its tied weights kept tied (every strategy places the model this way)."""
from __future__ import annotations

import torch


def move_to_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to(device)`, keeping tied parameters tied.

    Moving to a device whose tensors are of another kind (lazy, Gaudi, XLA) gives each module a
    new Parameter, so a weight shared by two modules (a GPT's embedding and output layer) would
    silently become two weights that train apart. They are tied again after the move.
    """
    shared: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(param), []).append(name)
    model.to(device)
    for names in shared.values():
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, first)
    return model
