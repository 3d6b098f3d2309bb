"""The mechanism of `hputrain launch` (cli/launch.py): a thin front for torch.distributed.run (torchrun), and the relaunch behind
`devices=N` / `num_nodes=M` (Lightning's way: set MASTER_ADDR, MASTER_PORT, WORLD_SIZE and
NODE_RANK on every node and run the same command).

Single-node runs bind the rendezvous to 127.0.0.1, not to every interface. SIGTERM or SIGINT to
the launcher is passed on to every worker, which saves and exits; the launcher then exits
128 + the signal (143, 130), as it does when a rank is stopped by a signal itself: a requested
stop, never restarted. The workers die with the launcher, even under kill -9 (see entry.py). A
rank that fails ends the job with its line, said here once, naming it (ranks that failed alike
in one line); the ranks that ended only because of it (their error files say so) or were ended by
the launcher after it say nothing (failure.py). Bad input (exit 2) is never restarted either.
torch's elastic agent logs only when LOGLEVEL asks it to.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from types import SimpleNamespace

from ..errors import InputError

LOOPBACK = "127.0.0.1"
LAUNCHER_PID = "HPUTRAIN_LAUNCHER_PID"  # entry.py: the process a worker must die with
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
BAD_INPUT = 2  # a worker's exit status for bad input (one line on stderr), passed on by the launcher
LINE_CHARS = 2000  # of a failed rank's line: a line of bad input is said whole
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # torch's agent catches these


def launch(target: list[str], nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
           master_addr: str | None = None, master_port: int | None = None, max_restarts: int = 0,
           cpu: bool = False) -> int:
    """Run `target` ([SCRIPT, ARGS...] or ["-m", MODULE, ARGS...]) in nproc_per_node processes on
    this node, one of `nnodes`, under torch's elastic agent (what torchrun runs). Returns the exit
    status: 0, 128 + the signal that stopped the run, 2 when every failed rank exited 2 (bad
    input), or 1 after any other failure (one line per failed rank, with its error)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.launcher.api import LaunchConfig

    if nproc_per_node < 1 or nnodes < 1 or not 0 <= node_rank < nnodes or max_restarts < 0:
        raise InputError(f"bad launch shape: {nproc_per_node} processes per node, {nnodes} nodes, "
                         f"node rank {node_rank}, {max_restarts} restarts")
    master_addr, master_port, local_store = _rendezvous_endpoint(nnodes, node_rank, master_addr, master_port)
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(key, None)  # the agent sets these for each process
    os.environ[LAUNCHER_PID] = str(os.getpid())
    if cpu:
        os.environ["HPUTRAIN_ACCELERATOR"] = "cpu"
    # As torchrun does: processes sharing a node share its cores, unless the user said otherwise
    # (on 2 cores, two ranks of two OpenMP threads each ran a step about 10x slower).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node,
        run_id=f"hputrain-{master_addr}-{master_port}", rdzv_backend="static",
        rdzv_endpoint=f"{master_addr}:{master_port}", rdzv_configs={"rank": node_rank},
        max_restarts=max_restarts, monitor_interval=0.5,
        local_addr=LOOPBACK if nnodes == 1 else None, logs_specs=_logs_specs())
    try:
        with _quiet_torch_logs(), _own_signal_handlers():
            failures = _run_agent(config, sys.executable,
                                  ["-u", "-m", "hputrain.distributed.entry", *target])
    except SignalException as stop:
        print(f"hputrain launch: {stop.sigval.name} received: passed to every worker to save and "
              f"stop (exit {128 + stop.sigval})", file=sys.stderr)
        return 128 + stop.sigval
    except DistError as exc:  # the rendezvous, before any worker ran
        if "EADDRINUSE" in str(exc):
            raise InputError(f"port {master_port} is in use: pick another --master-port") from None
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        print(f"hputrain launch: rendezvous at {master_addr}:{master_port} failed: {line}", file=sys.stderr)
        return 1
    finally:
        del local_store
    return _report(failures)


