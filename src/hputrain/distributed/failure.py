"""How a job of several processes ends when one rank fails, whichever rank and wherever: with
that rank's one line, said once, and its exit status (2 for bad input); every other rank ends
quietly, with ENDED_BY_PEER, and no traceback.

A rank that fails says its line first (`say`: on stderr, or in its error file for the launcher
to print), then records its status and line in the job's store (`record`), then exits. In that
order, so that no other rank acts on the record (and gets the job stopped) before the line is
out. Its exit closes its connections, so a rank waiting for it inside a Gloo collective
("Connection closed by peer") fails there, and one that was busy fails at its next collective,
or is ended by the launcher's SIGTERM; the error it gets says only that a peer is gone. Before
treating an error as its own, a rank asks the store (`echo_of_peer`): when another rank
recorded a failure first, its own error is that failure's echo, and it ends quietly
(`end_quietly`: exit ENDED_BY_PEER, its error file naming that failure). The order is causal:
the record is written before the connections close.

NCCL and HCCL collectives do not fail when a peer exits: the waiting rank blocks in C++ until
the launcher's SIGKILL. Each rank of a joined group runs a watchdog thread (`watch`) that reads
the record every WATCH_SECONDS; when another rank's failure is there and this rank has not
ended within GRACE_SECONDS, it ends it quietly.

"Ended by a peer" is a fact of the store, never of an exit status: a script's own exit 75 (the
"retry later" of sysexits.h) is its own failure, recorded and reported as any other. The
launcher (launch.py) reads the fact from the error file (extraInfo.peer).

Said once: the first rank to say a line claims it in the store (SAID_KEY); a rank that meets the
same error after it (bad input that every rank meets alike) says nothing, waits until that rank
has recorded its failure, and ends quietly. An error every rank found alike by agreement
(errors.EveryRankError) is rank 0's to say (`said_by_rank_0`).

A store that does not answer (slow, or gone) tells nothing, neither a peer's failure nor its
absence: a rank then says its own error, unless the error itself says only that a peer is gone
(under mpirun or srun the store is rank 0's, and goes with it). A rank that failed before the
process group was joined records nothing; the others are then still joining, outside any
collective, and the launcher's SIGTERM (or mpirun's) ends them.

Under `hputrain launch` the launcher says each failed rank's line, naming the rank
(launch.py, from the worker's error file), so a worker leaves its line to it
(`leave_line_to_launcher`) instead of printing it too, unless its output goes to a log file
(PET_REDIRECTS, PET_TEE). A checkpoint being written when the job ends stays in its temporary
folder, and the previous one is whole (checkpoint/saving.py).
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import threading
import time

from ..errors import first_line

ENDED_BY_PEER = 75
"""The exit status of a rank that ended because another rank failed (quietly)."""
KEY = "hputrain/failed_rank"  # the first failure recorded: what the other ranks end for
SAID_KEY = "hputrain/said_line"  # the first line said: a rank meeting the same error says nothing
STORE_SECONDS = 30  # a store that does not answer within this tells nothing
WATCH_SECONDS = 1.0  # how often the watchdog reads the record
GRACE_SECONDS = 3.0  # how long it lets a rank end by itself after another rank's record
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # where torch's agent reads a worker's error
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")

_said_by_launcher = False
_own: str | None = None  # this rank's line, once said
_peer: dict | None = None  # the other rank's failure, once peer_failure found it
_ended_for: dict | None = None  # the failure this rank ends quietly for (end_quietly)
_unprinted: BaseException | None = None  # this rank's crash, recorded once printed
_watching = False


def leave_line_to_launcher(yes: bool = True) -> None:
    """This process is a worker of `hputrain launch`, whose launcher prints its error line
    (entry.py says so once, at its start)."""
    global _said_by_launcher
    _said_by_launcher = yes


def say(line: str, status: int) -> int:
    """Say the one line of a rank that ends with `status` (on stderr, or in its error file for
    the launcher), then record it for the other ranks. Returns the status to exit with:
    `status`, or ENDED_BY_PEER when another rank said the same line first (it is said once)."""
    global _own
    if _claim(line) is not None:
        peer = wait_for_peer()
        if peer is not None:
            return end_quietly(peer)
    _own = line
    if _said_by_launcher:
        write_error_file(line, status=status)
    else:
        print(line, file=sys.stderr, flush=True)
    record(line, status)
    return status


def own_line() -> str | None:
    """The line this rank said (`say`), if it did."""
    return _own


def end_quietly(peer: dict) -> int:
    """Note that this rank ends because of `peer` (another rank's failure, as recorded) and
    return ENDED_BY_PEER, its exit status: what entry.py writes in its error file."""
    global _ended_for
    _ended_for = peer
    return ENDED_BY_PEER


def ended_for() -> dict | None:
    """The failure this rank ends quietly for (`end_quietly`); None when it ends for its own."""
    return _ended_for


def record(line: str, status: int) -> None:
    """Note in the job's store that this rank fails with `status` and `line` (the first failure
    recorded stays); nothing when there is no process group or its store does not answer."""
    store, rank = _store()
    if store is None:
        return
    try:
        store.compare_set(KEY, "", json.dumps({"rank": rank, "status": status, "line": line}))
    except Exception:  # noqa: BLE001 - a store that does not answer: nothing to tell anyone
        pass


def record_when_printed(error: BaseException) -> None:
    """Record `error`, this rank's crash (status 1), once the interpreter has printed it
    (sys.excepthook, as it does for an uncaught exception; entry.py calls it too), so that its
    traceback is out before any other rank acts on the record."""
    global _unprinted
    if _store()[0] is None:
        return
    _unprinted = error
    if not getattr(sys.excepthook, "records_the_crash", False):
        printing = sys.excepthook

        def print_then_record(kind, value, traceback):
            printing(kind, value, traceback)
            if value is _unprinted:
                record(f"{kind.__name__}: {first_line(value)}", 1)

        print_then_record.records_the_crash = True
        sys.excepthook = print_then_record


def echo_of_peer(error: BaseException) -> dict | None:
    """The failure of another rank that `error` is the echo of: the one recorded in the store;
    or, where the store does not answer and `error` says only that a peer is gone, an unnamed
    one ({"rank": None, ...}). None: `error` is this rank's own, to be said."""
    peer, answered = _peer_record()
    if peer is None and not answered and _says_a_peer_is_gone(error):
        peer = {"rank": None, "status": None,
                "line": f"{first_line(error)[:300]} (and the job's store did not answer)"}
    return peer


