"""`hputrain train` on one rank of several, failing on purpose at a chosen point, for
tests/distributed/test_rank_failure.py: started by `hputrain launch`, each process runs the command line's
own entry (hputrain.cli.main) with ARGS, after wrapping one ProcessGroup method so that rank RANK
raises bad input (InputError: one line, exit 2) at its CALL-th call of it, a moment after the
other ranks went into that collective (they wait inside it when the failing rank ends).

    rank_failure_script.py RANK METHOD CALL train ARGS...

METHOD: init (before the process group is joined), barrier (train()'s is the first, then three
per checkpoint save: after begin, after the files are written, after the rename), host_sum (the
ranks' agreement at each step: an all-reduce), gather_objects (an all-gather of host objects,
GRPO's rewards). METHOD+hang: the other ranks, at that call, block as in an NCCL or HCCL
collective whose peer is gone (in C++, where neither the peer's exit nor a Python signal handler
reaches them) instead of taking part. RANK all: every rank fails alike, with the same line.
Each rank writes its pid to pid-RANK beside the output folder, for the test's look for processes
left behind.
"""
import functools
import os
import sys
import time

from hputrain.cli import main
from hputrain.distributed import ProcessGroup
from hputrain.errors import InputError

SETTLE = 1.0  # seconds the failing rank lets the others get into the collective


def fail_at(rank: str, method: str, call: int) -> None:
    """Wrap ProcessGroup.METHOD so that rank RANK (or every rank: all) fails at its CALL-th call,
    before taking part; with METHOD+hang, the other ranks block there."""
    method, _, hang = method.partition("+")
    original = getattr(ProcessGroup, method)
    calls = [0]

    @functools.wraps(original)
    def wrapped(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == call and rank in ("all", str(self.rank)):
            time.sleep(SETTLE)
            who = "every rank" if rank == "all" else f"rank {rank}"
            raise InputError(f"{who} refused its {method} call {call} on purpose")
        if calls[0] == call and hang:
            block_in_cpp()
        return original(self, *args, **kwargs)

    setattr(ProcessGroup, method, wrapped)


def block_in_cpp() -> None:
    """Wait in C++ for a key nobody sets (the job's store), as a rank waits in an NCCL or HCCL
    collective whose peer is gone."""
    import datetime

    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store().clone()
    store.set_timeout(datetime.timedelta(seconds=600))
    store.wait(["rank_failure_script/never"])


def run(argv: list[str]) -> int:
    rank, method, call, *rest = argv
    beside = os.path.dirname(os.path.abspath(rest[rest.index("--output-dir") + 1]))
    with open(os.path.join(beside, f"pid-{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))
    fail_at(rank, method, int(call))
    return main(rest)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
