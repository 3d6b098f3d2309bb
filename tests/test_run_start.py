"""Issue 39, item 1: where a run starts in its output_dir. One command line serves a preemptible
job's first run and its reruns (`--resume-from-checkpoint latest` starts from the beginning, in
one line, where there is no checkpoint yet); a run without it refuses, in one line, an output_dir
holding an earlier run's checkpoints; `--overwrite-output-dir` starts over and deletes nothing of
the earlier run before it has written something in its place. For every method, through the
command line, and for two processes."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hputrain import Callback, Trainer, TrainingArguments
from hputrain.checkpoint.folder import SET_ASIDE_DIR
from hputrain.checkpoint.start import plan_start
from hputrain.errors import InputError

from .hf_fixtures import tiny_llama_folder
from .test_checkpoint import save
from .test_trainer import Regression, regression_data

BOTH_FLAGS = ("--resume-from-checkpoint latest", "--overwrite-output-dir")


def snapshot(out: Path) -> dict[str, str]:
    """Every file of the run's checkpoints and logs, by path, with a hash of its bytes."""
    files = [p for p in out.rglob("*") if p.is_file() and (p.name == "metrics.jsonl"
                                                           or "checkpoint-" in str(p))]
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def steps_of(out: Path) -> list[int]:
    """The training steps metrics.jsonl logged, in order (records with a loss)."""
    return [record["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in (record := json.loads(line))]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# -- the decision ------------------------------------------------------------------------------------

def test_the_decision_for_each_folder_and_flags(tmp_path):
    empty, run, unfinished = tmp_path / "empty", tmp_path / "run", tmp_path / "unfinished"
    save(run, 2)
    save(run, 4)
    (unfinished / "checkpoint-3").mkdir(parents=True)  # a folder of that name, never completed

    fresh = plan_start(empty, "latest", overwrite=False)
    assert fresh.checkpoint is None and fresh.fresh and fresh.error is None
    assert fresh.note == f"no checkpoint in {empty} yet: starting from the beginning"
    assert plan_start(run, "latest", overwrite=False).checkpoint == run / "checkpoint-4"
    assert plan_start(run, "checkpoint-2", overwrite=False).checkpoint == run / "checkpoint-2"
    assert plan_start(run, True, overwrite=False).checkpoint == run / "checkpoint-4"  # Hugging Face's
    assert plan_start(empty, None, overwrite=False) == plan_start(empty, None, overwrite=True)
    assert plan_start(empty, None, overwrite=False).fresh
    assert plan_start(run, None, overwrite=True).fresh
    # torchrun restarted the job: its own newest checkpoint, without being asked
    assert plan_start(run, None, overwrite=False, restarted=True).checkpoint == run / "checkpoint-4"
    assert plan_start(empty, None, overwrite=False, restarted=True).fresh

    for folder, newest in ((run, "2 checkpoints of an earlier run (the newest: checkpoint-4)"),
                           (unfinished, "1 checkpoint of an earlier run (checkpoint-3)")):
        refused = plan_start(folder, None, overwrite=False)
        assert refused.error == (f"output_dir {folder} holds {newest}: add --resume-from-checkpoint "
                                 "latest to continue it, or --overwrite-output-dir to start over")
    both = plan_start(run, "latest", overwrite=True).error
    assert "--overwrite-output-dir" in both and "--resume-from-checkpoint" in both
    assert "does not exist" in plan_start(run, "checkpoint-9", overwrite=False).error


class FailAt(Callback):
    """Raises at the end of step `step`: a run that fails before its first checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("failed on purpose")


def regression_run(out: Path, callbacks=(), **overrides) -> Trainer:
    args = TrainingArguments(**(dict(output_dir=str(out), max_steps=4, save_steps=2, logging_steps=1,
                                     disable_tqdm=True, report_to="none", learning_rate=1e-2,
                                     per_device_train_batch_size=8) | overrides))
    return Trainer(Regression(), args, train_dataset=regression_data(), callbacks=list(callbacks))


def test_overwrite_deletes_nothing_before_the_new_run_saves(tmp_path, capsys):
    """An overwrite run that fails before its first checkpoint leaves the earlier run whole (set
    aside, out of "latest"'s reach); one that saves replaces it, with one step sequence logged."""
    out = tmp_path / "out"
    regression_run(out).train()
    earlier = snapshot(out)
    assert steps_of(out) == [1, 2, 3, 4] and {"checkpoint-2/trainer_state.json",
                                               "checkpoint-4/trainer_state.json"} <= set(earlier)
    with pytest.raises(InputError, match="holds 2 checkpoints of an earlier run"):
        regression_run(out).train()  # the Trainer itself refuses, as the command line does
    assert snapshot(out) == earlier

    capsys.readouterr()
    with pytest.raises(RuntimeError, match="on purpose"):
        regression_run(out, [FailAt(2)], overwrite_output_dir=True).train()
    assert ("starting from the beginning; the earlier run's 2 checkpoints, metrics.jsonl set aside "
            f"in {out / SET_ASIDE_DIR}") in capsys.readouterr().out
    aside = out / SET_ASIDE_DIR
    assert snapshot(aside) == earlier  # all of it, moved, nothing deleted
    assert not list(out.glob("checkpoint-*")) and steps_of(out) == [1]
    assert plan_start(out, "latest", overwrite=False).checkpoint is None

    regression_run(out, overwrite_output_dir=True, max_steps=3).train()
    assert not aside.exists()  # replaced by this run's checkpoint
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert steps_of(out) == [1, 2, 3]


# -- every method, through the command line ---------------------------------------------------------

PROMPTS = ["the quick", "to be or", "a stitch", "def add", "that is", "a penny", "one two", "x y z"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("start") / "llama", seed=0)


def method_argv(method: str, llama: Path, data: Path) -> list[str]:
    """`hputrain train`'s flags for a short run of `method` (with its data written into `data`)."""
    if method == "gpt":
        return ["--seq-len", "32", "--max-corpus-bytes", "20000", "--per-device-train-batch-size", "4",
                "--eval-batches", "1"]
    pairs = [{"prompt": p, "chosen": " yes it is", "rejected": " no"} for p in PROMPTS[:4]]
    rows = {"text": [{"text": f"{p} and so on, {i}"} for i, p in enumerate(PROMPTS * 4)],
            "sft": [{"prompt": p, "completion": " and so on"} for p in PROMPTS],
            "dpo": pairs, "reward": pairs, "grpo": [{"prompt": p} for p in PROMPTS[:4]]}[method]
    write_jsonl(data / "data.jsonl", rows)
    argv = ["--model", llama, "--dataset", data / "data.jsonl", "--validation-split-percentage", "0",
            "--per-device-train-batch-size", "4", "--precision", "fp32"]
    if method == "text":
        argv += ["--block-size", "32"]
    if method == "sft":
        argv += ["--no-packing"]
    if method == "reward":
        argv += ["--method", "reward"]
    if method == "grpo":
        (data / "rewards.py").write_text("def short(completions, **_):\n"
                                         "    return [-len(c) / 10 for c in completions]\n")
        argv += ["--reward-funcs", f"{data / 'rewards.py'}:short", "--num-generations", "4",
                 "--max-completion-length", "4"]
    return argv


@pytest.mark.parametrize("method", ["gpt", "text", "sft", "dpo", "grpo", "reward"])
def test_one_command_line_for_the_first_run_and_the_reruns(method, llama, tmp_path, cli_here,
                                                           monkeypatch):
    out = tmp_path / "run"
    argv = ["train", *method_argv(method, llama, tmp_path), "--output-dir", out, "--save-steps", "1",
            "--logging-steps", "1", "--disable-tqdm", "--report-to", "none"]
    latest = ["--resume-from-checkpoint", "latest"]

    status, stdout, err = cli_here(*argv, *latest, "--max-steps", "2")  # the first run
    assert status == 0, err[-2000:]
    assert stdout.count(f"no checkpoint in {out} yet: starting from the beginning\n") == 1, stdout
    assert steps_of(out) == [1, 2]
    saved = snapshot(out)

    # the same command without --resume-from-checkpoint latest: refused, before the model is read
    # (the command line), and by the trainer where a launcher started the process
    line = (f"hputrain: error: output_dir {out} holds 2 checkpoints of an earlier run (the newest: "
            "checkpoint-2): add --resume-from-checkpoint latest to continue it, or "
            "--overwrite-output-dir to start over")
    for launched in (False, True):
        with monkeypatch.context() as env:
            if launched:
                env.setenv("LOCAL_RANK", "0")
            status, stdout, err = cli_here(*argv, "--max-steps", "2")
        assert (status, error_lines(err)) == (2, [line]), (launched, err[-2000:])
        assert "Traceback" not in err and snapshot(out) == saved

    status, stdout, err = cli_here(*argv, *latest, "--max-steps", "3")  # a rerun goes on
    assert status == 0, err[-2000:]
    assert "starting from the beginning" not in stdout
    assert steps_of(out) == [1, 2, 3]  # one step sequence
    assert (out / "checkpoint-3" / "trainer_state.json").is_file()
    # the first run's checkpoints were resumed from, never written over
    assert {k: v for k, v in snapshot(out).items() if k.startswith("checkpoint-2")} == \
        {k: v for k, v in saved.items() if k.startswith("checkpoint-2")}


# -- two processes ------------------------------------------------------------------------------------

def hputrain(*argv, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hputrain.cli", *map(str, argv)], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.mark.slow
def test_two_processes_agree_where_the_run_starts(tmp_path):
    """`--devices 2` and `hputrain launch`: the first run from the beginning in one line, a rerun
    without the flag refused by every rank alike, in rank 0's one line (exit 2, no traceback,
    nothing written), a rerun with it resumed."""
    out = tmp_path / "run"
    run = ["train", "--cpu", "--output-dir", out, "--seq-len", "32", "--max-corpus-bytes", "20000",
           "--per-device-train-batch-size", "4", "--eval-batches", "1", "--save-steps", "1",
           "--logging-steps", "1", "--disable-tqdm", "--report-to", "none"]
    first = hputrain(*run, "--devices", "2", "--max-steps", "2", "--resume-from-checkpoint", "latest")
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count("starting from the beginning") == 1, first.stdout
    saved = snapshot(out)

    early = hputrain(*run, "--devices", "2", "--max-steps", "2")  # refused before any process starts
    assert early.returncode == 2 and len(error_lines(early.stderr)) == 1, early.stderr
    assert all(flag in early.stderr for flag in BOTH_FLAGS)
    launched = hputrain("launch", "--nproc-per-node", "2", "--cpu", "-m", "hputrain.cli", *run,
                        "--max-steps", "2")  # every rank's trainer refuses; rank 0 says so
    assert launched.returncode == 2, launched.stderr[-3000:]
    assert error_lines(launched.stderr) == [
        f"hputrain launch: rank 0 failed (exit code 2): {early.stderr.strip()}"], launched.stderr
    assert snapshot(out) == saved

    # rank 0 late with its line (the other rank refuses first): still rank 0's line, once
    late = hputrain("launch", "--nproc-per-node", "2", "--cpu", Path(__file__).with_name(
        "run_start_script.py"), "3", *run, "--max-steps", "2")
    assert (late.returncode, late.stderr) == (launched.returncode, launched.stderr)
    assert snapshot(out) == saved

    rerun = hputrain(*run, "--devices", "2", "--max-steps", "3", "--resume-from-checkpoint", "latest")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "starting from the beginning" not in rerun.stdout and steps_of(out) == [1, 2, 3]
