"""How gradients meet across processes: single (one process), ddp (DistributedDataParallel),
fast_ddp (no wrapper: one flat buffer of all gradients, all-reduced once per step) and fsdp
(FSDP2's sharding, fsdp.py).

A strategy is the second of three separate axes (device, strategy, precision): it asks the process
group for the mean (Gloo and HCCL have no AVG reduction) and never looks at the device.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..errors import InputError
from .group import ProcessGroup
from .placement import move_to_device


class Strategy:
    """One process: nothing to wrap, nothing to reduce."""

    name = "single"
    #: Whether each rank holds only its shards of the model and optimizer state (checkpoints are
    #: then written shard by shard).
    shards_state = False
    #: Whether a forward of the wrapped model talks to the other ranks (fsdp gathers weights,
    #: DDP broadcasts buffers): evaluation then runs the ranks in step, whatever their share.
    forward_is_collective = False

    def place(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The model on this rank's device, before `wrap`."""
        return move_to_device(model, device)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the training step calls."""
        return model

    def place_frozen(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """A frozen model called beside the trained one (DPO's reference), ready to call: on the
        device, nothing to wrap (no gradient to reduce)."""
        return move_to_device(model, device)

    def gradient_sync(self, module: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Entered around a micro-batch's backward; `sync` is True on the step's last one."""
        return contextlib.nullcontext()

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """After the last micro-batch's backward: make every rank's gradients the mean."""

    def clip_grad_norm(self, accelerator, parameters, max_norm: float, fused: bool | None = None):
        """Clip the gradients to a total norm of `max_norm` (the device's way); the norm before."""
        return accelerator.clip_grad_norm(parameters, max_norm, fused=fused)


class DDP(Strategy):
    """torch's DistributedDataParallel: gradients all-reduced in buckets during backward,
    skipped on the micro-batches before the last of a step."""

    name = "ddp"
    forward_is_collective = True  # rank 0's buffers (rotary frequencies ...) go to every rank

    def __init__(self, bucket_cap_mb: int | None = None, find_unused_parameters: bool = False) -> None:
        self.bucket_cap_mb, self.find_unused_parameters = bucket_cap_mb, find_unused_parameters

    def wrap(self, model):
        options = {"find_unused_parameters": self.find_unused_parameters}
        if self.bucket_cap_mb is not None:
            options["bucket_cap_mb"] = self.bucket_cap_mb
        return torch.nn.parallel.DistributedDataParallel(model, **options)

    def gradient_sync(self, module, sync):
        return contextlib.nullcontext() if sync else module.no_sync()


class FastDDP(Strategy):
    """Optimum for Intel Gaudi's fast_ddp: no wrapper and no hooks in backward. Parameters are
    broadcast from rank 0 once; after the last micro-batch's backward all gradients are packed
    into one flat buffer (bf16 if asked), all-reduced and averaged in a single collective, and
    unpacked. Every trainable parameter must get a gradient every step."""

    name = "fast_ddp"

    def __init__(self, group: ProcessGroup, bf16_gradients: bool = False) -> None:
        self.group, self.bf16_gradients = group, bf16_gradients

    def wrap(self, model):
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        return model

    def reduce_gradients(self, model):
        params = [p for p in model.parameters() if p.requires_grad]
        missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
        if missing:
            raise InputError(f"fast_ddp needs a gradient for every trainable parameter; none for "
                             f"{', '.join(missing[:3])}: freeze them or use strategy='ddp'")
        grads = [p.grad for p in params]
        dtype = torch.bfloat16 if self.bf16_gradients else grads[0].dtype
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        self.group.all_reduce_mean(flat)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
