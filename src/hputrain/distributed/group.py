"""The process group, from the environment torchrun (or a user, node by node) sets:
MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK. One process is a group of one, and every
method below is then a no-op, so the trainer never branches on whether it is distributed."""
from __future__ import annotations

import datetime
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
    restarts: int = 0  # how often torchrun has restarted the job (TORCHELASTIC_RESTART_COUNT)
    cp_size: int = 1  # context-parallel group size: the mesh is data-parallel × context-parallel
    cp_group: object = None  # this rank's context-parallel process group, once initialised
    host_group: object = None  # Gloo over all ranks, for small host values (see host_sum)

    @classmethod
    def from_env(cls, backend: str | Callable[[], str]) -> "ProcessGroup":
        """`backend` may be a callable, asked only when there is more than one process (asking an
        accelerator for its backend may import a communication library)."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
            rank = int(os.environ.get("RANK", "0"))
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        except ValueError as exc:
            raise InputError(f"bad distributed environment variable: {exc}") from None
        if not 0 <= rank < world:
            raise InputError(f"RANK={rank} is outside WORLD_SIZE={world}")
        if world > 1:
            _check_rendezvous_env(world)
        return cls(rank, local_rank, world, backend, restarts)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # The mesh: rank = dp_rank * cp_size + cp_rank, so a context-parallel group is consecutive
    # ranks (one node, where they can be). Ranks of one cp group train on the same samples.
    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    def set_context_parallel(self, size: int) -> None:
        if size > 1 and self.world_size % size:
            raise InputError(f"WORLD_SIZE={self.world_size} is not a multiple of context_parallel_size="
                             f"{size}: the processes form a data-parallel × context-parallel mesh")
        self.cp_size = size

    def init(self, timeout_seconds: int = 1800) -> None:
        """Join the process group. A collective that waits longer than `timeout_seconds` (a
        rank died without the launcher noticing) fails instead of hanging."""
        if not self.distributed or dist.is_initialized():
            return
        backend = self.backend() if callable(self.backend) else self.backend
        timeout = datetime.timedelta(seconds=timeout_seconds)
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=timeout,
                                store=self._attempt_store(timeout))
        # Host values (a step's token count, a stop request) meet on Gloo whatever the device's
        # backend: no device sync, and a collective every rank reaches at the same point.
        gloo = dist.Backend.GLOO
        self.host_group = dist.new_group(backend=gloo) if backend != gloo else dist.group.WORLD
        if self.cp_size > 1:
            for first in range(0, self.world_size, self.cp_size):  # every rank makes every group
                group = dist.new_group(list(range(first, first + self.cp_size)))
                if first == self.dp_rank * self.cp_size:
                    self.cp_group = group

    def _attempt_store(self, timeout):
        """Under torch's elastic agent, its store with a prefix per attempt. The agent keeps one
        store across restarts (static rendezvous), so after a restart the ranks would read the
        addresses the failed attempt's ranks published and wait on dead ports."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None  # env:// as usual
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    is_master=False, timeout=timeout)
        return dist.PrefixStore(f"hputrain/attempt_{self.restarts}", agent_store)

    def all_reduce_mean(self, tensor: torch.Tensor, accelerator) -> torch.Tensor:
        if self.distributed:
            accelerator.all_reduce_mean(tensor)
        return tensor

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def host_sum(self, values: list[float]) -> list[float]:
        """Each of `values` summed over all ranks, on the host (one small Gloo all-reduce)."""
        if not self.distributed:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.host_group)
        return tensor.tolist()

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _check_rendezvous_env(world: int) -> None:
    """A process of a multi-process run finds the others through MASTER_ADDR and MASTER_PORT
    (torchrun and `hputrain launch` set both): one line when they are missing or not a port."""
    from .launch import check_port

    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise InputError(f"WORLD_SIZE={world} is set, but {' and '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not: start the processes with "
                         f"`hputrain launch`, or set MASTER_ADDR and MASTER_PORT on every node")
    check_port(os.environ["MASTER_PORT"], "MASTER_PORT")
