"""A worker's place in the job when mpirun or srun started it, not torchrun.

torchrun (and `hputrain launch`, and `--devices N`) hand each worker RANK, WORLD_SIZE, LOCAL_RANK
and LOCAL_WORLD_SIZE. Gaudi clusters more often start one process per device with `mpirun` (Open
MPI: Intel's and Optimum's multi-node examples, Kubernetes' MPIJob), with MPICH or Intel MPI's
Hydra, or with SLURM's `srun`; each says the same in variables of its own. `adopt_launcher_env`
writes them under torchrun's names, once, where a run starts (the Trainer, the Hugging Face
recipe), so that everything below reads one set of names: the process group, fsdp's node size,
`needs_launch`. torchrun's own variables win whenever they are there.

Which launcher, in this order (an MPI started inside a SLURM allocation carries the allocation's
SLURM variables too, which describe its own daemons, not these processes):

  Open MPI   OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK / _LOCAL_SIZE
  Hydra      PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS (MPICH, Intel MPI)
  srun       SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE, SLURM_NODEID

Neither MPI names the node a process is on (OMPI_COMM_WORLD_NODE_RANK is a local rank across
jobs, not a node): NODE_RANK comes from where the rank falls, in blocks or round-robin
(`mpi_node_rank`), and is left unset where the variables do not decide it. Nothing but the
one-task-per-node form below reads it; fsdp's hybrid_shard, whose node groups are blocks of
consecutive ranks, refuses ranks placed otherwise (distributed/fsdp.py).

Only srun's job *step* variables count: a batch script itself (sbatch, no srun) also sees
SLURM_PROCID=0 and SLURM_NTASKS of the whole allocation, and is one process, not task 0 of many.

The rendezvous: MASTER_ADDR and MASTER_PORT when set; under srun, the first node of the step
and a port derived from the job id (two jobs sharing a node do not collide); under MPI on one
node, 127.0.0.1 and 29500; MPI across nodes has no variable naming node 0, so MASTER_ADDR must be
passed (`mpirun -x MASTER_ADDR=node0`), or it is one line.

One task per node with `--devices N` (`srun --ntasks-per-node=1 hputrain train --devices 8
--num-nodes 2`, or `mpirun --map-by ppr:1:node`) makes each task its node's launcher: only
NODE_RANK and the rendezvous are taken, and `--devices` starts the node's processes as it does
anywhere.
"""
from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from dataclasses import dataclass

from ..errors import InputError

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
"""Set by torchrun for each worker: when any is there, nothing here is read."""
DEFAULT_PORT = 29500
"""torchrun's default port, for MPI on one node."""
SLURM_PORTS = (20000, 10000)
"""srun's port: the first of this range plus the job id modulo its length (below Linux's
ephemeral ports, which start at 32768)."""


@dataclass(frozen=True)
class Launcher:
    """The variables one launcher sets, by what they mean."""

    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str | None
    """None: derived (srun's tasks per node come as a list, see `_slurm_local_size`)."""


