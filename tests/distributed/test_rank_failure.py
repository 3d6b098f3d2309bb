"""Issue 39 item 2: an error on one rank only ends the whole job with that rank's one line, said
once, and its exit status (2 for bad input), whichever rank fails and wherever; the other ranks
end quietly, without a traceback (distributed/failure.py), and the checkpoints already written
stay whole.

Each timing is forced on purpose (tests/rank_failure_script.py): the failing rank waits until
the other is inside the collective (an all-reduce, the first barrier, a save's barrier), or fails
before it joins the process group; and, through `hputrain train --devices 2`, a reward function
that raises on rank 1's completions only (an all-gather waits for it) and a torn line in a
streamed shard that only rank 0 reads (an all-reduce waits for it). Every rank's error file is
kept under PET_LOG_DIR (torchrun's variable): a rank that ended itself says which rank it ended
for."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hputrain.distributed import failure
from hputrain.distributed.launch import _report, outcome

ROOT = Path(__file__).parents[2]
SCRIPT = str(ROOT / "tests" / "rank_failure_script.py")
TIMEOUT = 420  # seconds for one launch; past it the launcher is killed, and its workers with it
TINY = ["--max-steps", "6", "--save-steps", "2", "--seq-len", "32", "--per-device-train-batch-size", "2",
        "--logging-steps", "1", "--disable-tqdm"]
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                    "rng_state_0.pt", "rng_state_1.pt")


# -- the launcher's report, and the record in the store (no processes) ------------------------

RECORD = {"rank": 0, "status": 2, "line": "hputrain: error: the data set is empty"}


def _failures(*codes, peer=RECORD):
    """Failures by rank as torch's agent gives them: ENDED_BY_PEER ranks wrote `peer` in their
    error file (failure.write_error_file); the others wrote none."""
    data = {"message": {"message": "", "extraInfo": {"peer": peer}}}
    return {rank: SimpleNamespace(exitcode=code, timestamp=100 + rank, message=f"line of rank {rank}",
                                  error_file_data=data if code == failure.ENDED_BY_PEER else {"message": "<NONE>"})
            for rank, code in enumerate(codes)}


def test_the_launcher_names_the_failed_rank_not_the_ranks_it_ended(capsys):
    ended = failure.ENDED_BY_PEER
    assert _report(_failures(2, ended)) == 2 and _report(_failures(ended, 2)) == 2
    assert capsys.readouterr().err.splitlines() == [
        "hputrain launch: rank 0 failed (exit code 2): line of rank 0",
        "hputrain launch: rank 1 failed (exit code 2): line of rank 1"]
    assert _report(_failures(1, ended)) == 1 and _report(_failures(ended, -15, 2)) == 2
    capsys.readouterr()
    # every rank of this node ended for a rank of another node: its line, from the store
    peer = {"rank": 5, "status": 2, "line": "hputrain: error: the data set is empty"}
    assert _report(_failures(ended, ended, peer=peer)) == 2
    assert capsys.readouterr().err == "hputrain launch: rank 5 failed (exit code 2): " + peer["line"] + "\n"
    assert _report(_failures(ended, peer={"rank": None, "status": None, "line": "gone"})) == 1


def test_a_scripts_own_exit_75_is_its_failure_not_a_peers_end(capsys):
    """Exit status 75 (EX_TEMPFAIL, "retry later") says nothing of a peer: only an error file
    naming the peer's failure does. Without one, the rank failed, in one line; torch's error
    data of a rank without an error file ({"message": "<NONE>"}) is no crash of the launcher."""
    def exit_75(*others):
        failures = {0: SimpleNamespace(exitcode=75, timestamp=100, message="retry later",
                                       error_file_data={"message": {"message": "retry later",
                                                                    "extraInfo": {"status": 75, "peer": None}}})}
        failures.update({rank: SimpleNamespace(exitcode=code, timestamp=101, message="",
                                               error_file_data={"message": "<NONE>"})
                         for rank, code in enumerate(others, 1)})
        return failures

    for others in ((), (-15,), (-15, -15)):
        assert _report(exit_75(*others)) == 1
        assert capsys.readouterr().err == "hputrain launch: rank 0 failed (exit code 75): retry later\n"
    bare = {1: SimpleNamespace(exitcode=75, timestamp=100, message="", error_file_data={"message": "<NONE>"}),
            0: SimpleNamespace(exitcode=-15, timestamp=100, message="", error_file_data={"message": "<NONE>"})}
    assert _report(bare) == 1  # no error file at all (a script under plain python): its code
    assert "rank 1 failed (exit code 75)" in capsys.readouterr().err


def test_ranks_that_failed_alike_are_said_once(capsys):
    """Bad input every rank met alike (the same status and line, from a script that says it on
    every rank, or from ranks that failed before joining the store): one line, naming them."""
    alike = {rank: SimpleNamespace(exitcode=2, timestamp=100, message="hputrain: error: no reward function",
                                   error_file_data={}) for rank in range(4)}
    assert _report(alike) == 2
    assert capsys.readouterr().err == ("hputrain launch: ranks 0-3 failed (exit code 2): hputrain: error: "
                                       "no reward function\n")
    alike[2].exitcode, alike[3].message = 1, "another line"
    assert _report(alike) == 1
    assert capsys.readouterr().err.splitlines() == [
        "hputrain launch: ranks 0, 1 failed (exit code 2): hputrain: error: no reward function",
        "hputrain launch: rank 2 failed (exit code 1): hputrain: error: no reward function",
        "hputrain launch: rank 3 failed (exit code 2): another line"]


def test_a_rank_the_launcher_killed_after_another_failed_says_nothing(capsys):
    """A rank blocked in an NCCL or HCCL collective outlives the agent's SIGTERM and dies of its
    SIGKILL: no failure of its own when it was still running as the agent stopped the ranks."""
    def failures(code, killed, marked):
        return {0: SimpleNamespace(exitcode=code, timestamp=100, message="line of rank 0", error_file_data={}),
                1: SimpleNamespace(exitcode=killed, timestamp=100, message="Signal 9 (SIGKILL) received by PID 7",
                                   error_file_data={"message": "<NONE>"}, stopped_by_launcher=marked)}

    assert _report(failures(2, -9, True)) == 2
    assert capsys.readouterr().err == "hputrain launch: rank 0 failed (exit code 2): line of rank 0\n"
    assert _report(failures(143, -9, True)) == 143  # a requested stop, and a rank that ignored it
    assert "stopped by SIGTERM" in capsys.readouterr().err
    assert _report(failures(2, -9, False)) == 1  # killed before the agent stopped anything: a failure
    assert "rank 1 failed (exit code -9)" in capsys.readouterr().err


def test_bad_input_and_stops_are_never_restarted():
    """The launcher's agent restarts (--max-restarts) only what `outcome` calls a failure (1)."""
    def status(*codes, **kw):
        return outcome(_failures(*codes, **kw))[0]

    ended = failure.ENDED_BY_PEER
    assert status(2, ended) == 2 and status(-15, ended) == 2  # the failing rank killed after it recorded
    assert status(2, 2) == 2 and status(143, 143) == 143
    assert status(-9) == 1 and status(1, ended, peer={**RECORD, "status": 1}) == 1
    assert status(75, peer=None) == 1  # its own exit 75: a failure, restarted
    said = _failures(-15, ended)  # killed by the agent after it wrote its line: its status, not the signal's
    said[0].error_file_data = {"message": {"message": "bad", "extraInfo": {"status": 2, "peer": None}}}
    said[0].message = "bad"
    assert outcome(said) == (2, ["rank 0 failed (exit code 2): bad"])
    for rank in (0, 1):  # each saved and exited 143 (entry.py notes the status of any exit)
        said[rank].exitcode = 143
        said[rank].error_file_data = {"message": {"message": "", "extraInfo": {"status": 143, "peer": None}}}
    assert outcome(said)[0] == 143


