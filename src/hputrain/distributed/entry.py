"""What `hputrain launch` runs in each process: the user's script (or `-m module`), under
torchelastic's error recording, so that a rank that fails is reported by the launcher with its
rank and its error, not only an exit code: the exception it raised, or, when it exits with a
non-zero status instead, the one line `hputrain train` leaves to the launcher (bad input: exit 2,
failure.py), else the last line it wrote to stderr. A worker dies with its launcher, even when
the launcher is killed with SIGKILL. A worker that ends only because another rank failed ends
quietly (failure.py).

A worker that is done ends without the interpreter's final teardown (see `leave`): a backend's
threads, still finishing the last collective, would otherwise abort it with SIGABRT at exit."""
from __future__ import annotations

import atexit
import gc
import os
import runpy
import signal
import sys
import threading

from torch.distributed.elastic.multiprocessing.errors import record

from . import failure
from .launch import LAUNCHER_PID, STOP_SIGNALS, stderr_kept_in_files


@record
def main() -> None:
    _die_with_launcher()
    failure.leave_line_to_launcher(not stderr_kept_in_files())
    stderr = sys.stderr = _LastLine(sys.stderr)
    try:
        _run(sys.argv[1:])
    except SystemExit as exit_:
        peer = failure.ended_for()
        if peer is not None and exit_.code == failure.ENDED_BY_PEER:  # `hputrain train` ended for another rank
            failure.write_error_file("", peer=peer)
        elif exit_.code not in (0, None):  # its own end, whatever the status (75 too): said, then recorded
            status = exit_.code if isinstance(exit_.code, int) else 1
            line = exit_.code if isinstance(exit_.code, str) else failure.own_line() or stderr.last
            failure.write_error_file(line, status=status)
            if status - 128 not in STOP_SIGNALS:  # a stop every rank agreed on is no failure to end for
                failure.record(line, status)
        raise
    except Exception as error:  # a script's: the echo of another rank's failure ends quietly
        peer = failure.echo_of_peer(error)
        if peer is None:
            failure.record_when_printed(error)  # printed below (__main__), then recorded
            raise
        failure.write_error_file("", peer=peer)
        raise SystemExit(failure.end_quietly(peer)) from None


def _run(argv: list[str]) -> None:
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def _die_with_launcher() -> None:
    """Ask the kernel to SIGKILL this process when its parent, the launcher's agent, exits (kill -9
    included), so that no orphan trains on and writes checkpoints. The checkpoint protocol makes a
    SIGKILL at any point safe. Linux only; elsewhere the launcher's own shutdown is all there is."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        return
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is not None and os.getppid() != int(launcher):
        os.kill(os.getpid(), signal.SIGKILL)  # the launcher died before prctl took effect


class _LastLine:
    """sys.stderr as it was, remembering the last non-blank line written through it."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._line = ""
        self._tail = ""  # what follows the last newline

    def write(self, text: str) -> int:
        lines = (self._tail + text).replace("\r", "\n").split("\n")
        self._tail = lines[-1][-2000:]
        done = [line.strip() for line in lines[:-1] if line.strip()]
        if done:
            self._line = done[-1]
        return self._stream.write(text)

    @property
    def last(self) -> str:
        return (self._tail.strip() or self._line)[:300]

    def __getattr__(self, name):
        return getattr(self._stream, name)


def leave(code=0):
    """End this worker with exit status `code` (a SystemExit code) as the interpreter ends a
    program: other threads joined, atexit functions run (the process group is destroyed there),
    what the program left behind collected, output flushed; but then os._exit, without the
    interpreter's final teardown.

    The teardown is where a rank of `hputrain train --devices 4 --strategy fsdp` died now and then
    (one run in 20 to 50) with SIGABRT, "terminate called without an active exception": a Gloo
    worker thread drops its references to a collective's tensors just after the collective
    completed (host_sum is a rank's last); when Python has already dropped its own, the tensor's
    Python object goes too, which takes the GIL; once the interpreter is finalizing, taking the
    GIL ends the thread with pthread_exit, whose unwinding through a C++ destructor calls
    std::terminate. Destroying the process group does not stop those threads while a DeviceMesh
    or FSDP state still holds its groups; os._exit does not wait for them (multiprocessing ends
    its children so too)."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the interpreter prints it and exits 1
        print(code, file=sys.stderr)
        status = 1
    threading._shutdown()  # the interpreter's first step at exit (multiprocessing's too): join threads
    atexit._run_exitfuncs()
    _flush_python_files()
    _flush_c_streams()
    os._exit(status & 0xFF)


def _flush_python_files() -> None:
    """Flush every open Python file (the teardown would close them), the program's globals and
    what they held collected first: a file left open in a global keeps what was written to it."""
    import io

    gc.collect()
    for obj in gc.get_objects():
        if issubclass(type(obj), io.IOBase):  # not isinstance: a deprecated torch name warns on __class__
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):
                pass
    for stream in (sys.stdout, sys.stderr):  # or what stands in for them
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def _flush_c_streams() -> None:
    """C's stdio buffers (what a library printed through printf), which os._exit does not flush."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).fflush(None)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exit_:
        leave(exit_.code)
    except Exception:  # reported as the interpreter would (main recorded it for the launcher)
        sys.excepthook(*sys.exc_info())
        leave(1)
    leave(0)
