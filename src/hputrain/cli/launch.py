"""`hputrain launch [--nproc-per-node N|auto] [--nnodes N] [--node-rank R] [--master-addr A]
[--master-port P] [--max-restarts K] [--cpu] SCRIPT [ARGS] | -m MODULE [ARGS]`: the flags, the
saved defaults, then distributed/launch.py's launch."""
from __future__ import annotations

import argparse
import os

from ..accelerators import detect_accelerator
from ..config.defaults import load_defaults
from ..distributed.launch import check_port, env_int, launch
from ..errors import InputError

DESCRIPTION = "`hputrain launch`: a thin front for torch.distributed.run (torchrun)."


def cmd_launch(args) -> int:
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
    if args.master_port is not None:
        port = check_port(args.master_port, "--master-port")
    else:
        port = os.environ.get("MASTER_PORT") or None
        port = check_port(port, "MASTER_PORT") if port is not None else None
    target = (["-m", args.target] if args.module else [args.target]) + args.args
    if not args.module and not os.path.isfile(args.target):
        raise InputError(f"script {args.target} does not exist")
    node_rank = args.node_rank if args.node_rank is not None else env_int("NODE_RANK", 0)
    return launch(target, nproc, nnodes, node_rank, args.master_addr or os.environ.get("MASTER_ADDR") or None,
                  port, args.max_restarts, cpu)


def add_launch_parser(sub) -> None:
    p = sub.add_parser("launch", help="multi-process / multi-node launch (torchrun)",
                       description=DESCRIPTION)
    p.add_argument("--nproc-per-node", "--nproc_per_node", help="processes per node: N or auto")
    p.add_argument("--nnodes", type=int, help="number of nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, help="this node's rank (default $NODE_RANK or 0)")
    p.add_argument("--master-addr", "--master_addr", help="address of node 0 (default $MASTER_ADDR; "
                   "127.0.0.1 on one node)")
    p.add_argument("--master-port", "--master_port", help="a free port on node 0 (default $MASTER_PORT; "
                   "on one node, a free port of 127.0.0.1)")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restart the whole job this often after a failure; it resumes from the latest "
                   "checkpoint (a stop by SIGTERM/SIGINT, and bad input: exit 2, are never restarted)")
    p.add_argument("--cpu", action="store_true", help="force the CPU")
    p.add_argument("-m", "--module", action="store_true", help="TARGET is a module, as python -m")
    p.add_argument("target", metavar="SCRIPT", help="the training script (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    p.set_defaults(func=cmd_launch)