class _Store:
    """The process group's store, as failure.py uses it; `gone` makes it raise as a store that
    does not answer (a timeout), `events` notes each write."""

    def __init__(self, events=None):
        self.values, self.gone, self.events = {}, False, events if events is not None else []

    def compare_set(self, key, expected, desired):
        self._answer()
        self.events.append(("store", key))
        if key not in self.values and expected == "":
            self.values[key] = desired.encode()
        return self.values[key]

    def check(self, keys):
        self._answer()
        return all(key in self.values for key in keys)

    def get(self, key):
        self._answer()
        return self.values[key]

    def _answer(self):
        if self.gone:
            from torch.distributed import DistStoreError

            raise DistStoreError("wait timeout after 30000ms, keys: /hputrain/failed_rank")


@pytest.fixture
def rank_of(monkeypatch):
    """A fresh failure.py state, on the rank and store `rank_of(store, rank)` says."""
    for name, value in (("_peer", None), ("_own", None), ("_ended_for", None), ("_said_by_launcher", False)):
        monkeypatch.setattr(failure, name, value, raising=False)

    def be(store, rank):
        monkeypatch.setattr(failure, "_store", lambda: (store, rank))
        monkeypatch.setenv("RANK", str(rank))
        for name in ("_peer", "_own", "_ended_for"):
            monkeypatch.setattr(failure, name, None, raising=False)

    return be


