"""The process layout: a dp_replicate × dp_shard × cp grid of ranks, and the DeviceMesh over it.

Ranks are laid out row-major over (dp_replicate, dp_shard, cp), torch's DeviceMesh order, so that

    rank = (replicate_rank * dp_shard + shard_rank) * cp + cp_rank = dp_rank * cp + cp_rank

A context-parallel group is consecutive ranks (one node, where they can be); the ranks of one cp
group train on the same samples. dp_shard is the fsdp strategy's: ranks that hold one shard each
of the model state (1 until a strategy asks for more). dp_replicate × dp_shard ranks see
different samples; gradients meet over all ranks (dp_replicate × dp_shard × cp).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

from ..errors import InputError

#: The mesh's dimension names, outermost first (torchtitan's ParallelDims names).
DIM_NAMES = ("dp_replicate", "dp_shard", "cp")


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshDims:
    """How the processes are split; dp_replicate is what the world leaves to it."""

    world_size: int
    """All processes of the job."""
    cp: int = 1
    """Context-parallel degree: the ranks that split each sequence between them."""
    dp_shard: int = 1
    """Data-parallel ranks that shard the model state between them (fsdp); 1: no sharding."""

    def __post_init__(self) -> None:
        if self.world_size % (self.cp * self.dp_shard):
            split = f"context_parallel_size={self.cp}"
            if self.dp_shard > 1:
                split += f" × dp_shard={self.dp_shard}"
            raise InputError(f"WORLD_SIZE={self.world_size} is not a multiple of {split}: the processes "
                             "form a dp_replicate × dp_shard × cp mesh")

    @property
    def dp_replicate(self) -> int:
        """Data-parallel ranks that each hold the whole model state (ddp, fast_ddp, hybrid fsdp)."""
        return self.world_size // (self.cp * self.dp_shard)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many different slices of each global batch there are."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int]:
        """The sizes of DIM_NAMES."""
        return self.dp_replicate, self.dp_shard, self.cp

    def dp_rank(self, rank: int) -> int:
        """Which slice of the global batch `rank` trains on."""
        return rank // self.cp

    def cp_rank(self, rank: int) -> int:
        """Which slice of each sequence `rank` holds."""
        return rank % self.cp

    def coordinate(self, rank: int) -> tuple[int, int, int]:
        """`rank`'s place in the mesh, as DeviceMesh.get_coordinate() gives it."""
        return self.dp_rank(rank) // self.dp_shard, self.dp_rank(rank) % self.dp_shard, self.cp_rank(rank)

    def build(self, device_type: str, timeout: datetime.timedelta | None = None):
        """The DeviceMesh of this layout (a collective: every rank calls it, in the same order),
        with one process group per dimension, on the default group's backend, whose collectives
        fail after `timeout` (torch's default when None). Ask it for groups and sub-meshes by
        name: mesh["cp"].get_group(), mesh["dp_replicate", "dp_shard"]."""
        from torch.distributed.device_mesh import init_device_mesh  # imports DTensor: not before use

        # A dimension over every rank is the default group itself (already with the job's
        # timeout); DeviceMesh creates the others with torch's default timeout unless their
        # options carry one.
        options = None if timeout is None else _group_options(timeout)
        overrides = {name: options for name, size in zip(DIM_NAMES, self.shape)
                     if options is not None and size < self.world_size}
        return init_device_mesh(device_type, self.shape, mesh_dim_names=DIM_NAMES,
                                backend_override=overrides or None)


def _group_options(timeout: datetime.timedelta):
    """Options for a new group on the default group's backend that carry `timeout`: NCCL takes
    only its own Options class; Gloo and the others read nothing from them but the timeout.
    None for a group of several backends ("cpu:gloo,cuda:nccl"), whose options torch cannot take."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import Backend as BackendBase

    backend = dist.get_backend()
    if "," in backend or ":" in backend:
        return None
    if backend == dist.Backend.NCCL:
        options = dist.ProcessGroupNCCL.Options()
    else:
        options = BackendBase.Options(backend)
    options._timeout = timeout
    return options