def said_by_rank_0(seconds: float = STORE_SECONDS) -> dict | None:
    """On a rank other than 0, wait (up to `seconds`) until rank 0 has recorded the error every
    rank found alike (errors.EveryRankError), and return that record: this rank then ends
    quietly, after it, so that the job ends with rank 0's line. None: rank 0 said nothing
    (or this is rank 0), and this rank says the line itself."""
    if os.environ.get("RANK", "0") == "0":
        return None
    return wait_for_peer(seconds)


def wait_for_peer(seconds: float = STORE_SECONDS) -> dict | None:
    """Another rank's failure, once it is recorded (polled for up to `seconds`); None when none
    is, or the store does not answer."""
    deadline = time.monotonic() + seconds
    while True:
        peer, answered = _peer_record()
        if peer is not None or not answered or time.monotonic() > deadline:
            return peer
        time.sleep(0.05)


def peer_failure() -> dict | None:
    """{"rank", "status", "line"} of another rank's failure, when one was recorded: this rank's
    own error is then its echo. None when no other rank recorded one, when the store does not
    answer, or when there is no process group."""
    return _peer_record()[0]


def write_error_file(line: str, *, status: int | None = None, peer: dict | None = None) -> None:
    """Write the error file torch's agent reads for this rank (TORCHELASTIC_ERROR_FILE, in
    torchelastic's format) with `line` as the message, and in extraInfo `status`, the exit
    status this rank ends with for its own failure, or `peer`, the failure of another rank it
    ends quietly for: what launch.py reads. Nothing where no agent asked for one."""
    path = os.environ.get(ERROR_FILE)
    if not path:
        return
    if peer is not None:
        line = f"ended because rank {peer['rank']} failed" if peer["rank"] is not None else peer["line"]
    message = {"message": line or "exited with no message on stderr",
               "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time())), "status": status,
                             "peer": peer}}
    partial = f"{path}.{threading.get_ident()}.tmp"  # the watchdog may write it too: whole or not at all
    with open(partial, "w") as f:
        json.dump({"message": message}, f)
    os.replace(partial, path)