def test_the_first_failure_is_recorded_for_the_other_ranks(rank_of, capsys, monkeypatch):
    store = _Store()
    rank_of(store, 1)
    assert failure.peer_failure() is None  # nothing recorded: an error is this rank's own
    assert failure.say("hputrain: error: bad", 2) == 2
    assert capsys.readouterr().err == "hputrain: error: bad\n" and failure.own_line() == "hputrain: error: bad"
    assert failure.peer_failure() is None  # its own record is no peer's
    rank_of(store, 0)
    failure.record("RuntimeError: Connection closed by peer", 1)  # an echo recorded later: the first stays
    assert failure.peer_failure() == {"rank": 1, "status": 2, "line": "hputrain: error: bad"}
    monkeypatch.setattr(failure, "_said_by_launcher", True)  # under `hputrain launch`: it says the line
    monkeypatch.delenv(failure.ERROR_FILE, raising=False)
    failure.say("hputrain: error: worse", 2)
    assert capsys.readouterr().err == ""


def test_a_line_every_rank_meets_is_said_once(rank_of, capsys):
    """The first rank to say a line says it; a rank meeting the same error after it says nothing
    and ends quietly for that rank's record; another line is said too."""
    store = _Store()
    rank_of(store, 1)
    line = "hputrain: error: reward function tens returned 3 rewards for 4 completions"
    assert failure.say(line, 2) == 2
    rank_of(store, 0)
    assert failure.say(line, 2) == failure.ENDED_BY_PEER
    assert capsys.readouterr().err == line + "\n"
    assert failure.ended_for() == {"rank": 1, "status": 2, "line": line} and failure.own_line() is None
    rank_of(store, 2)
    assert failure.say("hputrain: error: another", 2) == 2
    assert capsys.readouterr().err == "hputrain: error: another\n"


def test_a_line_is_said_before_it_is_recorded(rank_of, monkeypatch, tmp_path):
    """On stderr (plain torchrun, mpirun) or in the error file for the launcher, the line is out
    before the record that lets the other ranks end (and have the job stopped)."""
    events = []
    store = _Store(events)

    class Stderr:
        def write(self, text):
            events.append(("stderr", text.strip())) if text.strip() else None

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Stderr())
    rank_of(store, 1)
    failure.say("hputrain: error: bad", 2)
    assert events.index(("stderr", "hputrain: error: bad")) < events.index(("store", failure.KEY))
    events.clear()
    error_file = tmp_path / "error.json"
    monkeypatch.setenv(failure.ERROR_FILE, str(error_file))
    monkeypatch.setattr(failure, "_said_by_launcher", True)
    monkeypatch.setattr(store, "values", {})
    monkeypatch.setattr(failure, "record", lambda *a: events.append(("record", error_file.exists())))
    rank_of(store, 1)
    failure.say("hputrain: error: bad", 2)
    assert events[-1] == ("record", True)
    said = json.loads(error_file.read_text())["message"]
    assert said["message"] == "hputrain: error: bad" and said["extraInfo"]["status"] == 2