LAUNCHERS = (
    Launcher("mpirun (Open MPI)", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
             "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    Launcher("mpirun (MPICH / Intel MPI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    Launcher("srun (SLURM)", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", None),
)


def detect(environ) -> Launcher | None:
    """The launcher that started this process, when it is not torchrun (see the module's order)."""
    if any(name in environ for name in TORCHRUN_VARS):
        return None
    return next((launcher for launcher in LAUNCHERS
                 if launcher.rank in environ and launcher.size in environ), None)


def adopt_launcher_env(devices: int = 1, num_nodes: int = 1,
                       environ: MutableMapping[str, str] | None = None) -> str | None:
    """Write what mpirun or srun told this process under torchrun's names into `environ`
    (os.environ), unless torchrun's are there already; returns the launcher's name, or None
    when there is nothing to adopt. `devices` and `num_nodes` tell the one-task-per-node form
    (see the module docstring) from one task per device."""
    environ = os.environ if environ is None else environ
    launcher = detect(environ)
    if launcher is None:
        return None
    rank, size = _int(environ, launcher.rank), _int(environ, launcher.size)
    local_rank = _int(environ, launcher.local_rank, 0)
    local_size = (_int(environ, launcher.local_size, size) if launcher.local_size
                  else _slurm_local_size(environ, size))
    if not (0 <= rank < size and 0 <= local_rank < local_size <= size):
        raise InputError(f"{launcher.name} says rank {rank} of {size}, local rank {local_rank} of "
                         f"{local_size}: these do not fit together")
    node_rank = (mpi_node_rank(rank, size, local_rank, local_size) if launcher.local_size
                 else _int(environ, "SLURM_NODEID", 0))  # srun says which node this is
    one_per_node = local_size == 1 and devices > 1 and size == num_nodes
    if devices > 1 and not one_per_node and local_size != devices:
        raise InputError(f"{launcher.name} started {local_size} process(es) on this node, but "
                         f"--devices is {devices}: start one process per device (or one per node "
                         f"with --num-nodes {size}), or leave --devices out")
    if node_rank is not None:
        environ.setdefault("NODE_RANK", str(node_rank))
    _rendezvous(environ, launcher, multi_node=local_size < size)
    if not one_per_node:  # this process is a worker: torchrun's names for it
        environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank),
                       LOCAL_WORLD_SIZE=str(local_size))
        _share_cores(environ, local_size)
    return launcher.name


def mpi_node_rank(rank: int, size: int, local_rank: int, local_size: int) -> int | None:
    """This process's node under mpirun, whose variables name no node: what its rank and local
    rank allow. In blocks (--map-by slot or ppr:N:node, the default) rank r is on node
    r // local_size as local rank r % local_size; round-robin (--map-by node) on node r % nodes
    as local rank r // nodes. None where the two fit and disagree, or neither fits (a placement
    of another kind): NODE_RANK is then left unset rather than guessed."""
    if local_size in (1, size):  # one process per node, or one node
        return rank // local_size
    nodes = size // local_size if size % local_size == 0 else None
    blocks = rank // local_size if local_rank == rank % local_size else None
    rounds = rank % nodes if nodes and local_rank == rank // nodes else None
    if blocks is not None and rounds is not None:
        return blocks if blocks == rounds else None
    return blocks if blocks is not None else rounds


def _rendezvous(environ, launcher: Launcher, multi_node: bool) -> None:
    """MASTER_ADDR and MASTER_PORT, where the user did not set them (see the module docstring)."""
    slurm = launcher.local_size is None
    if not environ.get("MASTER_ADDR"):
        if slurm:
            nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or ""
            environ["MASTER_ADDR"] = first_host(nodes) if multi_node else "127.0.0.1"
        elif not multi_node:
            environ["MASTER_ADDR"] = "127.0.0.1"
        else:
            raise InputError(f"{launcher.name} started processes on several nodes, and MASTER_ADDR is "
                             "not set: pass node 0's address to every process "
                             "(mpirun -x MASTER_ADDR=HOST -x MASTER_PORT=PORT ...)")
    if not environ.get("MASTER_PORT"):
        job = environ.get("SLURM_JOB_ID", "")
        first, span = SLURM_PORTS
        environ["MASTER_PORT"] = str(first + int(job) % span if slurm and job.isdigit() else DEFAULT_PORT)


def _share_cores(environ, local_size: int) -> None:
    """As torchrun and `hputrain launch` do: the node's processes share its cores, unless the user
    (or the launcher's binding) said how many threads each takes."""
    if "OMP_NUM_THREADS" in environ or local_size <= 1:
        return
    import torch

    threads = max(1, (os.cpu_count() or 1) // local_size)
    environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _slurm_local_size(environ, size: int) -> int:
    """srun's tasks on this node: SLURM_STEP_TASKS_PER_NODE lists them per node, compressed
    ("4(x2),3" is 4, 4, 3), in node order; this node is SLURM_NODEID."""
    listed = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not listed:
        return size
    counts: list[int] = []
    for part in listed.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise InputError(f"SLURM_STEP_TASKS_PER_NODE={listed!r} is not a list of task counts")
        counts += [int(match[1])] * int(match[2] or 1)
    node = _int(environ, "SLURM_NODEID", 0)
    if node >= len(counts):
        raise InputError(f"SLURM_NODEID={node}, but SLURM_STEP_TASKS_PER_NODE={listed!r} lists "
                         f"{len(counts)} node(s)")
    return counts[node]


def first_host(nodelist: str) -> str:
    """The first host name of a SLURM host list: "gaudi[07-09,12],cpu1" is gaudi07 first, and
    "rack[3,5]-n[01-04]" rack3-n01 (each bracket's first value)."""
    entry = re.match(r"(?:[^,\[\s]|\[[^\]]*\])+", nodelist.strip())  # up to a comma outside brackets
    if entry is None:
        raise InputError(f"srun gave no node list (SLURM_STEP_NODELIST={nodelist!r}) to find node 0 "
                         "in: set MASTER_ADDR")
    return re.sub(r"\[([^\]]*)\]", lambda group: re.split(r"[-,]", group[1])[0], entry[0])


def _int(environ, name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value in (None, ""):
        if default is None:
            raise InputError(f"{name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise InputError(f"{name} must be a whole number, got {value!r}") from None
