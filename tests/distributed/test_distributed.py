"""Processes launched through `hputrain launch` itself (gloo on the CPU): ddp and fast_ddp equal one
process with the doubled batch; two "nodes" started with Lightning's environment variables; a
killed rank ends the job; --max-restarts resumes from the checkpoint."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hputrain import TrainingArguments
from hputrain.distributed import ProcessGroup, select_strategy
from hputrain.distributed.launch import relaunch_current_program
from hputrain.errors import InputError
from hputrain.config.sections import ParallelismSettings

from .. import dist_script

ROOT = Path(__file__).parents[2]
SCRIPT = str(ROOT / "tests" / "dist_script.py")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HPUTRAIN_CONFIG_FILE": "/nonexistent/hputrain.json"}


def hputrain_launch(*argv, env=None, timeout=240):
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "launch", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env or ENV)
    return proc, time.time() - start


def weights(path):
    return torch.load(path)


def assert_close_to(model, path, tol=1e-4):
    saved = weights(path)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(saved[key], value, rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process with the doubled batch: what two processes of batch 4 must reproduce."""
    return dist_script.main([str(tmp_path_factory.mktemp("single")), "8", "single"])


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fast_ddp", marks=pytest.mark.slow)])
def test_two_processes_equal_one_with_the_doubled_batch(tmp_path, reference, strategy):
    proc, _ = hputrain_launch("--nproc-per-node", "2", SCRIPT, str(tmp_path), "4", strategy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(weights(tmp_path / "weights-rank0.pt")["wte.weight"],
                       weights(tmp_path / "weights-rank1.pt")["wte.weight"])
    assert_close_to(reference, tmp_path / "weights-rank0.pt")
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(l)]
    assert steps == list(range(1, 21))  # rank 0 alone writes


@pytest.mark.slow  # fast_ddp in make test: test_cp2_matches_cp1 and the pairwise table
def test_fast_ddp_with_bf16_gradients_stays_close(tmp_path, reference):
    proc, _ = hputrain_launch("--nproc-per-node", "2", SCRIPT, str(tmp_path), "4", "fast_ddp",
                              "--bf16-gradients")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_to(reference, tmp_path / "weights-rank0.pt", tol=2e-2)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # 10-23 s; `make test-slow` runs it (keeps `make test` near 20 minutes)