def test_a_store_that_does_not_answer_tells_nothing(rank_of, capsys):
    """A slow or unreachable store is no peer's failure: a rank's own error is said; only an
    error that itself says a peer is gone (rank 0, holding the store under mpirun, is gone with
    it) ends the rank quietly."""
    store = _Store()
    store.gone = True
    rank_of(store, 1)
    assert failure.peer_failure() is None
    assert failure.echo_of_peer(ValueError("no score for rank 1's completions")) is None  # its own
    lost = failure.echo_of_peer(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1441"))
    assert lost["rank"] is None and "Connection closed by peer" in lost["line"]
    start = time.monotonic()
    assert failure.said_by_rank_0() is None and time.monotonic() - start < 5  # rank 1 says it itself
    assert failure.say("hputrain: error: bad", 2) == 2
    assert capsys.readouterr().err == "hputrain: error: bad\n"


def test_the_watchdog_ends_a_rank_blocked_when_another_failed(rank_of, monkeypatch):
    """A rank blocked in an NCCL or HCCL collective (which a peer's exit does not break) is
    ended quietly by its watchdog once another rank's failure is recorded; never for its own."""
    import threading

    monkeypatch.setattr(failure, "WATCH_SECONDS", 0.01)
    monkeypatch.setattr(failure, "GRACE_SECONDS", 0.01)
    ended = []
    monkeypatch.setattr(failure, "_end_now", ended.append)
    store = _Store()
    rank_of(store, 0)
    failure.record("hputrain: error: bad", 2)
    failure._watch(store, 0, threading.Event())  # its own record: it stops watching
    rank_of(store, 1)
    failure._watch(store, 1, threading.Event())
    assert ended == [{"rank": 0, "status": 2, "line": "hputrain: error: bad"}]
    monkeypatch.setattr(failure, "_own", "hputrain: error: mine")  # says a line of its own: left alone
    failure._watch(store, 1, threading.Event())
    assert len(ended) == 1


def test_a_worker_records_its_own_exit_but_not_a_stop(tmp_path, monkeypatch, rank_of):
    """entry.py: a worker's own non-zero exit (75 too) is its failure, written in its error file
    with its status and then recorded for the other ranks; an exit 128 + SIGTERM/SIGINT (the
    stop every rank agreed on) is written but not recorded: no rank is to end for it."""
    from hputrain.distributed import entry

    recorded, error_file = [], tmp_path / "error.json"
    monkeypatch.setattr(entry, "_die_with_launcher", lambda: None)
    monkeypatch.setattr(failure, "record", lambda line, status: recorded.append((line, status)))
    monkeypatch.setattr(sys, "stderr", sys.stderr)  # entry.main wraps it
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv(failure.ERROR_FILE, str(error_file))
    for code in (143, 130, 75, 2):
        script = tmp_path / f"exit_{code}.py"
        script.write_text(f"import sys\nprint('why {code}', file=sys.stderr)\nsys.exit({code})\n")
        monkeypatch.setattr(sys, "argv", ["entry.py", str(script)])
        with pytest.raises(SystemExit):
            entry.main()
        written = json.loads(error_file.read_text())["message"]
        assert (written["message"], written["extraInfo"]["status"], written["extraInfo"]["peer"]) == (
            f"why {code}", code, None)
    assert recorded == [("why 75", 75), ("why 2", 2)]


# -- processes ------------------------------------------------------------------------------------

def _env(tmp_path: Path) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "HPUTRAIN_ACCELERATOR": "cpu",
            "HPUTRAIN_CONFIG_FILE": "/nonexistent/hputrain.json", "PET_LOG_DIR": str(tmp_path / "logs")}


