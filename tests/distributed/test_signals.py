"""Issue 30: the first SIGINT or SIGTERM during train() is noted (every rank then saves and
stops together: test_stop_agreement.py); a second one ends the process at once, even while it
waits where no Python handler runs (a collective that never returns)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

# Installs the Trainer's handlers, says so, then waits in one long sleep: the stand-in for a
# collective that never returns (a noted signal does not end it).
WAITER = textwrap.dedent("""
    import sys, time
    from hputrain.training.signals import StopSignals
    signals = StopSignals()
    signals.install()
    print("ready", flush=True)
    time.sleep(60)
    print("woke with", signals.received, flush=True)
""")


def _start():
    proc = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


@pytest.mark.parametrize("first,second", [(signal.SIGINT, signal.SIGINT),
                                          (signal.SIGTERM, signal.SIGINT),
                                          (signal.SIGINT, signal.SIGTERM)])
def test_a_second_signal_ends_the_process_at_once(first, second):
    proc = _start()
    try:
        proc.send_signal(first)
        time.sleep(0.5)
        assert proc.poll() is None  # the first is only noted: the run saves and stops by itself
        proc.send_signal(second)
        assert proc.wait(timeout=10) == -second  # the system's default action, not a handler
    finally:
        proc.kill()
        proc.communicate()


def test_restore_puts_back_the_handlers_that_were_there():
    from hputrain.training.signals import StopSignals

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signals = StopSignals()
    signals.install()
    assert signal.getsignal(signal.SIGINT) != before[signal.SIGINT]
    signals.restore()
    assert {s: signal.getsignal(s) for s in before} == before
