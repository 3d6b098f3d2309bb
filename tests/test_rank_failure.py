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
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hputrain.distributed import failure
from hputrain.distributed.launch import _report

ROOT = Path(__file__).parent.parent
SCRIPT = str(ROOT / "tests" / "rank_failure_script.py")
TIMEOUT = 420  # seconds for one launch; past it the launcher is killed, and its workers with it
TINY = ["--max-steps", "6", "--save-steps", "2", "--seq-len", "32", "--per-device-train-batch-size", "2",
        "--logging-steps", "1", "--disable-tqdm"]
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                    "rng_state_0.pt", "rng_state_1.pt")


# -- the launcher's report, and the record in the store (no processes) ------------------------

def _failures(*codes, peer=None):
    data = {"message": {"message": "", "extraInfo": {"peer": peer}}}
    return {rank: SimpleNamespace(exitcode=code, timestamp=100 + rank, message=f"line of rank {rank}",
                                  error_file_data=data if code == failure.ENDED_BY_PEER else {})
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


class _Store:
    """The process group's store, as failure.py uses it."""

    def __init__(self):
        self.values, self.gone = {}, False

    def compare_set(self, key, expected, desired):
        self._answer()
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
            raise RuntimeError("Connection reset by peer")


def test_the_first_failure_is_recorded_for_the_other_ranks(monkeypatch, capsys):
    store, rank = _Store(), [1]
    monkeypatch.setattr(failure, "_store", lambda: (store, rank[0]))
    monkeypatch.setattr(failure, "_peer", None)
    monkeypatch.setattr(failure, "_said_by_launcher", False)
    assert failure.peer_failure() is None  # nothing recorded: an error is this rank's own
    failure.say("hputrain: error: bad", 2)
    assert capsys.readouterr().err == "hputrain: error: bad\n" and failure.own_line() == "hputrain: error: bad"
    assert failure.peer_failure() is None  # its own record is no peer's
    rank[0] = 0
    failure.record("RuntimeError: Connection closed by peer", 1)  # an echo recorded later: the first stays
    assert failure.peer_failure() == {"rank": 1, "status": 2, "line": "hputrain: error: bad"}
    monkeypatch.setattr(failure, "_peer", None)
    store.gone = True  # rank 0 held it (mpirun, srun): rank 0 is gone
    assert failure.peer_failure()["rank"] is None
    monkeypatch.setattr(failure, "_said_by_launcher", True)  # under `hputrain launch`: it says the line
    failure.say("hputrain: error: worse", 2)
    assert capsys.readouterr().err == ""


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


@pytest.mark.slow
def test_a_reward_function_raising_on_rank_1_only(tmp_path):
    """GRPO: rank 1's reward function raises at step 2, while rank 0 waits in the all-gather of
    the rewards; checkpoint 1 stays whole."""
    from .hf_fixtures import tiny_llama_folder

    model = tiny_llama_folder(tmp_path / "llama", seed=0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["the quick", "to be or", "a stitch", "def add", "that is", "a penny"]))
    (tmp_path / "rewards.py").write_text(REWARDS)
    run = _run(["-m", "hputrain.cli", "train", "--cpu", "--devices", "2", "--model", str(model),
                "--dataset", str(prompts), "--reward-funcs", f"{tmp_path / 'rewards.py'}:tens",
                "--num-generations", "4", "--max-completion-length", "8", "--per-device-train-batch-size", "4",
                "--max-steps", "3", "--save-steps", "1", "--disable-tqdm", "--validation-split-percentage", "0",
                "--output-dir", str(tmp_path / "run")], tmp_path)
    line = "reward function tens raised ValueError: no score for rank 1's completions at step 2"
    assert_one_line(run, 1, line)
    assert checkpoints(tmp_path / "run") == ["checkpoint-1"]
    assert_whole(tmp_path / "run" / "checkpoint-1", 1)


@pytest.mark.slow
def test_a_torn_line_in_a_shard_only_rank_0_reads(tmp_path):
    """--streaming: rank 0 reads shard 0, whose row 8 is cut short, after the first save, while
    rank 1 waits in the step's agreement (an all-reduce); the checkpoint of step 2 stays whole."""
    from .hf_fixtures import tiny_llama_folder
    from .test_streaming import text_rows, write_shards

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