def _run(argv: list[str], tmp_path: Path) -> SimpleNamespace:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=ROOT, env=_env(tmp_path))
    # every rank's output (they share the console) kept beside their error files
    (tmp_path / "logs").mkdir(exist_ok=True)
    (tmp_path / "logs" / "console.txt").write_text(f"{argv}\nexit {proc.returncode}\n--- stdout\n"
                                                  f"{proc.stdout}\n--- stderr\n{proc.stderr}")
    return SimpleNamespace(status=proc.returncode, out=proc.stdout, err=proc.stderr,
                           seconds=time.monotonic() - start, logs=tmp_path / "logs")


def corpus(tmp_path: Path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir(exist_ok=True)
    (folder / "a.py").write_bytes(Path(os.__file__).read_bytes()[:40_000])
    return folder


def launch_failing(tmp_path: Path, rank: int, method: str, call: int, *more: str) -> SimpleNamespace:
    """Two ranks of `hputrain train` (the built-in GPT, 6 steps, a save every 2), rank RANK
    failing at its CALL-th ProcessGroup.METHOD call (rank_failure_script.py)."""
    run = _run(["-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node", "2", SCRIPT, str(rank), method,
                str(call), "train", "--corpus", str(corpus(tmp_path)), "--output-dir", str(tmp_path / "run"),
                *TINY, *more], tmp_path)
    run.pids = [int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1) if (tmp_path / f"pid-{r}").exists()]
    return run


def assert_one_line(run: SimpleNamespace, rank: int, line: str) -> None:
    """Exit 2; the failing rank's line said once, by the launcher, naming it; no traceback; each
    other rank's error file (if it ended itself, not the launcher's SIGTERM) names that rank."""
    said = run.out + run.err
    why = f"exit {run.status}\n{said[-5000:]}"
    assert run.status == 2, why
    assert said.count(line) == 1, why
    assert f"hputrain launch: rank {rank} failed (exit code 2): hputrain: error: {line}" in run.err.splitlines(), why
    assert "Traceback" not in said and "Connection closed" not in said, why
    for other in {0, 1} - {rank}:
        for path in run.logs.glob(f"*/attempt_0/{other}/error.json"):
            peer = json.loads(path.read_text())["message"]["extraInfo"].get("peer")
            assert peer is not None and peer["rank"] == rank and line in peer["line"], path.read_text()
    for pid in getattr(run, "pids", []):
        assert not _alive(pid), f"rank process {pid} was left behind"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def checkpoints(run: Path) -> list[str]:
    """The checkpoint folders in `run` (none when the run never made its folder)."""
    return sorted(p.name for p in run.glob("checkpoint-*"))


def assert_whole(folder: Path, step: int) -> None:
    """checkpoint-STEP is there, every file of it readable (both ranks' RNG states)."""
    from safetensors.torch import load_file

    assert all((folder / name).is_file() for name in CHECKPOINT_FILES), sorted(os.listdir(folder))
    assert load_file(folder / "model.safetensors")
    assert json.loads((folder / "trainer_state.json").read_text())["step"] == step
    for name in CHECKPOINT_FILES:
        if name.endswith(".pt"):
            torch.load(folder / name, weights_only=True)


@pytest.mark.ci
def test_rank_1_failing_while_rank_0_waits_in_an_all_reduce(tmp_path):
    """The representative case: step 4's agreement (an all-reduce), after the save of step 2."""
    run = launch_failing(tmp_path, 1, "host_sum", 5)
    assert_one_line(run, 1, "rank 1 refused its host_sum call 5 on purpose")
    assert checkpoints(tmp_path / "run") == ["checkpoint-2"]
    assert_whole(tmp_path / "run" / "checkpoint-2", 2)


