"""The process group, from the environment torchrun (or a user, node by node) sets:
MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, and the DeviceMesh over it (mesh.py).
One process is a group of one, and every method below is then a no-op (no process group is
initialised), so the trainer never branches on whether it is distributed."""
from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..errors import InputError
from .failure import watch
from .mesh import MeshDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ProcessGroup:
    """This process's place in the job, the mesh of all of them, and the collectives the trainer
    and the strategies use. What the backend can do is decided from the backend in use."""

    rank: int
    """This process's global rank."""
    local_rank: int
    """Its rank on this node: the device it drives."""
    world_size: int
    """All processes of the job."""
    backend: str | Callable[[], str]
    """The backend asked for (ddp_backend, else the accelerator's); a callable is asked only when
    there is more than one process (asking an accelerator may import a communication library)."""
    restarts: int = 0
    """How often torchrun has restarted the job (TORCHELASTIC_RESTART_COUNT)."""
    dims: MeshDims = field(init=False)
    """The layout, dp_replicate × dp_shard × cp: set before `init`, fixed after it."""
    mesh: DeviceMesh | None = field(default=None, init=False)
    """The DeviceMesh over `dims`, once `init` has joined the processes (None for one process)."""
    host_group: object = field(default=None, init=False)
    """Gloo over all ranks, for small host values (see host_sum)."""

    def __post_init__(self) -> None:
        self.dims = MeshDims(world_size=self.world_size)

    @classmethod
    def from_env(cls, backend: str | Callable[[], str]) -> ProcessGroup:
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

    # -- the layout (see mesh.py) ----------------------------------------------------------------
    def set_context_parallel(self, size: int) -> None:
        self._set_dims(cp=size)

    def set_dp_shard(self, size: int) -> None:
        """Shard the model state over `size` data-parallel ranks (fsdp); the others replicate it."""
        self._set_dims(dp_shard=size)

    def _set_dims(self, **sizes: int) -> None:
        if self.mesh is not None:
            raise RuntimeError("the process layout is fixed once the processes have joined (init)")
        self.dims = replace(self.dims, **sizes)

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        return self.dims.cp_rank(self.rank)

    @property
    def cp_group(self):
        """This rank's context-parallel process group (None before `init` or for one process)."""
        return None if self.mesh is None else self.mesh["cp"].get_group()

    # -- joining ---------------------------------------------------------------------------------
    def init(self, timeout_seconds: int = 1800, device_type: str = "cpu") -> None:
        """Join the process group (unless the program already has) and build the mesh on
        `device_type`, the training device's type. A collective on any group of the job (the
        default one, each mesh dimension's, the host group) that waits longer than
        `timeout_seconds` (a rank died without the launcher noticing) fails instead of hanging."""
        if not self.distributed or self.mesh is not None:
            return
        timeout = datetime.timedelta(seconds=timeout_seconds)
        if not dist.is_initialized():
            backend = self.backend() if callable(self.backend) else self.backend
            dist.init_process_group(backend, rank=self.rank, world_size=self.world_size, timeout=timeout,
                                    store=self._attempt_store(timeout))
            # Joined here, left here: torch warns of a group never destroyed. This does not stop
            # Gloo's threads while the mesh or FSDP still hold the groups; how a worker ends
            # without their abort at exit is entry.leave's.
            atexit.register(_leave_process_group)
        watch()  # ends this rank quietly when another fails and it is blocked in a collective (failure.py)
        self.mesh = self.dims.build(device_type, timeout)
        # Host values (a step's token count, a stop request) meet on Gloo whatever the device's
        # backend: no device sync, and a collective every rank reaches at the same point.
        gloo = dist.Backend.GLOO
        self.host_group = (dist.group.WORLD if dist.get_backend() == gloo
                           else dist.new_group(backend=gloo, timeout=timeout))

    def _attempt_store(self, timeout):
        """Under torch's elastic agent, its store with a prefix per attempt. The agent keeps one
        store across restarts (static rendezvous), so after a restart the ranks would read the
        addresses the failed attempt's ranks published and wait on dead ports."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None  # env:// as usual
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    is_master=False, timeout=timeout)
        return dist.PrefixStore(f"hputrain/attempt_{self.restarts}", agent_store)

    # -- collectives (no-ops for one process) ----------------------------------------------------
    def all_reduce_mean(self, tensor: torch.Tensor, group=None) -> torch.Tensor:
        """Average `tensor` in place over `group` (all ranks by default): one AVG all-reduce
        where the group's backend has it, else a SUM divided by the group's size."""
        if not self.distributed:
            return tensor
        if has_avg(dist.get_backend(group)):
            dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
        else:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
            tensor.div_(dist.get_world_size(group))
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

    def gather_objects(self, value) -> list:
        """Every rank's `value` (picklable host data: rewards, texts), in rank order, on every
        rank (one Gloo all-gather on the host group)."""
        if not self.distributed:
            return [value]
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value, group=self.host_group)
        return values

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def has_avg(backend: str) -> bool:
    """Whether all_reduce on `backend` (dist.get_backend's name) has ReduceOp.AVG: NCCL's does;
    Gloo, HCCL, MPI and UCC have none, nor has a mixed "cpu:gloo,cuda:nccl" group for CPU tensors."""
    return backend == dist.Backend.NCCL


def reduces_in_a_copy(backend: str | None) -> bool:
    """Whether `backend` reduces a collective's input in a copy of it, inside the collective
    (Gloo does; NCCL and HCCL reduce in place): memory a fake process group never shows, which
    `hputrain plan` adds."""
    return backend == dist.Backend.GLOO


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


def _leave_process_group() -> None:
    """At exit: destroy the process groups this process joined (no collective)."""
    if dist.is_initialized():
        dist.destroy_process_group()
