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



def target_fp8(name: str) -> str | None:
    """How the planned device runs fp8 matrix products: "native" on fp8 matrix units (Gaudi 2
    and 3, Hopper GPUs), "emulated" in wider types (this machine's CPU, where torch has the
    kernel: a rehearsal, never a speed-up), or None where a run refuses fp8 (an A100)."""
    from .cpu import CPUAccelerator
    from .cuda import CAPABILITY, has_fp8_units as gpu_has_fp8
    from .hpu import MEMORY_BYTES as GAUDIS, has_fp8_units as gaudi_has_fp8

    if name in GAUDIS:
        return "native" if gaudi_has_fp8(name) else None
    if name in CAPABILITY:
        return "native" if gpu_has_fp8(CAPABILITY[name]) else None
    if name != "cpu":
        return None
    cpu = CPUAccelerator()
    return "native" if cpu.native_fp8() else "emulated" if cpu.supports_fp8() else None


def target_fp8_peak_gain(name: str) -> float | None:
    """The planned device's published dense fp8 peak over its bf16 one, where both are known
    (2.0 on an H100 or H200); None elsewhere, and where it has no fp8 matrix units."""
    import torch

    from .cuda import CAPABILITY, published_peak_flops

    if name not in CAPABILITY or target_fp8(name) != "native":
        return None
    fp8, bf16 = (published_peak_flops(name, dtype) for dtype in (torch.float8_e4m3fn, torch.bfloat16))
    return fp8 / bf16 if fp8 and bf16 else None


def fp8_targets() -> list[str]:
    """The planned devices with fp8 matrix units: what an emulated fp8 run rehearses."""
    return [name for name in target_memory() if target_fp8(name) == "native"]
