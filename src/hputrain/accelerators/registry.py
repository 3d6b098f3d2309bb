"""Which accelerators exist, in the order `auto` tries them, and how one is chosen."""
from __future__ import annotations

import importlib
import os

from ..errors import InputError
from .base import GB, Accelerator

# name -> "module:Class"; a backend's module is imported only when that backend is asked about.
ACCELERATORS = {
    "hpu": "hputrain.accelerators.hpu:HPUAccelerator",
    "cuda": "hputrain.accelerators.cuda:CUDAAccelerator",
    "mps": "hputrain.accelerators.mps:MPSAccelerator",
    "cpu": "hputrain.accelerators.cpu:CPUAccelerator",
}
FORCE_ENV = "HPUTRAIN_ACCELERATOR"


class AcceleratorNotFound(InputError):
    """A named accelerator is absent or unknown."""


def accelerator_class(name: str) -> type[Accelerator]:
    if name not in ACCELERATORS:
        raise AcceleratorNotFound(
            f"unknown accelerator {name!r}; choose one of: auto, {', '.join(ACCELERATORS)}")
    module, cls = ACCELERATORS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def available_accelerators(execution_mode: str = "auto") -> dict[str, int]:
    """kind -> device count, for every kind present on this machine."""
    found = {}
    for name in ACCELERATORS:
        accelerator = accelerator_class(name)(execution_mode)
        if accelerator.is_available():
            found[name] = accelerator.device_count()
    return found


def detect_accelerator(name: str = "auto", execution_mode: str = "auto",
                       autocast_op_lists=None, fp8_minimize_memory: bool = False) -> Accelerator:
    """The accelerator to run on: `name`, or with "auto" the first present of HPU, CUDA, MPS, CPU.

    HPUTRAIN_ACCELERATOR (set by `--cpu`) overrides `name`, as Accelerate's --cpu does.
    `autocast_op_lists` (bf16 ops, fp32 ops) and `fp8_minimize_memory` reach a runtime that reads
    them at start-up.
    """
    name = os.environ.get(FORCE_ENV) or name
    settings = (execution_mode, autocast_op_lists, fp8_minimize_memory)
    if name == "auto":
        for candidate in ACCELERATORS:
            accelerator = accelerator_class(candidate)(*settings)
            if accelerator.is_available():
                return accelerator
    accelerator = accelerator_class(name)(*settings)
    if not accelerator.is_available():
        found = ", ".join(f"{k} ({n})" for k, n in available_accelerators(execution_mode).items())
        raise AcceleratorNotFound(f"accelerator {name!r} was requested but is not available; "
                                  f"found: {found}")
    return accelerator


def target_memory() -> dict[str, int]:
    """The devices `hputrain plan` plans for, by name, and their memory in bytes (each device's
    file owns its figures; "cpu" is this machine's RAM)."""
    from .cpu import CPUAccelerator
    from .cuda import MEMORY_BYTES as GPUS
    from .hpu import MEMORY_BYTES as GAUDIS

    ram = CPUAccelerator().memory_stats()["total_memory_available_gb"] * GB
    return {**GAUDIS, **GPUS, "cpu": int(ram)}


def target_dist_backend(name: str) -> str | None:
    """The communication backend a run on the planned device uses by default (what its
    collectives copy is the plan's business); None for a name that is not a target."""
    from .cpu import CPUAccelerator
    from .cuda import CUDAAccelerator, MEMORY_BYTES as GPUS
    from .hpu import (DIST_BACKEND as GAUDI_BACKEND,
                      MEMORY_BYTES as GAUDIS)

    if name in GAUDIS:
        return GAUDI_BACKEND
    if name in GPUS:
        return CUDAAccelerator().dist_backend()
    return CPUAccelerator().dist_backend() if name == "cpu" else None


def target_is_host(name: str) -> bool:
    """Whether the planned device is the host itself (nothing to offload its memory to)."""
    return name == "cpu"


def target_runs_bf16(name: str) -> bool:
    """Whether precision "auto" means bf16 on the planned device: on every Gaudi and GPU planned
    for, and on this machine's CPU where bf16 is native."""
    from .cpu import CPUAccelerator

    return CPUAccelerator().native_bf16() if name == "cpu" else True
