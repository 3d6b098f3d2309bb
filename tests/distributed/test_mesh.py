"""The process mesh (dp_replicate × dp_shard × cp on torch's DeviceMesh) and the comms facts of
the process group: its layout against DeviceMesh's, in-process on torch's fake backend and through
`hputrain launch` on Gloo; a mean on Gloo never asks for AVG, whatever the device's own backend."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hputrain.distributed import MeshDims, ProcessGroup
from hputrain.distributed.group import has_avg
from hputrain.errors import InputError

ROOT = Path(__file__).parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HPUTRAIN_CONFIG_FILE": "/nonexistent/hputrain.json"}


# -- the layout, in one process ------------------------------------------------------------------

def test_layout_of_four_ranks_with_cp2():
    dims = MeshDims(world_size=4, cp=2)
    assert dims.shape == (2, 1, 2) and (dims.dp_replicate, dims.dp) == (2, 2)
    # rank = dp_rank * cp + cp_rank, as before the mesh: cp groups are consecutive ranks
    assert [(dims.dp_rank(r), dims.cp_rank(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    with pytest.raises(InputError, match="WORLD_SIZE=6 is not a multiple of context_parallel_size=2 × dp_shard=2"):
        MeshDims(world_size=6, cp=2, dp_shard=2)


def _fake_meshes(dims: MeshDims):
    """(rank, its DeviceMesh) for every rank of `dims`, each built in this process on torch's fake
    backend, which creates groups without talking to any other process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    for rank in range(dims.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
        try:
            yield rank, dims.build("cpu")
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("cp, dp_shard", [(2, 1), (1, 2), (2, 2)])
def test_the_device_mesh_is_the_layout(cp, dp_shard):
    dims = MeshDims(world_size=8, cp=cp, dp_shard=dp_shard)
    for rank, mesh in _fake_meshes(dims):
        assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "cp")
        assert mesh.shape == dims.shape and mesh.mesh.flatten().tolist() == list(range(8))
        assert tuple(mesh.get_coordinate()) == dims.coordinate(rank)
        first = dims.dp_rank(rank) * cp
        assert dist.get_process_group_ranks(mesh["cp"].get_group()) == list(range(first, first + cp))
        # the 2-D (replicate × shard) mesh hybrid sharding takes
        hybrid = mesh["dp_replicate", "dp_shard"]
        assert hybrid.shape == (dims.dp_replicate, dp_shard) and rank in hybrid.mesh
        assert hybrid.mesh.flatten().tolist() == [d * cp + dims.cp_rank(rank) for d in range(dims.dp)]


def test_one_process_is_a_group_of_one(monkeypatch):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    group = ProcessGroup.from_env(lambda: pytest.fail("one process asks for no backend"))
    group.set_context_parallel(1)
    group.init(10, "cpu")
    tensor = torch.tensor([3.0])
    assert group.all_reduce_mean(tensor) is tensor and tensor.item() == 3.0
    assert group.host_sum([2, 1]) == [2, 1] and group.all_reduce_sum(tensor).item() == 3.0
    group.barrier()
    assert not dist.is_initialized() and group.mesh is None and group.cp_group is None
    assert (group.dp_rank, group.dp_size, group.cp_rank, group.cp_size) == (0, 1, 0, 1)


def test_only_nccl_has_avg():
    assert has_avg(dist.Backend.NCCL)
    assert not any(has_avg(name) for name in (dist.Backend.GLOO, "hccl", dist.Backend.MPI, "cpu:gloo,cuda:nccl"))


# -- the trainer's group on Gloo, with a device whose own backend is NCCL --------------------------

def _nccl_device():
    """A CUDA accelerator as the trainer sees it (its default backend is NCCL), whose tensors
    live on the CPU so that this machine can run it."""
    from hputrain.accelerators.cuda import CUDAAccelerator

    class NcclDevice(CUDAAccelerator):
        def setup(self, local_rank=0):
            return torch.device("cpu")

        def native_bf16(self):
            return False

        def bf16_shortfall(self):
            return None

    return NcclDevice()