def _logs_specs():
    """Where each rank's output goes: the console, and with torchrun's own variables PET_LOG_DIR
    and PET_TEE (or PET_REDIRECTS), e.g. 3 for both streams, also (or only) one file per rank and
    stream under PET_LOG_DIR/RUN_ID/attempt_N/RANK/."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    try:
        return DefaultLogsSpecs(log_dir=os.environ.get("PET_LOG_DIR") or None,
                                redirects=Std.from_str(os.environ.get("PET_REDIRECTS") or "0"),
                                tee=Std.from_str(os.environ.get("PET_TEE") or "0"))
    except ValueError as exc:
        raise InputError(f"PET_REDIRECTS / PET_TEE: {exc}") from None


def stderr_kept_in_files() -> bool:
    """Whether a worker's stderr also goes to a file of its own (PET_REDIRECTS or PET_TEE, see
    `_logs_specs`), where its error line belongs beside the launcher's."""
    return any(os.environ.get(name, "0") not in ("", "0") for name in ("PET_REDIRECTS", "PET_TEE"))


def _rendezvous_endpoint(nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None):
    """(address, port, the store kept alive while the agent runs): one node listens on 127.0.0.1,
    on --master-port when given; node 0 of several checks that its port is free."""
    if master_port is not None:
        check_port(master_port, "--master-port")
    if nnodes == 1:
        if master_addr not in (None, LOOPBACK, "localhost"):
            print(f"hputrain launch: one node: the rendezvous listens on {LOOPBACK} "
                  f"(--master-addr {master_addr} is for --nnodes > 1)", file=sys.stderr)
        port, store = _loopback_store(master_port)
        return LOOPBACK, port, store
    if master_addr is None or master_port is None:
        missing = "MASTER_ADDR (--master-addr)" if master_addr is None else "MASTER_PORT (--master-port)"
        raise InputError(f"a multi-node launch needs --master-addr and --master-port (or MASTER_ADDR "
                         f"and MASTER_PORT) on every node; {missing} is not set")
    if node_rank == 0:
        _check_port_free(master_port)
    return master_addr, master_port, None


def check_port(port, where: str) -> int:
    """`port` as a TCP port number (1-65535), or one line naming `where` it came from."""
    try:
        number = int(port)
    except (TypeError, ValueError):
        raise InputError(f"{where} must be a port number (1-65535), got {port!r}") from None
    if not 1 <= number <= 65535:
        raise InputError(f"{where} must be a port number (1-65535), got {number}")
    return number


def _loopback_store(port: int | None):
    """The rendezvous store of a single-node run, listening on 127.0.0.1 only, on `port` or a
    free one. torch's agent would bind its store to every interface; given a store of the same
    address and port in this process (multi_tenant), it uses this one instead."""
    import datetime

    from torch.distributed import TCPStore

    listener = _listen(LOOPBACK, port or 0, f"{LOOPBACK}:{port or 0}")
    port = listener.getsockname()[1]
    store = TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                     master_listen_fd=listener.fileno(), timeout=datetime.timedelta(seconds=900))
    return port, (listener, store)


def _check_port_free(port: int) -> None:
    """Node 0 of a multi-node run: the agent's store will listen on `port` on every interface;
    say now, in one line, if it cannot, rather than in a traceback after the rendezvous began."""
    _listen("", port, f"port {port} of this node (node 0)").close()


def _listen(address: str, port: int, where: str) -> socket.socket:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
    try:
        listener.bind((address, port))
    except OSError as exc:
        listener.close()
        raise InputError(f"the rendezvous cannot listen on {where}: {exc.strerror or exc}; "
                         f"pick another --master-port (or MASTER_PORT)") from None
    return listener


def _run_agent(config, entrypoint: str, args: list[str]) -> dict:
    """torch.distributed.launcher.api.launch_agent for the static rendezvous, with the agent
    below; returns the failures by global rank (empty when every worker succeeded)."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    master_addr, master_port = config.rdzv_endpoint.rsplit(":", 1)
    params = RendezvousParameters(backend=config.rdzv_backend, endpoint=config.rdzv_endpoint,
                                  run_id=config.run_id, min_nodes=config.min_nodes,
                                  max_nodes=config.max_nodes, local_addr=config.local_addr,
                                  **config.rdzv_configs)
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint,
                      args=tuple(args), rdzv_handler=get_rendezvous_handler(params),
                      max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
                      master_addr=master_addr, master_port=int(master_port),
                      local_addr=config.local_addr, numa_options=config.numa_options)
    agent = _stop_aware_agent()(spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
                                shutdown_timeout=config.shutdown_timeout)
    return agent.run().failures


def _stop_aware_agent():
    """torch's LocalElasticAgent, except that a run that ended in bad input (exit 2: the same
    input fails the same way again) or was stopped by a signal (every failed rank exited 128 +
    SIGTERM/SIGINT after saving, or was killed by it) is the end of the run, not a crash to
    restart: restarts are switched off the way torch itself does for a wedged worker. The ranks
    still running when the agent stops the others are noted (`_note_stopped`)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class StopAwareAgent(LocalElasticAgent):
        def _start_workers(self, worker_group):
            pids = super()._start_workers(worker_group)
            _note_stopped(self._pcontext)
            return pids

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                stopped = getattr(self._pcontext, "running_at_stop", set())
                for worker in worker_group.workers:
                    if worker.local_rank in stopped and worker.global_rank in result.failures:
                        result.failures[worker.global_rank].stopped_by_launcher = True
                if outcome(result.failures)[0] != 1:
                    self._remaining_restarts = 0
            return result

    return StopAwareAgent


