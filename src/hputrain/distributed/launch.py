"""`hputrain launch`: a thin front for torch.distributed.run (torchrun), and the relaunch behind
`devices=N` / `num_nodes=M` (Lightning's way: set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and
NODE_RANK on every node and run the same command).

Single-node runs bind the rendezvous to 127.0.0.1, not to every interface.
"""
from __future__ import annotations

import os
import socket
import sys

from ..errors import InputError

LOOPBACK = "127.0.0.1"


def launch(target: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
           master_addr: str | None = None, master_port: int | None = None, max_restarts: int = 0,
           cpu: bool = False) -> int:
    """Run `target` ([SCRIPT, ARGS...] or ["-m", MODULE, ARGS...]) in nproc_per_node processes on
    this node, one of `nnodes`, under torch's elastic agent (what torchrun runs). Returns the exit
    status; a failure prints one line per failed rank, with its error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc_per_node < 1 or nnodes < 1 or not 0 <= node_rank < nnodes or max_restarts < 0:
        raise InputError(f"bad launch shape: {nproc_per_node} processes per node, {nnodes} nodes, "
                         f"node rank {node_rank}, {max_restarts} restarts")
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(key, None)  # the agent sets these for each process
    if cpu:
        os.environ["HPUTRAIN_ACCELERATOR"] = "cpu"
    local_store = None
    if nnodes == 1:
        master_addr = LOOPBACK
        master_port, local_store = _loopback_store()  # keep it alive while the agent runs
    elif master_addr is None or master_port is None:
        raise InputError("a multi-node launch needs --master-addr and --master-port "
                         "(or MASTER_ADDR and MASTER_PORT) on every node")
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node,
        run_id=f"hputrain-{master_addr}-{master_port}", rdzv_backend="static",
        rdzv_endpoint=f"{master_addr}:{master_port}", rdzv_configs={"rank": node_rank},
        max_restarts=max_restarts, monitor_interval=0.5,
        local_addr=LOOPBACK if nnodes == 1 else None)
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "hputrain.distributed.entry", *target)
    except ChildFailedError as failure:
        for line in failure_lines(failure, node_rank * nproc_per_node):
            print(f"hputrain launch: {line}", file=sys.stderr)
        return 1
    finally:
        del local_store
    return 0


def _loopback_store():
    """The rendezvous store of a single-node run, listening on 127.0.0.1 only. torch's agent
    would bind its store to every interface; given a store of the same address and port in this
    process (multi_tenant), it uses this one instead."""
    import datetime

    from torch.distributed import TCPStore

    listener = socket.socket()
    listener.bind((LOOPBACK, 0))
    port = listener.getsockname()[1]
    store = TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                     master_listen_fd=listener.fileno(), timeout=datetime.timedelta(seconds=900))
    return port, (listener, store)


def failure_lines(failure, first_rank: int = 0) -> list[str]:
    """'rank R failed (exit code C): first line of its error', rank order."""
    lines = []
    for rank, process in sorted(failure.failures.items()):
        message = process.message
        if isinstance(message, dict):
            message = message.get("message", "")
        first = (str(message).strip().splitlines() or ["no error message"])[0][:300]
        lines.append(f"rank {rank} failed (exit code {process.exitcode}): {first}")
    return lines


def needs_launch(devices: int, num_nodes: int) -> bool:
    """More than one process was asked for, and this process was not started by a launcher."""
    return devices * num_nodes > 1 and "LOCAL_RANK" not in os.environ


def relaunch_current_program(devices: int, num_nodes: int) -> int:
    """Run this program again in devices × num_nodes processes (this node's share), as Lightning
    does for Trainer(devices=N): with num_nodes > 1, MASTER_ADDR, MASTER_PORT, WORLD_SIZE and
    NODE_RANK come from the environment of every node."""
    world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != devices * num_nodes:
        raise InputError(f"WORLD_SIZE={world}, but devices={devices} × num_nodes={num_nodes} is "
                         f"{devices * num_nodes}")
    node_rank = int(os.environ.get("NODE_RANK", "0"))
    port = os.environ.get("MASTER_PORT")
    return launch(current_program(), devices, num_nodes, node_rank,
                  os.environ.get("MASTER_ADDR"), int(port) if port else None)


def current_program() -> list[str]:
    """This process's program and arguments, as a launch target."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    if not sys.argv or not os.path.isfile(sys.argv[0]):
        raise InputError("devices > 1 starts one process per device by running this program again, "
                         "but it is not a script file; run it with `hputrain launch` instead")
    return [sys.argv[0], *sys.argv[1:]]


def cmd_launch(args) -> int:
    from ..accelerators import detect_accelerator
    from ..defaults import load_defaults

    saved = load_defaults()  # what `hputrain config` wrote, under the flags typed
    cpu = args.cpu or (saved is not None and saved.accelerator == "cpu")
    nproc = args.nproc_per_node or (str(saved.nproc_per_node) if saved else "auto")
    if nproc == "auto":
        nproc = detect_accelerator("cpu" if cpu else "auto").device_count()
    try:
        nproc = int(nproc)
    except ValueError:
        raise InputError(f"--nproc-per-node must be a number or auto, got {nproc!r}") from None
    nnodes = args.nnodes or (saved.num_nodes if saved else 1)
    port = args.master_port or os.environ.get("MASTER_PORT")
    target = (["-m", args.target] if args.module else [args.target]) + args.args
    if not args.module and not os.path.isfile(args.target):
        raise InputError(f"script {args.target} does not exist")
    return launch(target, nproc, nnodes,
                  args.node_rank if args.node_rank is not None else int(os.environ.get("NODE_RANK", "0")),
                  args.master_addr or os.environ.get("MASTER_ADDR"), int(port) if port else None,
                  args.max_restarts, cpu)


def add_launch_parser(sub) -> None:
    import argparse

    p = sub.add_parser("launch", help="multi-process / multi-node launch (torchrun)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", "--nproc_per_node", help="processes per node: N or auto")
    p.add_argument("--nnodes", type=int, help="number of nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, help="this node's rank (default $NODE_RANK or 0)")
    p.add_argument("--master-addr", "--master_addr", help="address of node 0 (default $MASTER_ADDR; "
                   "127.0.0.1 on one node)")
    p.add_argument("--master-port", "--master_port", type=int, help="a free port on node 0")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restart the whole job this often after a failure; it resumes from the latest checkpoint")
    p.add_argument("--cpu", action="store_true", help="force the CPU")
    p.add_argument("-m", "--module", action="store_true", help="TARGET is a module, as python -m")
    p.add_argument("target", metavar="SCRIPT", help="the training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(func=cmd_launch)
