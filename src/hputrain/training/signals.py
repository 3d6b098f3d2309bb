"""SIGINT and SIGTERM during train(): noted here, acted on by every rank together.

Until train() returns, a signal is only noted (`received`); the ranks act on it at the next
agreement (Trainer._agree): they end the step under way, save one checkpoint and return from
train(). One that lands after the run's last agreement (before its final save) changes nothing:
the run is ending anyway. The handlers are installed from train()'s barrier on, which the ranks
leave at about the same moment, so that a signal the launcher passes to every rank during
start-up finds them alike: all without the handler (each ends the default way, having saved
nothing) or all with it.

A second signal ends the process at once, as torchrun's agent and Python's own default do: the
first one puts the system's default action back, so the second is acted on by the kernel even
while the process waits inside a collective that never returns to the interpreter (where a
Python handler would never run).
"""
from __future__ import annotations

import signal
import threading

CAUGHT = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """SIGINT and SIGTERM noted while installed (signal handlers live in the main thread only:
    elsewhere nothing is installed and the signals keep their default handling)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict = {}

    def install(self) -> None:
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in CAUGHT:
            self._previous[signum] = signal.signal(signum, self._note)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _note(self, signum, frame) -> None:
        self.received = signum
        for caught in CAUGHT:  # the next SIGINT or SIGTERM ends the process where it stands
            signal.signal(caught, signal.SIG_DFL)