@pytest.mark.slow
@pytest.mark.parametrize("rank, method, call, saved", [
    (0, "host_sum", 5, 2),  # rank 0 (which holds the output folder's lock) fails, rank 1 waits
    (1, "barrier", 1, 0),  # before the first collective of training
    (0, "init", 1, 0),  # before joining the process group: rank 1 waits in the rendezvous
])
def test_either_rank_failing_anywhere_ends_the_job_in_its_line(tmp_path, rank, method, call, saved):
    run = launch_failing(tmp_path, rank, method, call)
    assert_one_line(run, rank, f"rank {rank} refused its {method} call {call} on purpose")
    assert checkpoints(tmp_path / "run") == ([f"checkpoint-{saved}"] if saved else [])
    if saved:
        assert_whole(tmp_path / "run" / f"checkpoint-{saved}", saved)


@pytest.mark.slow
def test_a_failure_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path):
    """Rank 1 fails in the save of step 4 (its second barrier: files written, not yet renamed),
    while rank 0 waits there; the same command with --resume-from-checkpoint latest then resumes
    from step 2 and finishes."""
    run = launch_failing(tmp_path, 1, "barrier", 6)
    assert_one_line(run, 1, "rank 1 refused its barrier call 6 on purpose")
    assert checkpoints(tmp_path / "run") == ["checkpoint-2"]  # checkpoint 4 was never renamed in
    assert_whole(tmp_path / "run" / "checkpoint-2", 2)
    again = launch_failing(tmp_path, 9, "barrier", 1, "--resume-from-checkpoint", "latest")  # no rank 9
    assert again.status == 0, again.err[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-4:] == [3, 4, 5, 6]
    assert_whole(tmp_path / "run" / "checkpoint-6", 6)


# -- `hputrain train --devices 2`: a user's reward function, a torn streamed shard ---------------

REWARDS = '''import os
calls = []
def tens(prompts, completions, completion_ids, **_):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 2:
        raise ValueError("no score for rank 1's completions")
    return [sum(t % 10 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]
'''


def grpo_on_two_ranks(tmp_path: Path, rewards: str, name: str) -> SimpleNamespace:
    """`hputrain train --devices 2` of GRPO on a tiny Llama (3 steps, a save each), with the
    reward function NAME of the file whose text is `rewards`."""
    from ..hf_fixtures import tiny_llama_folder

    model = tiny_llama_folder(tmp_path / "llama", seed=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["the quick", "to be or", "a stitch", "def add", "that is", "a penny"]))
    (tmp_path / "rewards.py").write_text(rewards)
    return _run(["-m", "hputrain.cli", "train", "--cpu", "--devices", "2", "--model", str(model),
                 "--dataset", str(prompts), "--reward-funcs", f"{tmp_path / 'rewards.py'}:{name}",
                 "--num-generations", "4", "--max-completion-length", "8", "--per-device-train-batch-size", "4",
                 "--max-steps", "3", "--save-steps", "1", "--disable-tqdm", "--validation-split-percentage", "0",
                 "--output-dir", str(tmp_path / "run")], tmp_path)


@pytest.mark.slow
def test_a_reward_function_raising_on_rank_1_only(tmp_path):
    """GRPO: rank 1's reward function raises at step 2, while rank 0 waits in the all-gather of
    the rewards; checkpoint 1 stays whole."""
    run = grpo_on_two_ranks(tmp_path, REWARDS, "tens")
    line = "reward function tens raised ValueError: no score for rank 1's completions at step 2"
    assert_one_line(run, 1, line)
    assert checkpoints(tmp_path / "run") == ["checkpoint-1"]
    assert_whole(tmp_path / "run" / "checkpoint-1", 1)


ALIKE = {  # a reward error every rank meets alike: (the function to name, its line)
    "raises": ("tens", "reward function tens raised ValueError: no score at step 1"),
    "missing": ("elevens", "has no 'elevens'"),
    "wrong length": ("short", "reward function short returned 3 rewards for 4 completions"),
}
ALIKE_REWARDS = '''
def tens(prompts, completions, completion_ids, **_):
    raise ValueError("no score")
def short(prompts, completions, completion_ids, **_):
    return [0.5] * (len(completions) - 1)
'''