def _gloo_mean_worker(rank, world, port, output_dir, out):
    from hputrain import Trainer, TrainingArguments
    from hputrain.distributed import FastDDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank))
    ops, all_reduce = [], dist.all_reduce

    def recorded(tensor, op=dist.ReduceOp.SUM, **kwargs):
        ops.append(str(op))
        return all_reduce(tensor, op=op, **kwargs)

    dist.all_reduce = recorded
    model = torch.nn.Linear(2, 1)
    args = TrainingArguments(output_dir=output_dir, ddp_backend="gloo", strategy="fast_ddp", ddp_timeout=60)
    trainer = Trainer(model, args, accelerator=_nccl_device())
    values = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    trainer.group.all_reduce_mean(values)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank))
    FastDDP(trainer.group).reduce_gradients(model)
    out[rank] = {"mean": values.tolist(), "grads": [p.grad.flatten().tolist() for p in model.parameters()],
                 "ops": ops, "backend": dist.get_backend()}
    dist.barrier()
    dist.destroy_process_group()


def test_mean_on_gloo_is_sum_over_world_even_on_a_nccl_device(tmp_path):
    """ddp_backend="gloo" on a device whose own backend is NCCL: the mean is a SUM divided by the
    world size, never AVG (which Gloo refuses); the loss log and fast_ddp's gradients alike."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_gloo_mean_worker, args=(2, port, str(tmp_path), out), nprocs=2)
    for rank in (0, 1):
        assert out[rank]["backend"] == dist.Backend.GLOO
        assert out[rank]["mean"] == [1.5, 15.0]
        assert out[rank]["grads"] == [[0.5, 0.5], [0.5]]
        assert out[rank]["ops"] and not any("AVG" in op for op in out[rank]["ops"]), out[rank]["ops"]


# -- the mesh as the trainer builds it, through `hputrain launch` ---------------------------------

def launch_mesh(tmp_path, nproc, *sizes):
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "launch", "--nproc-per-node", str(nproc),
                           str(ROOT / "tests" / "mesh_script.py"), str(tmp_path), *map(str, sizes)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.slow  # 10-23 s; `make test-slow` runs it (keeps `make test` near 20 minutes)
def test_mesh_of_four_processes_with_cp2(tmp_path):
    ranks = launch_mesh(tmp_path, 4, 2)
    for rank, facts in enumerate(ranks):
        assert facts["names"] == ["dp_replicate", "dp_shard", "cp"] and facts["shape"] == [2, 1, 2]
        assert facts["coordinate"] == facts["dims_coordinate"] == [rank // 2, 0, rank % 2]
        assert facts["dp"] == [rank // 2, 2] and facts["cp"] == [rank % 2, 2]
        assert facts["cp_group"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert facts["cp_local_rank"] == rank % 2
        assert facts["replicate_by_shard"] == [[rank % 2], [2 + rank % 2]]
        assert facts["mean"] == [2.5, 25.0]  # (1 + 2 + 3 + 4) / 4
        pair = rank - rank % 2 + 1.5  # the mean of ranks r and r + 1, plus one
        assert facts["cp_mean"] == [pair, 10 * pair]
        assert facts["host_sum"] == [6, 4]
        # ddp_timeout (60 s here) on every group, the mesh's sub-groups included, not torch's 30 min
        assert facts["timeouts"] == {name: 60 for name in ("dp_replicate", "dp_shard", "cp", "default", "host")}


@pytest.mark.slow
def test_mesh_of_eight_processes_replicate_by_shard_by_cp(tmp_path):
    ranks = launch_mesh(tmp_path, 8, 2, 2)
    for rank, facts in enumerate(ranks):
        assert facts["shape"] == [2, 2, 2] and facts["coordinate"] == facts["dims_coordinate"]
        assert facts["dp"] == [rank // 2, 4]
        assert facts["replicate_by_shard"] == [[rank % 2, 2 + rank % 2], [4 + rank % 2, 6 + rank % 2]]
        assert set(facts["timeouts"].values()) == {60}