def test_two_nodes_started_by_environment_variables(tmp_path, reference):
    """Lightning's multi-node recipe: the same command on every node, with MASTER_ADDR,
    MASTER_PORT, WORLD_SIZE and NODE_RANK set; the Trainer launches its share of processes."""
    port = str(free_port())
    nodes = [subprocess.Popen([sys.executable, SCRIPT, str(tmp_path), "4", "ddp", "--num-nodes", "2"],
                              env={**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                   "WORLD_SIZE": "2", "NODE_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for rank in (0, 1)]
    for node in nodes:
        _, err = node.communicate(timeout=240)
        assert node.returncode == 0, err[-3000:]
    assert_close_to(reference, tmp_path / "weights-rank0.pt")
    assert_close_to(reference, tmp_path / "weights-rank1.pt")


def test_a_killed_rank_ends_the_job(tmp_path):
    proc, seconds = hputrain_launch("--nproc-per-node", "2", SCRIPT, str(tmp_path), "4", "ddp",
                                    "--kill-rank", "1", "--kill-step", "3")
    assert proc.returncode != 0 and seconds < 60
    assert "rank 1 failed (exit code -9)" in proc.stderr


@pytest.mark.slow  # 10-23 s; `make test-slow` runs it (keeps `make test` near 20 minutes)
def test_max_restarts_resumes_from_the_checkpoint(tmp_path, reference):
    proc, _ = hputrain_launch("--nproc-per-node", "2", "--max-restarts", "1", SCRIPT, str(tmp_path), "4",
                              "ddp", "--kill-rank", "1", "--kill-step", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    def steps(name):
        return [json.loads(l)["step"] for l in (tmp_path / name).read_text().splitlines()
                if "loss" in json.loads(l)]

    # steps 6.. ran again after resuming from 5: metrics.jsonl logs each step once, the first
    # attempt's records of steps past 5 are in metrics.superseded.jsonl (issue 47, item 16)
    assert steps("metrics.jsonl") == list(range(1, 21))
    assert steps("metrics.superseded.jsonl")[0] == 6 and 6 <= max(steps("metrics.superseded.jsonl")) <= 8
    assert_close_to(reference, tmp_path / "weights-rank0.pt")


def test_train_command_with_devices(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_bytes(Path(os.__file__).read_bytes()[:60_000])
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--devices", "2", "--corpus", str(corpus),
                           "--output-dir", str(out), "--max-steps", "4", "--seq-len", "32", "--logging-steps", "1",
                           "--per-device-train-batch-size", "2", "--disable-tqdm", "--cpu"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert (out / "checkpoint-4" / "rng_state_1.pt").exists()
    assert proc.stdout.count("checkpoint:") == 1  # rank 0 alone reports


@pytest.mark.slow  # make test: the pairwise table's refusals in the ranks (lazy+ddp2) check every rank's line
def test_train_command_with_devices_passes_bad_input_on(tmp_path):
    """Bad input ends the command in one line, exit 2: refused before any rank starts (the
    checkpoint to resume, checkpoint/start.py), or by each relaunched rank (said by the launcher)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_bytes(Path(os.__file__).read_bytes()[:20_000])
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--devices", "2", "--cpu", "--corpus",
                           str(corpus), "--output-dir", str(tmp_path / "run"), "--max-steps", "2", "--seq-len", "32",
                           "--disable-tqdm", "--resume-from-checkpoint", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=ENV)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = f"hputrain: error: Checkpoint folder {tmp_path / 'nowhere'} does not exist."
    said = [text for text in proc.stderr.splitlines() if text.strip()]  # said once, for the whole job
    assert len(said) == 1 and (said[0] == line or re.fullmatch(
        rf"hputrain launch: ranks? (0|1|0, 1) failed \(exit code 2\): {re.escape(line)}", said[0])), said


def test_launch_bad_input(tmp_path):
    proc, _ = hputrain_launch(str(tmp_path / "missing.py"))
    assert proc.returncode == 2 and "missing.py does not exist" in proc.stderr
    proc, _ = hputrain_launch("--nproc-per-node", "lots", SCRIPT)
    assert proc.returncode == 2 and "number or auto" in proc.stderr


def test_launch_passes_the_saved_defaults_on(tmp_path, monkeypatch):
    """What `hputrain config` saved (the CPU, 2 processes) reaches the launch under no flags;
    a flag typed wins. The launch itself: test_launch_reads_the_saved_defaults (slow)."""
    from hputrain.cli import launch as launch_command, main

    (tmp_path / "defaults.json").write_text(json.dumps({"accelerator": "cpu", "nproc_per_node": 2}))
    monkeypatch.setenv("HPUTRAIN_CONFIG_FILE", str(tmp_path / "defaults.json"))
    calls = []
    monkeypatch.setattr(launch_command, "launch", lambda *args: calls.append(args) or 0)
    assert main(["launch", SCRIPT, "x"]) == 0
    assert main(["launch", "--nproc-per-node", "3", SCRIPT]) == 0
    (target, nproc, nnodes, *_, cpu), (_, typed, *_) = calls
    assert (target, nproc, nnodes, cpu, typed) == ([SCRIPT, "x"], 2, 1, True, 3)


@pytest.mark.slow  # three interpreters; test_launch_passes_the_saved_defaults_on in make test
def test_launch_reads_the_saved_defaults(tmp_path):
    (tmp_path / "defaults.json").write_text(json.dumps({"accelerator": "cpu", "nproc_per_node": 2}))
    out = tmp_path / "out"
    out.mkdir()
    proc, _ = hputrain_launch(SCRIPT, str(out), "4", "ddp", "--steps", "2",
                              env={**ENV, "HPUTRAIN_CONFIG_FILE": str(tmp_path / "defaults.json")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "weights-rank1.pt").exists()


def test_strategy_selection():
    two = ProcessGroup(rank=0, local_rank=0, world_size=2, backend="gloo")
    one = ProcessGroup(rank=0, local_rank=0, world_size=1, backend="gloo")
    assert select_strategy(ParallelismSettings.of(TrainingArguments()), two).name == "ddp"
    assert select_strategy(ParallelismSettings.of(TrainingArguments(strategy="fast_ddp")), two).name == "fast_ddp"
    assert select_strategy(ParallelismSettings.of(TrainingArguments(strategy="ddp")), one).name == "single"
    with pytest.raises(InputError, match="strategy 'single' runs one process"):
        select_strategy(ParallelismSettings.of(TrainingArguments(strategy="single")), two)


def test_world_size_must_match_devices_and_nodes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(InputError, match="WORLD_SIZE=3, but devices=2 × num_nodes=2 is 4"):
        relaunch_current_program(2, 2)


# -- signals, failures and bad input at the launcher ---------------------------------------------

SIGNAL_SCRIPT = str(ROOT / "tests" / "signal_script.py")


def start_launch(*argv):
    return subprocess.Popen([sys.executable, "-m", "hputrain.cli", "launch", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)


def wait_for(condition, what, timeout=180):
    """Poll `condition` (a safety limit, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def worker_pids(out, ranks=2):
    wait_for(lambda: all((out / f"pid-{rank}").exists() for rank in range(ranks)), "the workers")
    return [int((out / f"pid-{rank}").read_text()) for rank in range(ranks)]


def running(pid):
    """The process exists and is not a zombie waiting for PID 1 to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def launcher_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("hputrain launch")]


@pytest.mark.parametrize("signum", [pytest.param(signal.SIGTERM, marks=pytest.mark.ci),
                                    pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_to_the_launcher_reaches_every_worker(tmp_path, signum):
    port = free_port()
    proc = start_launch("--nproc-per-node", "2", "--master-port", str(port), SIGNAL_SCRIPT, str(tmp_path), "wait")
    worker_pids(tmp_path)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-3000:]
    assert [(tmp_path / f"stopped-{rank}").read_text() for rank in (0, 1)] == [str(int(signum))] * 2
    assert len(launcher_lines(err)) == 1 and "Traceback" not in err, err[-3000:]
    # a single-node --master-port is honoured, on the loopback interface
    assert (tmp_path / "env-0").read_text() == f"127.0.0.1:{port}"


@pytest.mark.slow
def test_sigterm_to_one_rank_ends_the_job_without_a_restart(tmp_path):
    proc = start_launch("--nproc-per-node", "2", "--max-restarts", "1", SIGNAL_SCRIPT, str(tmp_path), "wait")
    pids = worker_pids(tmp_path)
    os.kill(pids[1], signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert launcher_lines(err) == ["hputrain launch: stopped by SIGTERM (rank 0 exited 143, rank 1 exited 143); "
                                   "exit 143"], err[-3000:]
    assert worker_pids(tmp_path) == pids  # not restarted
    assert (tmp_path / "stopped-0").exists() and (tmp_path / "stopped-1").exists()


@pytest.mark.ci
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux's")
def test_kill_9_of_the_launcher_leaves_no_worker(tmp_path):
    proc = start_launch("--nproc-per-node", "2", SIGNAL_SCRIPT, str(tmp_path), "wait")
    pids = worker_pids(tmp_path)
    assert all(running(pid) for pid in pids)
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 5
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in pids if running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive


@pytest.mark.slow
def test_a_failed_rank_is_named_with_its_last_error_line(tmp_path):
    proc = start_launch("--nproc-per-node", "2", SIGNAL_SCRIPT, str(tmp_path), "fail", "1")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    # rank 0 was only stopped by the launcher after rank 1 failed: not a failure of its own
    assert launcher_lines(err) == ["hputrain launch: rank 1 failed (exit code 3): rank 1: the data set is empty"]


@pytest.mark.parametrize("worker, status, lines", [
    # every rank's bad input, alike: said once, naming both ranks, exit 2
    (["exit", "2,2", "alike"], 2, ["ranks 0, 1 failed (exit code 2): the data set is empty"]),
    # every rank's bad input, each its own: one line each
    pytest.param(["exit", "2,2"], 2, [f"rank {r} failed (exit code 2): rank {r}: the data set is empty"
                                      for r in (0, 1)], marks=pytest.mark.slow),
    # bad input on one rank (exit 2): the other is stopped by the launcher, which exits 2
    pytest.param(["fail", "1", "2"], 2, ["rank 1 failed (exit code 2): rank 1: the data set is empty"],
                 marks=pytest.mark.slow),
    # bad input on one rank, a crash on the other: a crash
    pytest.param(["exit", "2,1"], 1, [f"rank {r} failed (exit code {c}): rank {r}: the data set is empty"
                                      for r, c in ((0, 2), (1, 1))], marks=pytest.mark.slow),
])
def test_bad_input_on_every_failed_rank_exits_2(tmp_path, worker, status, lines):
    proc = start_launch("--nproc-per-node", "2", SIGNAL_SCRIPT, str(tmp_path), *worker)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err[-3000:]
    assert sorted(launcher_lines(err)) == [f"hputrain launch: {line}" for line in lines], err[-3000:]


def test_the_launchers_status_after_failures():
    from types import SimpleNamespace

    from hputrain.distributed.launch import _report

    def failures(*codes):
        return {rank: SimpleNamespace(exitcode=code, timestamp=100 + rank, message="")
                for rank, code in enumerate(codes)}

    assert _report({}) == 0
    assert _report(failures(2)) == 2 and _report(failures(2, 2)) == 2
    assert _report(failures(2, -15)) == 2  # rank 1 only stopped by the launcher
    assert _report(failures(-15, 2)) == 2  # whichever came first
    assert _report(failures(2, 1)) == 1 and _report(failures(1, 2)) == 1 and _report(failures(2, -6)) == 1
    assert _report(failures(-15)) == 143 and _report(failures(3)) == 1


ENDING = '''
import atexit, sys, threading, time
out = sys.argv[1]
atexit.register(lambda: open(out + "/atexit", "w").write("ran"))
threading.Thread(target=lambda: (time.sleep(0.3), open(out + "/thread", "w").write("joined"))).start()
left_open = open(out + "/left-open", "w")  # never closed: flushed at exit
left_open.write("flushed")
print("no newline at the end", end="")
how = sys.argv[2]
if how == "raise":
    raise ValueError("the data set is empty")
if how != "return":
    sys.exit(int(how) if how.isdigit() else how)
'''


@pytest.mark.parametrize("how, status", [("return", 0), ("raise", 1), pytest.param("5", 5, marks=pytest.mark.slow),
                                         pytest.param("a message", 1, marks=pytest.mark.slow)])
def test_a_worker_ends_as_the_interpreter_would(tmp_path, how, status):
    """entry.py ends a worker with os._exit, skipping the interpreter's teardown (where Gloo's
    threads could abort it), after all else an ordinary exit does."""
    script = tmp_path / "ending.py"
    script.write_text(ENDING)
    proc = subprocess.run([sys.executable, "-m", "hputrain.distributed.entry", str(script), str(tmp_path), how],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=ENV)
    assert proc.returncode == status, proc.stderr[-3000:]
    assert proc.stdout == "no newline at the end"
    assert [(tmp_path / name).read_text() for name in ("atexit", "thread", "left-open")] == ["ran", "joined", "flushed"]
    if how == "raise":
        assert proc.stderr.startswith("Traceback") and "ValueError: the data set is empty" in proc.stderr
    if how == "a message":
        assert proc.stderr.strip() == "a message"


def test_stop_signal_tells_a_requested_stop_from_a_crash():
    from types import SimpleNamespace

    from hputrain.distributed.launch import stop_signal

    def failures(*codes):
        return {rank: SimpleNamespace(exitcode=code, timestamp=100) for rank, code in enumerate(codes)}

    assert stop_signal(failures(143, 143)) == signal.SIGTERM
    assert stop_signal(failures(130, -2)) == signal.SIGINT
    assert stop_signal(failures(143, -15)) == signal.SIGTERM  # a rank without a handler dies of it
    assert stop_signal(failures(143, -9)) is None  # killed after the shutdown timeout: a failure
    assert stop_signal(failures(1, 143)) is None and stop_signal(failures(3)) is None
    early = {0: SimpleNamespace(exitcode=143, timestamp=101), 1: SimpleNamespace(exitcode=130, timestamp=100)}
    assert stop_signal(early) == signal.SIGINT  # the first failure names the signal


def test_error_line_never_shows_torchs_pointer():
    from hputrain.distributed.launch import error_line

    assert error_line({"message": "ValueError: bad\nmore", "extraInfo": {}}) == "ValueError: bad"
    assert "traceback" not in error_line("To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
    assert error_line("Signal 9 (SIGKILL) received by PID 12") == "Signal 9 (SIGKILL) received by PID 12"


def test_the_worker_remembers_its_last_stderr_line():
    import io

    from hputrain.distributed.entry import _LastLine

    stream = _LastLine(io.StringIO())
    stream.write("Traceback-free output\nhputrain: error: the data")
    stream.write(" set is empty\n\n")
    assert stream.last == "hputrain: error: the data set is empty"
    stream.write("50%|#####     |\r")
    assert stream.last == "50%|#####     |" and stream.getvalue().startswith("Traceback-free")


def _main_status(argv, capsys):
    from hputrain import cli

    status = cli.main(argv)
    err = capsys.readouterr().err
    return status, err.strip().splitlines()


@pytest.mark.parametrize("argv, env, message", [
    (["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "0"], {}, "got 0"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "70000"], {}, "got 70000"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "http"], {}, "got 'http'"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1"], {"MASTER_PORT": "abc"}, "MASTER_PORT must be a port"),
    (["--nnodes", "2", "--master-port", "29511"], {}, "MASTER_ADDR (--master-addr) is not set"),
    (["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29511"], {"NODE_RANK": "one"},
     "NODE_RANK must be a whole number"),
])
def test_launch_bad_ports_and_environment(argv, env, message, capsys, monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    status, lines = _main_status(["launch", "--nproc-per-node", "2", *argv, SIGNAL_SCRIPT], capsys)
    assert status == 2 and len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("nodes", [["--nnodes", "1"], ["--nnodes", "2", "--master-addr", "127.0.0.1"]])
def test_launch_on_a_busy_port_is_one_line(nodes, capsys, monkeypatch):
    monkeypatch.delenv("NODE_RANK", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        status, lines = _main_status(["launch", "--nproc-per-node", "2", *nodes, "--master-port", str(port),
                                      SIGNAL_SCRIPT], capsys)
    assert status == 2 and len(lines) == 1 and f"{port}" in lines[0] and "in use" in lines[0], lines


def test_world_size_without_master_addr_is_one_line(monkeypatch):
    from hputrain.distributed.launch import relaunch_current_program

    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match="WORLD_SIZE=2 is set, but MASTER_ADDR and MASTER_PORT are not"):
        ProcessGroup.from_env("gloo")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "abc")
    with pytest.raises(InputError, match="MASTER_PORT must be a port number"):
        ProcessGroup.from_env("gloo")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(InputError, match="WORLD_SIZE must be a whole number"):
        relaunch_current_program(2, 1)


# -- the Trainer's stop across processes (needs the ranks to agree on stopping) --------------------

@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc, _ = hputrain_launch("--nproc-per-node", "2", SCRIPT, str(out), "4", "ddp", "--steps", "30")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return weights(out / "weights-rank0.pt")


def loss_steps(out):
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(l)["step"] for l in lines[:-1] if "loss" in json.loads(l)]  # the last may be torn


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "rank 1"])
def test_sigterm_saves_one_checkpoint_that_resumes_bit_for_bit(tmp_path, uninterrupted, target):
    proc = start_launch("--nproc-per-node", "2", SCRIPT, str(tmp_path), "4", "ddp", "--steps", "30",
                        "--step-sleep", "0.3")
    pids = worker_pids(tmp_path)
    wait_for(lambda: len(loss_steps(tmp_path)) >= 3, "training steps")
    os.kill(proc.pid if target == "launcher" else pids[1], signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert len(launcher_lines(err)) == 1 and "Traceback" not in err, err[-3000:]
    stop = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert stop < 30 and (tmp_path / f"checkpoint-{stop}" / "rng_state_1.pt").exists()
    assert not (tmp_path / "weights-rank0.pt").exists()
    proc, _ = hputrain_launch("--nproc-per-node", "2", SCRIPT, str(tmp_path), "4", "ddp", "--steps", "30",
                              "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for key, value in weights(tmp_path / "weights-rank0.pt").items():
        assert torch.equal(value, uninterrupted[key]), key
