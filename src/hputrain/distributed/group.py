"""The process group, from the environment torchrun (or a user, node by node) sets:
MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK. One process is a group of one, and every
method below is then a no-op, so the trainer never branches on whether it is distributed."""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import InputError


@dataclass
class ProcessGroup:
    rank: int
    local_rank: int
    world_size: int
    backend: str | Callable[[], str]

    @classmethod
    def from_env(cls, backend: str | Callable[[], str]) -> "ProcessGroup":
        """`backend` may be a callable, asked only when there is more than one process (asking an
        accelerator for its backend may import a communication library)."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
        except ValueError as exc:
            raise InputError(f"bad distributed environment variable: {exc}") from None
        if not 0 <= rank < world:
            raise InputError(f"RANK={rank} is outside WORLD_SIZE={world}")
        return cls(rank, local_rank, world, backend)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def init(self) -> None:
        if not self.distributed or dist.is_initialized():
            return
        backend = self.backend() if callable(self.backend) else self.backend
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size)

    def wrap(self, model: torch.nn.Module, strategy: str) -> torch.nn.Module:
        """The module the training step calls: DistributedDataParallel across processes."""
        if not self.distributed or strategy == "single":
            return model
        if strategy not in ("auto", "ddp"):
            raise InputError(f"strategy {strategy!r} is not available in this version; use ddp")
        return torch.nn.parallel.DistributedDataParallel(model)

    def sync_gradients(self, wrapped: torch.nn.Module, sync: bool):
        """Skip DDP's all-reduce on micro-batches before the last one of a step."""
        if sync or not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return wrapped.no_sync()

    def all_reduce_mean(self, tensor: torch.Tensor, accelerator) -> torch.Tensor:
        if self.distributed:
            accelerator.all_reduce_mean(tensor)
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()