def _note_stopped(pcontext) -> None:
    """Have `pcontext` (torch's processes of one attempt) note, when it first stops its workers
    (one failed), which local ranks were still running: what ends them then (SIGTERM, or
    SIGKILL after torch's 30 s) is the launcher's doing, not a failure of theirs."""
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if handlers is None:
        return
    close = pcontext.close

    def noting_close(*args, **kwargs):
        if not hasattr(pcontext, "running_at_stop"):
            pcontext.running_at_stop = {rank for rank, handler in handlers.items() if handler.proc.poll() is None}
        return close(*args, **kwargs)

    pcontext.close = noting_close


def stop_signal(failures: dict) -> signal.Signals | None:
    """The signal that stopped the run when every failed rank stopped because of SIGTERM or
    SIGINT (exit code 128 + N after saving, or -N: killed by it); None when any rank failed
    otherwise. The earliest failure names the signal."""
    signals = {}
    for rank, failure in failures.items():
        code = failure.exitcode
        number = code - 128 if code > 128 else -code
        if number not in STOP_SIGNALS:
            return None
        signals[(failure.timestamp, rank)] = signal.Signals(number)
    return signals[min(signals)] if signals else None


def _report(failures: dict) -> int:
    """Print `outcome`'s lines on stderr and return its exit status."""
    status, lines = outcome(failures)
    for line in lines:
        print(f"hputrain launch: {line}", file=sys.stderr)
    return status


def outcome(failures: dict) -> tuple[int, list[str]]:
    """(the exit status of a finished run, its lines): 0 and none after success; 128 + the
    signal that stopped it; else one line per failure of a rank's own (ranks that failed alike
    in one line), and 2 when every one of them was bad input (exit 2), else 1. Ranks that only
    ended because another failed (failure.py) or were stopped by the launcher say nothing."""
    if not failures:
        return 0, []
    failed = own_failures(failures)
    if not failed:
        requested = {rank: process for rank, process in failures.items() if not _ended_by_launcher(process)}
        stop = stop_signal(requested or failures)
        if stop is not None:
            exits = ", ".join(f"rank {rank} exited {failures[rank].exitcode}" for rank in sorted(failures))
            return 128 + stop, [f"stopped by {stop.name} ({exits}); exit {128 + stop}"]
        failed = _failure_elsewhere(failures)
    status = BAD_INPUT if all(_status(process) == BAD_INPUT for _, process in failed) else 1
    return status, failure_lines(failures, failed)


def own_failures(failures: dict) -> list[tuple[int, object]]:
    """(rank, failure), the first failure first, of the ranks that failed of their own: not
    those that ended quietly because another failed (their error file names it: failure.py),
    nor those stopped by a signal, unless they had said a line of their own first. Empty when
    every rank here ended so (the failure was on another node, or it was a requested stop)."""
    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    return [(rank, process) for rank, process in ordered if _kind(process) == "own"]


def _kind(process) -> str:
    """"peer" (ended quietly for another rank's failure), "stopped" (by a signal: a requested
    stop, or the launcher's after another rank failed) or "own"."""
    info = _extra_info(process)
    if info.get("peer"):
        return "peer"
    said = SimpleNamespace(exitcode=_status(process), timestamp=process.timestamp)
    if stop_signal({0: said}) is not None:
        return "stopped"
    if info.get("status") is not None:
        return "own"  # it said its line (failure.say), whatever ended it after
    return "stopped" if _ended_by_launcher(process) else "own"


def _ended_by_launcher(process) -> bool:
    """Killed by a signal while torch's agent was stopping the ranks still running after another
    failed (a rank blocked in an NCCL or HCCL collective ignores SIGTERM until SIGKILL)."""
    return getattr(process, "stopped_by_launcher", False) and process.exitcode < 0