@pytest.mark.slow
@pytest.mark.parametrize("case", list(ALIKE))
def test_a_reward_error_of_every_rank_is_said_once(tmp_path, case):
    """GRPO on 2 ranks: a reward function that raises on every rank, one that is missing, one
    that returns a reward too few: the same line on each rank, said once for the job, exit 2."""
    name, text = ALIKE[case]
    run = grpo_on_two_ranks(tmp_path, ALIKE_REWARDS, name)
    said = [line for line in (run.out + run.err).splitlines() if text in line]
    assert run.status == 2 and len(said) == 1, f"exit {run.status}\n{run.err[-3000:]}"
    assert re.fullmatch(r"hputrain launch: ranks? (0|1|0, 1) failed \(exit code 2\): hputrain: error: .*",
                        said[0]), said
    assert "Traceback" not in run.err


@pytest.mark.slow
def test_a_torn_line_in_a_shard_only_rank_0_reads(tmp_path):
    """--streaming: rank 0 reads shard 0, whose row 8 is cut short, after the first save, while
    rank 1 waits in the step's agreement (an all-reduce); the checkpoint of step 2 stays whole."""
    from ..hf_fixtures import tiny_llama_folder
    from ..data.test_streaming import text_rows, write_shards

    model = tiny_llama_folder(tmp_path / "llama", seed=0)
    shards = write_shards(tmp_path / "shards", [text_rows(0, 40), text_rows(1, 40)])
    rows = (shards / "part-000.jsonl").read_text().splitlines(keepends=True)
    rows[7] = rows[7][:20] + "\n"
    (shards / "part-000.jsonl").write_text("".join(rows))
    run = _run(["-m", "hputrain.cli", "train", "--cpu", "--devices", "2", "--model", str(model),
                "--dataset", str(shards), "--streaming", "--block-size", "32", "--max-steps", "60",
                "--save-steps", "2", "--per-device-train-batch-size", "2", "--disable-tqdm",
                "--output-dir", str(tmp_path / "run")], tmp_path)
    line = re.search(r"--dataset \S*part-000\.jsonl row 8 is not a JSON object[^\n]*", run.err)
    assert line, run.err[-3000:]
    assert_one_line(run, 0, line[0])
    saved = sorted(int(name.split("-")[1]) for name in checkpoints(tmp_path / "run"))
    assert saved, "the torn row came before the first save"
    for step in saved:
        assert_whole(tmp_path / "run" / f"checkpoint-{step}", step)


# -- issue 46: a script's own exit 75, every rank alike, a hung collective, a refused restart -----

EXIT_75 = '''import os, sys, time
if sys.argv[1] == "group":
    import torch.distributed as dist
    dist.init_process_group("gloo")
if os.environ["RANK"] == "1":
    time.sleep(1.0)
    print("retry later", file=sys.stderr)
    sys.exit(75)  # EX_TEMPFAIL: a failure of this script, no peer's
if sys.argv[1] == "group":
    dist.barrier()  # broken by rank 1's exit: the echo of its failure
else:
    time.sleep(60)  # ended by the launcher
'''


@pytest.mark.parametrize("group", ["none", pytest.param("group", marks=pytest.mark.slow)])
def test_a_scripts_own_exit_75_is_said_as_its_failure(tmp_path, group):
    """Exit 75 is no peer's end unless the store says so: rank 1's own exit 75 is reported in its
    line, with or without a process group (rank 0, in a barrier it broke, ends quietly)."""
    script = tmp_path / "exit_75.py"
    script.write_text(EXIT_75)
    run = _run(["-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node", "2", str(script), group], tmp_path)
    assert run.status == 1, run.err[-3000:]
    assert [line for line in run.err.splitlines() if line.strip() and line != "retry later"] == [
        "hputrain launch: rank 1 failed (exit code 75): retry later"], run.err[-3000:]


@pytest.mark.slow
def test_every_rank_failing_alike_is_said_once(tmp_path):
    """Bad input every rank meets alike (both refuse step 3's all-reduce, with the same line):
    the first rank to say it says it, the other ends quietly."""
    run = launch_failing(tmp_path, "all", "host_sum", 3)
    said = [line for line in run.err.splitlines() if "refused its host_sum call 3" in line]
    assert run.status == 2 and len(said) == 1, run.err[-3000:]
    assert re.fullmatch(r"hputrain launch: rank [01] failed \(exit code 2\): hputrain: error: every rank "
                        r"refused its host_sum call 3 on purpose", said[0]), said
    assert "Traceback" not in run.err


