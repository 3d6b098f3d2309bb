"""How a job of several processes ends when one rank fails, whichever rank and wherever: with
that rank's one line, said once, and its exit status (2 for bad input); every other rank ends
quietly, with ENDED_BY_PEER, and no traceback.

A rank that fails records its status and line in the job's store (`record`) before it exits.
Its exit closes its connections, so a rank waiting for it inside a collective (Gloo's
"Connection closed by peer") fails there, and one that was busy fails at its next collective, or
is ended by the launcher's SIGTERM; the error it gets says only that a peer is gone. Before
treating an error as its own, a rank asks the store (`peer_failure`): when another rank recorded
a failure first, its own error is that failure's echo, and it exits with ENDED_BY_PEER, saying
nothing. The order is causal: the record is written before the connections close.

The store is the process group's: under `hputrain launch` (and torchrun) the launcher's, which
outlives every worker; under mpirun or srun rank 0's. A store that no longer answers is rank 0
gone, which is as much a peer's failure. A rank that failed before the process group was joined
records nothing; the others are then still joining, outside any collective, and the launcher's
SIGTERM (or mpirun's) ends them.

Under `hputrain launch` the launcher says each failed rank's line, naming the rank
(launch._report, from the worker's error file, entry.py), so a worker leaves its line to it
(`leave_line_to_launcher`) instead of printing it too, unless its output goes to a log file
(PET_REDIRECTS, PET_TEE). A checkpoint being written when the job ends stays in its temporary
folder, and the previous one is whole (checkpoint/saving.py).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time

ENDED_BY_PEER = 75
"""The exit status of a rank that ended because another rank failed (quietly)."""
KEY = "hputrain/failed_rank"
STORE_SECONDS = 30  # a store that does not answer within this is taken for gone

_said_by_launcher = False
_own: str | None = None  # this rank's line, once said
_peer: dict | None = None  # the other rank's failure, once peer_failure found it


def leave_line_to_launcher(yes: bool = True) -> None:
    """This process is a worker of `hputrain launch`, whose launcher prints its error line
    (entry.py says so once, at its start)."""
    global _said_by_launcher
    _said_by_launcher = yes


def say(line: str, status: int) -> None:
    """The one line of a rank that ends with `status`: recorded for the other ranks, then printed
    on stderr, unless the launcher prints it."""
    global _own
    _own = line
    record(line, status)
    if not _said_by_launcher:
        print(line, file=sys.stderr)


def own_line() -> str | None:
    """The line this rank said (`say`), if it did."""
    return _own


def record(line: str, status: int) -> None:
    """Note in the job's store that this rank fails with `status` and `line` (the first failure
    recorded stays); nothing when there is no process group or its store is gone."""
    store, rank = _store()
    if store is None:
        return
    failure = json.dumps({"rank": rank, "status": status, "line": line})
    try:
        store.compare_set(KEY, "", failure)
    except Exception:  # noqa: BLE001 - the store is gone with rank 0: nothing to tell anyone
        pass


def echo_of_peer(error: BaseException) -> dict | None:
    """Another rank's failure that `error` is the echo of (`peer_failure`); else None, `error`
    being this rank's own, recorded for the others. What cli.main and entry.main do with an
    error that is not bad input."""
    peer = peer_failure()
    if peer is None:
        record(f"{type(error).__name__}: {error}", 1)
    return peer


def said_by_rank_0(seconds: float = 30.0) -> bool:
    """On a rank other than 0, wait (up to `seconds`) until rank 0 has recorded the error every
    rank found alike (errors.EveryRankError), and say whether it did: this rank then ends quietly,
    after it, so that the job ends with rank 0's line."""
    if os.environ.get("RANK", "0") == "0":
        return False
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if peer_failure() is not None:
            return True
        time.sleep(0.05)
    return False


def peer_failure() -> dict | None:
    """{"rank", "status", "line"} of another rank's failure, when one was recorded: this rank's
    own error is then its echo. {"rank": None, ...} when the store is gone (rank 0 held it). None
    when no other rank failed, or there is no process group."""
    global _peer
    if _peer is not None:
        return _peer
    store, rank = _store()
    if store is None:
        return None
    try:
        found = json.loads(store.get(KEY)) if store.check([KEY]) else None
    except Exception:  # noqa: BLE001 - no store: the rank that held it is gone
        found = {"rank": None, "status": None, "line": "the rendezvous store is gone"}
    if found is not None and found["rank"] != rank:
        _peer = found
    return _peer


def _store():
    """(the default process group's store, this rank), or (None, None) before it is joined."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store
    except ImportError:
        return None, None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None, None
    try:
        store = _get_default_store()
        store.set_timeout(datetime.timedelta(seconds=STORE_SECONDS))
    except Exception:  # noqa: BLE001 - a group without a store of ours
        return None, None
    return store, dist.get_rank()