def _extra_info(process) -> dict:
    """What entry.py (failure.write_error_file) wrote beside a rank's line: its status, or the
    failure it ended for (peer); {} for torch's own error files and for none."""
    data = getattr(process, "error_file_data", None)
    message = data.get("message") if isinstance(data, dict) else None
    info = message.get("extraInfo") if isinstance(message, dict) else None
    return info if isinstance(info, dict) else {}


def _status(process) -> int:
    """The status a failed rank said it ends with (its exit code, unless a signal ended it after)."""
    status = _extra_info(process).get("status")
    return status if isinstance(status, int) else process.exitcode


def _failure_elsewhere(failures: dict) -> list[tuple[int, object]]:
    """The failure of a rank on another node, as the ranks here that it ended learned it from
    the job's store (their error files carry it): [(its rank, its exit code and line)]; or,
    when none learned it, every rank here."""
    ordered = sorted(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    for _, process in ordered:
        peer = _extra_info(process).get("peer")
        if isinstance(peer, dict) and peer.get("rank") is not None:
            return [(peer["rank"], SimpleNamespace(exitcode=peer["status"], message=peer["line"]))]
    return ordered


def failure_lines(failures: dict, failed: list[tuple[int, object]] | None = None) -> list[str]:
    """'rank R failed (exit code C): its error' for each of `failed` (default `own_failures`),
    in one line for ranks that failed alike (the same status and line): 'ranks 0, 1 failed ...'."""
    failed = own_failures(failures) if failed is None else failed
    alike: dict[tuple[int, str], list[int]] = {}
    for rank, process in failed:
        alike.setdefault((_status(process), error_line(process.message)), []).append(rank)
    return [f"{_ranks(ranks)} failed (exit code {status}): {line}" for (status, line), ranks in alike.items()]


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0, 1', 'ranks 0-7, 9'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return "ranks " + ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in spans)


def error_line(message) -> str:
    """One line for a failed rank: the exception entry.py recorded ("ValueError: ..."), the last
    line it wrote to stderr before exiting, or torch's note on the signal that killed it."""
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message).strip()
    if not message or message.startswith("To enable traceback"):  # torch's text when it knows nothing
        return "exited without an error message (see its output above)"
    return message.splitlines()[0][:LINE_CHARS]


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch's agent logs a warning for each worker it signals and an error for each that
    fails; the launcher says it in one line instead. LOGLEVEL (torch's own switch) shows them."""
    if "LOGLEVEL" in os.environ:
        yield
        return
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.launcher")]
    sink, saved = logging.NullHandler(), [(log, log.propagate) for log in loggers]
    for log in loggers:
        log.addHandler(sink)
        log.propagate = False
    try:
        yield
    finally:
        for log, propagate in saved:
            log.removeHandler(sink)
            log.propagate = propagate


@contextlib.contextmanager
def _own_signal_handlers():
    """torch's agent installs handlers for AGENT_SIGNALS that turn a signal into an exception;
    put back what was there before once the run is over."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {number: signal.getsignal(number) for number in AGENT_SIGNALS}
    try:
        yield
    finally:
        for number, handler in saved.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


def env_int(name: str, default: int | None = None) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise InputError(f"{name} must be a whole number, got {value!r}") from None


ONE_PROCESS = "HPUTRAIN_ONE_PROCESS"
"""Set by `hputrain doctor` while it rehearses a script (its lazy dry run is one process): a run
that asks for more than one process runs as this one, rank 0 of one, and starts none."""


def needs_launch(devices: int, num_nodes: int) -> bool:
    """More than one process was asked for, and this process was not started by a launcher (nor
    asked to stay one: ONE_PROCESS)."""
    return (devices * num_nodes > 1 and "LOCAL_RANK" not in os.environ
            and not os.environ.get(ONE_PROCESS))


def relaunch_current_program(devices: int, num_nodes: int) -> int:
    """Run this program again in devices × num_nodes processes (this node's share), as Lightning
    does for Trainer(devices=N): with num_nodes > 1, MASTER_ADDR, MASTER_PORT, WORLD_SIZE and
    NODE_RANK come from the environment of every node."""
    world = env_int("WORLD_SIZE")
    if world is not None and world != devices * num_nodes:
        raise InputError(f"WORLD_SIZE={world}, but devices={devices} × num_nodes={num_nodes} is "
                         f"{devices * num_nodes}")
    port = os.environ.get("MASTER_PORT") or None
    return launch(current_program(), devices, num_nodes, env_int("NODE_RANK", 0),
                  os.environ.get("MASTER_ADDR") or None,
                  check_port(port, "MASTER_PORT") if port is not None else None)


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