@pytest.mark.slow
def test_a_rank_blocked_in_a_collective_ends_when_the_other_fails(tmp_path):
    """NCCL and HCCL: rank 0 waits in C++ (a stand-in for a collective its peer's exit does not
    break; the agent's SIGTERM does not reach it either) while rank 1 fails: its watchdog ends
    it quietly for rank 1's record, long before the agent's SIGKILL (30 s), and the job ends
    in rank 1's one line."""
    run = launch_failing(tmp_path, 1, "host_sum+hang", 5)
    assert_one_line(run, 1, "rank 1 refused its host_sum call 5 on purpose")
    assert "exit code -9" not in run.err
    ended = [json.loads(path.read_text())["message"] for path in run.logs.glob("*/attempt_0/0/error.json")]
    assert ended and ended[0]["extraInfo"]["peer"]["rank"] == 1, ended  # by its watchdog


BLOCKED = '''import datetime, os, signal, sys, time
import torch.distributed as dist
signal.signal(signal.SIGTERM, lambda *_: None)  # as a Trainer's: Python runs it between bytecodes only
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(1.0)
    print("rank 1: the data set is empty", file=sys.stderr)
    sys.exit(3)
store = dist.distributed_c10d._get_default_store().clone()
store.set_timeout(datetime.timedelta(seconds=300))
store.wait(["never"])  # blocked in C++, as in an NCCL collective whose peer is gone
'''


@pytest.mark.slow
def test_a_rank_the_launcher_had_to_kill_after_another_failed_says_nothing(tmp_path):
    """A script's own process group (no hputrain watchdog): rank 0, blocked in C++, outlives the
    agent's SIGTERM and dies of its SIGKILL 30 s later; only rank 1's failure is said."""
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED)
    run = _run(["-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node", "2", str(script)], tmp_path)
    assert run.status == 1, run.err[-3000:]
    assert [line for line in run.err.splitlines() if line.startswith("hputrain launch")] == [
        "hputrain launch: rank 1 failed (exit code 3): rank 1: the data set is empty"], run.err[-3000:]


@pytest.mark.slow
def test_a_refused_run_is_not_restarted(tmp_path):
    """"Refused run under restarts": a 4-step run, then the same command with --max-steps 8
    --max-restarts 2. Bad input is never restarted: exit 2, the refusal said once, one attempt,
    and the folder as the first run left it (no checkpoint-8, metrics.jsonl unchanged)."""
    def launch_train(steps, *restarts):
        return _run(["-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node", "2", *restarts, "-m",
                     "hputrain.cli", "train", "--corpus", str(corpus(tmp_path)), "--output-dir", str(out),
                     *TINY, "--max-steps", str(steps)], tmp_path)

    out = tmp_path / "run"
    first = launch_train(4)
    assert first.status == 0, first.err[-3000:]
    before = {path.relative_to(out): path.read_bytes() for path in out.rglob("*")
              if path.is_file() and (path.name == "metrics.jsonl" or "checkpoint-" in str(path))}
    shutil.rmtree(tmp_path / "logs")
    again = launch_train(8, "--max-restarts", "2")
    assert again.status == 2, again.err[-3000:]
    refusal = [line for line in again.err.splitlines() if "holds" in line and "--overwrite-output-dir" in line]
    assert len(refusal) == 1 and refusal[0].startswith("hputrain launch: rank 0 failed (exit code 2): "), again.err
    assert sorted(path.name for path in (tmp_path / "logs").glob("*/attempt_*")) == ["attempt_0"]
    after = {path.relative_to(out): path.read_bytes() for path in out.rglob("*")
             if path.is_file() and (path.name == "metrics.jsonl" or "checkpoint-" in str(path))}
    assert after == before and not (out / "checkpoint-8").exists()