def watch() -> None:
    """Start this rank's watchdog, once, after it joined the process group: a thread that reads
    the failure record every WATCH_SECONDS and, when another rank's failure is there and this
    rank has not ended by itself within GRACE_SECONDS (a rank blocked in an NCCL or HCCL
    collective never does), ends it quietly, before the launcher's SIGKILL would."""
    global _watching
    shared, rank = _group_store()
    if _watching or shared is None or not hasattr(shared, "clone"):
        return
    try:  # a client of its own: the main thread may be using the group's (it is connected now)
        store = shared.clone()
        store.set_timeout(datetime.timedelta(seconds=STORE_SECONDS))
    except Exception:  # noqa: BLE001 - a store that cannot be cloned: no watchdog
        return
    _watching = True
    exiting = threading.Event()
    atexit.register(exiting.set)  # before the group is left: a store gone with rank 0 is no news
    threading.Thread(target=_watch, args=(store, rank, exiting), name="hputrain-peer-watchdog",
                     daemon=True).start()


def _watch(store, rank: int, exiting: threading.Event) -> None:
    """The watchdog's loop (`watch`). It stops at this rank's own line, at its exit, and at the
    first time the store does not answer (each such try prints torch's warning)."""
    while not exiting.wait(WATCH_SECONDS):
        if _own is not None or _ended_for is not None:
            return  # this rank says its own line, or already ends for a peer
        found, answered = _read_record(store)
        if not answered or (found is not None and found["rank"] == rank):
            return
        if found is None:
            continue
        if not exiting.wait(GRACE_SECONDS) and _own is None and _ended_for is None:
            _end_now(found)  # still here: blocked where the peer's exit broke nothing
        return


def _end_now(peer: dict) -> None:
    """End this process at once, quietly, for `peer`: its error file says so; no interpreter
    teardown (its main thread may be blocked in a collective that never returns)."""
    end_quietly(peer)
    write_error_file("", peer=peer)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(ENDED_BY_PEER)


def _claim(line: str) -> dict | None:
    """Claim `line` as said by this rank; the claim of another rank that said the same line
    first, or None (this rank is the first, its line is another, or the store does not answer)."""
    store, rank = _store()
    if store is None:
        return None
    try:
        first = json.loads(store.compare_set(SAID_KEY, "", json.dumps({"rank": rank, "line": line})))
    except Exception:  # noqa: BLE001 - a store that does not answer: this rank says its line
        return None
    return first if first["rank"] != rank and first["line"] == line else None


def _peer_record() -> tuple[dict | None, bool]:
    """(another rank's recorded failure or None, whether the store answered); the first found
    is kept."""
    global _peer
    if _peer is not None:
        return _peer, True
    found, answered = _read_record()
    if found is not None and found["rank"] != _store()[1]:
        _peer = found
    return _peer, answered


def _read_record(store=None) -> tuple[dict | None, bool]:
    """(the failure recorded in `store` (default: the group's) or None, whether the store
    answered); (None, True) without a process group."""
    store = store if store is not None else _store()[0]
    if store is None:
        return None, True
    try:
        return (json.loads(store.get(KEY)) if store.check([KEY]) else None), True
    except Exception:  # noqa: BLE001 - slow or gone: it tells nothing
        return None, False


def _says_a_peer_is_gone(error: BaseException) -> bool:
    """Whether `error` is what a collective raises when a peer's process is gone."""
    try:
        from torch.distributed import DistError
    except ImportError:
        DistError = ()  # noqa: N806
    return isinstance(error, DistError) or any(text in str(error) for text in LOST_PEER)


def _group_store():
    """(the default process group's store, this rank), or (None, None) before it is joined."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store
    except ImportError:
        return None, None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None, None
    try:
        return _get_default_store(), dist.get_rank()
    except Exception:  # noqa: BLE001 - a group without a store of ours
        return None, None


def _store():
    """`_group_store`, its waits cut to STORE_SECONDS (a store that does not answer within them
    tells nothing): what a rank that fails uses, on its main thread."""
    store, rank = _group_store()
    if store is None:
        return None, None
    try:
        store.set_timeout(datetime.timedelta(seconds=STORE_SECONDS))
    except Exception:  # noqa: BLE001
        return None, None
    return store, rank
