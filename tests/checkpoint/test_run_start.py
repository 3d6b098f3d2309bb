"""Issue 39, item 1, and issue 46: where a run starts in its output_dir. One command line serves a
preemptible job's first run and its reruns (`--resume-from-checkpoint latest` starts from the
beginning, in one line, where there is no checkpoint yet, and says in one line, writing nothing,
that a finished run is finished); a run without it refuses, in one line, an output_dir holding an
earlier run's checkpoints or final/; `--overwrite-output-dir` starts over and deletes nothing of
the earlier run before a checkpoint or final/ of its own is on disk; a restart of a job continues
only that job's checkpoints. A table of rerun cases, every method through the command line, and
two processes."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from hputrain import Callback, Trainer, TrainingArguments
from hputrain.checkpoint.folder import SET_ASIDE_DIR
from hputrain.checkpoint.saving import save_checkpoint
from hputrain.checkpoint.start import job_identity, plan_start, reached_end
from hputrain.errors import EveryRankError, InputError
from hputrain.recipes import finish
from hputrain.recipes.finish import report_outputs, save_final, write_recipe
from hputrain.training.trainer import TrainOutput

from ..hf_fixtures import tiny_llama_folder
from ..checkpoint.test_checkpoint import CPUAccelerator, save, tiny_run
from ..training.test_trainer import Regression, regression_data

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


def files_of(out: Path) -> dict[str, str]:
    """Every file a run left in `out` (its lock and what it set aside apart), with a hash each."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".hputrain.lock"
            and SET_ASIDE_DIR not in p.relative_to(out).parts}


def save_of_job(out: Path, step: int, job: str | None) -> Path:
    """Checkpoint `step` of a run whose job identity is `job` (None: written before jobs were
    recorded)."""
    model, optimizer, scheduler = tiny_run()
    state = {"epoch": 0} if job is None else {"epoch": 0, "job": job}
    return save_checkpoint(out, step, model=model, optimizer=optimizer, scheduler=scheduler,
                           state=state, accelerator=CPUAccelerator())


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
    assert plan_start(empty, None, overwrite=False, restarted=True).fresh

    for folder, newest in ((run, "2 checkpoints of an earlier run (the newest: checkpoint-4)"),
                           (unfinished, "1 checkpoint of an earlier run (checkpoint-3)")):
        refused = plan_start(folder, None, overwrite=False)
        assert refused.error == (f"output_dir {folder} holds {newest}: add --resume-from-checkpoint "
                                 "latest to continue it, or --overwrite-output-dir to start over")
    both = plan_start(run, "latest", overwrite=True).error
    assert "--overwrite-output-dir" in both and "--resume-from-checkpoint" in both
    assert "does not exist" in plan_start(run, "checkpoint-9", overwrite=False).error
    assert plan_start(run, "latest", overwrite=False).step == 4  # for reached_end


def test_a_restart_continues_only_its_own_jobs_checkpoints(tmp_path):
    """torchrun restarted the job (issue 46, item 1): "latest" unasked only where the newest
    checkpoint is this job's; another job's (or one written before jobs were recorded) is
    refused as a run from the beginning refuses it, and an overwrite sets it aside."""
    own, other, unnamed = tmp_path / "own", tmp_path / "other", tmp_path / "unnamed"
    save_of_job(own, 2, "job-a")
    save_of_job(own, 4, "job-a")
    save_of_job(other, 4, "job-b")
    save_of_job(unnamed, 4, None)
    restart = dict(overwrite=False, restarted=True, job="job-a")
    assert plan_start(own, None, **restart).checkpoint == own / "checkpoint-4"
    for folder in (other, unnamed):
        refused = plan_start(folder, None, **restart)
        assert refused.checkpoint is None and refused.error == plan_start(folder, None, overwrite=False).error
        assert "1 checkpoint of an earlier run (checkpoint-4)" in refused.error
        assert plan_start(folder, None, overwrite=True, restarted=True, job="job-a").fresh
        assert plan_start(folder, "latest", **restart).checkpoint == folder / "checkpoint-4"  # asked
    assert plan_start(own, None, overwrite=False, restarted=False, job="job-a").error  # no restart


def identity_in_child(worker: bool) -> str:
    """job_identity() in a child of this process: a worker of an agent (TORCHELASTIC_RUN_ID set,
    as torch's agent sets it), or a process of its own."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only os calls and the function under test, then _exit
        try:
            if worker:
                os.environ["TORCHELASTIC_RUN_ID"] = "none"
            else:
                os.environ.pop("TORCHELASTIC_RUN_ID", None)
            os.write(write, job_identity().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        said = answer.read()
    os.waitpid(pid, 0)
    return said


def test_the_job_identity_is_the_agents(monkeypatch):
    """What a restart compares: the same for every process one agent starts (torch's agent is
    the workers' parent, and stays across restarts), another for another agent."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    workers = [identity_in_child(True) for _ in range(2)]
    own = [identity_in_child(False) for _ in range(2)]
    assert workers[0] == workers[1] == job_identity()  # this process is the workers' agent
    assert len({workers[0], *own}) == 3  # a process of its own is a job of its own
    host, _, pid, started = own[0].split("/")
    assert host == os.uname().nodename and int(pid) != os.getpid() and started.isdigit()


def test_a_finished_run_and_the_decision_on_it(tmp_path):
    """A folder with only the final/ of a finished run (--save-steps -1) is an earlier run:
    refused without a flag; under "latest" it is at the step its log ended at (reached_end then
    says so, or refuses more steps: nothing to continue from); set aside by an overwrite."""
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    records = [{"step": 2, "loss": 1.0}, {"step": 4, "loss": 0.5}, {"step": 4, "train_runtime": 1}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"ste')
    assert plan_start(out, None, overwrite=False).error == (
        f"output_dir {out} holds the final model of an earlier run (final/): add "
        "--overwrite-output-dir to start over")
    assert plan_start(out, None, overwrite=True).fresh
    finished = plan_start(out, "latest", overwrite=False, metrics="metrics.jsonl")
    assert (finished.checkpoint, finished.fresh, finished.step, finished.error) == (None, False, 4, None)
    assert reached_end(finished, 4) == ("the run has already reached max_steps (4): the final model "
                                        "(final/) is at step 4; nothing trained, nothing written")
    with pytest.raises(EveryRankError, match="finished at step 4 and kept no checkpoint to continue "
                                             "it to step 8 from, only final/: add --overwrite-output-dir"):
        reached_end(finished, 8)
    assert "no checkpoint to continue it from" in plan_start(
        out, "latest", overwrite=False, metrics="nothing.jsonl").error  # no log: no step to tell
    save(out, 4)
    resumed = plan_start(out, "latest", overwrite=False, metrics="metrics.jsonl")
    assert reached_end(resumed, 4) == (f"the run has already reached max_steps (4): {out / 'checkpoint-4'}"
                                       " is at step 4; nothing trained, nothing written")
    assert reached_end(resumed, 6) is None and reached_end(plan_start(tmp_path / "new", "latest",
                                                                      overwrite=False), 1) is None


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
            f"in {out / SET_ASIDE_DIR / 'run-1'} until this run has a checkpoint or its final/ on "
            "disk") in capsys.readouterr().out
    aside = out / SET_ASIDE_DIR
    assert snapshot(aside / "run-1") == earlier  # all of it, moved, nothing deleted
    assert not list(out.glob("checkpoint-*")) and steps_of(out) == [1]
    assert plan_start(out, "latest", overwrite=False).checkpoint is None

    regression_run(out, overwrite_output_dir=True, max_steps=3).train()
    assert not aside.exists()  # replaced by this run's checkpoint
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert steps_of(out) == [1, 2, 3]


# -- the rerun cases (issue 46) ----------------------------------------------------------------------

class StopAt(Callback):
    """SIGTERM to this process at the end of step `step`, as a scheduler preempts a job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def recipe_run(out: Path, stop_at: int | None = None, **overrides) -> TrainOutput:
    """One run as `hputrain train`'s recipes make it (recipes/gpt.py): train(), then final/,
    recipe.json and the report, unless the run had already reached its last step."""
    trainer = regression_run(out, [StopAt(stop_at)] if stop_at else [], **overrides)
    output = trainer.train()
    if output.already_done:
        return output
    save_final(trainer, output)
    write_recipe(str(out), {"seed": trainer.args.seed})
    report_outputs(trainer, output)
    return output


LATEST, OVERWRITE = {"resume_from_checkpoint": "latest"}, {"overwrite_output_dir": True}
NO_SAVES = {"save_steps": -1}

# case: (the earlier runs, the rerun, what the rerun says (or, refused, its error), the steps
# metrics.jsonl holds after it, the earlier runs found whole in .overwritten/run-1, run-2 ...
# (their indices), the checkpoints in output_dir after it). "unchanged" for the steps: output_dir
# is byte for byte what the earlier runs left.
RERUNS = {
    "fresh": ([], {}, None, [1, 2, 3, 4], [], [2, 4]),
    "latest with checkpoints": ([{}], LATEST | {"max_steps": 6}, None, [1, 2, 3, 4, 5, 6], [], [2, 4, 6]),
    "latest without checkpoints": ([{"stop_at": 3} | NO_SAVES], LATEST, "no checkpoint in",
                                   [1, 2, 3, 4], [], [2, 4]),
    "finished, latest": ([{}], LATEST, "already reached max_steps (4): ", "unchanged", [], [2, 4]),
    "finished, final/ only, latest": ([NO_SAVES], LATEST, "the final model (final/) is at step 4",
                                      "unchanged", [], []),
    "finished, final/ only, latest, more steps": (
        [NO_SAVES], LATEST | {"max_steps": 6}, "refused: finished at step 4 and kept no checkpoint",
        "unchanged", [], []),
    "finished, final/ only, no flag": ([NO_SAVES], {}, "refused: holds the final model of an earlier run",
                                       "unchanged", [], []),
    "finished, no flag": ([{}], {}, "refused: holds 2 checkpoints of an earlier run", "unchanged",
                          [], [2, 4]),
    "overwrite stopped before its first save": (
        [{}], OVERWRITE | NO_SAVES | {"stop_at": 3}, "set aside in", [1, 2, 3], [0], []),
    "overwrite after its first save": ([{}], OVERWRITE | {"max_steps": 3}, None, [1, 2, 3], [], [2, 3]),
    "overwrite finished without checkpoints": ([{}], OVERWRITE | NO_SAVES, None, [1, 2, 3, 4], [], []),
    "a second overwrite, both stopped before a save": (
        [{}, OVERWRITE | NO_SAVES | {"stop_at": 2}], OVERWRITE | NO_SAVES | {"stop_at": 1},
        "run-2 until", [1], [0, 1], []),
}


@pytest.fixture
def quick_plots(monkeypatch):
    """report_outputs' plots as small files of the same names, whose bytes follow metrics.jsonl
    (matplotlib took nearly 2 s a run)."""
    def write_report(out):
        plot = Path(out) / "loss.png"
        metrics = Path(out) / "metrics.jsonl"
        plot.write_bytes(hashlib.sha256(metrics.read_bytes() if metrics.exists() else b"").digest())
        return [plot]
    monkeypatch.setattr(finish, "write_report", write_report)


@pytest.mark.parametrize("case", RERUNS)
def test_rerun_cases(case, tmp_path, capsys, quick_plots):
    """What each rerun keeps and deletes (docs/reliability.md's table): an earlier run is set
    aside whole (checkpoints, final/, logs, recipe.json, plots), one folder per run, until the
    rerun has a checkpoint or final/ on disk; a finished run run again writes nothing."""
    earlier, rerun, says, steps, aside, checkpoints = RERUNS[case]
    out, left = tmp_path / "out", []
    for overrides in earlier:
        recipe_run(out, **overrides)
        left.append(files_of(out))
    capsys.readouterr()
    if says is not None and says.startswith("refused: "):
        with pytest.raises(InputError, match=says.removeprefix("refused: ")):
            recipe_run(out, **rerun)
    else:
        output = recipe_run(out, **rerun)
        assert output.already_done == (steps == "unchanged")
        printed = capsys.readouterr().out
        assert says is None or says in printed, printed
        assert "resume with" not in printed or list(out.glob("checkpoint-*")), printed
    if steps == "unchanged":
        assert files_of(out) == left[-1]
    else:
        assert steps_of(out) == steps
    runs = sorted((out / SET_ASIDE_DIR).glob("run-*")) if (out / SET_ASIDE_DIR).exists() else []
    assert [p.name for p in runs] == [f"run-{i + 1}" for i in range(len(aside))]
    for folder, index in zip(runs, aside):
        assert files_of(folder) == left[index]  # whole: nothing of it deleted or mixed
    assert sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")) == checkpoints


def test_the_set_aside_run_goes_once_final_is_complete(tmp_path, quick_plots):
    """With no checkpoints (--save-steps -1), an overwrite's earlier run stays set aside when
    train() returns, and goes once final/ is written; a model saved elsewhere is not final/."""
    out = tmp_path / "out"
    recipe_run(out)
    trainer = regression_run(out, **OVERWRITE, **NO_SAVES)
    assert trainer.train().interrupted_by is None
    assert (out / SET_ASIDE_DIR / "run-1" / "checkpoint-4").is_dir()
    trainer.save_model(str(tmp_path / "elsewhere"))
    assert (out / SET_ASIDE_DIR / "run-1" / "final").is_dir()
    trainer.save_model()
    assert not (out / SET_ASIDE_DIR).exists() and (out / "final" / "model.safetensors").is_file()


def test_a_stop_with_no_checkpoint_says_what_is_left(tmp_path, capsys, quick_plots):
    """A run stopped by a signal advises resuming only where a checkpoint is there to resume."""
    out = tmp_path / "out"
    (out / SET_ASIDE_DIR / "run-1").mkdir(parents=True)
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(out)))
    stopped = TrainOutput(5, None, interrupted_by=signal.SIGTERM)
    assert report_outputs(trainer, stopped) == 143
    assert (f"stopped by signal 15 at step 5 with no checkpoint saved, so there is nothing to resume: "
            f"this run left only its logs (metrics.jsonl); the earlier run set aside is kept whole "
            f"in {out / SET_ASIDE_DIR}\n") in capsys.readouterr().out
    save(out, 5)
    assert report_outputs(trainer, stopped) == 143
    assert "stopped by signal 15 at step 5; resume with --resume-from-checkpoint latest\n" in \
        capsys.readouterr().out


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

    finished = files_of(out)  # final/, recipe.json and the plots too
    status, stdout, err = cli_here(*argv, *latest, "--max-steps", "3")  # the finished run again
    assert status == 0, err[-2000:]
    assert (f"the run has already reached max_steps (3): {out / 'checkpoint-3'} is at step 3; "
            "nothing trained, nothing written\n") in stdout
    assert "final:" not in stdout and files_of(out) == finished  # no eval, summary or final/ again

    # a run that ended after its last checkpoint but before final/ was complete (a crash, a full
    # disk): the rerun writes final/ from that checkpoint, the same files, and trains nothing
    shutil.rmtree(out / "final")
    status, stdout, err = cli_here(*argv, *latest, "--max-steps", "3")
    assert status == 0, err[-2000:]
    assert (f"the run has already reached max_steps (3): {out / 'checkpoint-3'} is at step 3, but "
            "final/ is missing: writing it from there, training nothing\n") in stdout
    again = files_of(out)
    assert {k: v for k, v in again.items() if k.startswith("final") or k == "metrics.jsonl"} == \
        {k: v for k, v in finished.items() if k.startswith("final") or k == "metrics.jsonl"}


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
    late = hputrain("launch", "--nproc-per-node", "2", "--cpu", (Path(__file__).parents[1] / 
        "run_start_script.py"), "3", *run, "--max-steps", "2")
    assert (late.returncode, late.stderr) == (launched.returncode, launched.stderr)
    assert snapshot(out) == saved

    rerun = hputrain(*run, "--devices", "2", "--max-steps", "3", "--resume-from-checkpoint", "latest")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "starting from the beginning" not in rerun.stdout and steps_of(out) == [1, 2, 3]


@pytest.mark.slow
def test_a_restart_refuses_another_runs_checkpoints(tmp_path, cli_here):
    """Under `hputrain launch --max-restarts`, a restart is not a licence to continue whatever
    output_dir holds (issue 46, item 1): a job whose first attempt failed before its run began
    (exit 1, restarted) and whose output_dir holds an earlier run's checkpoints is refused on
    the restart as the first attempt would have been, in one line, exit 2, nothing written. (A
    restart that continues its own job's checkpoint: test_distributed.py's max_restarts test.)"""
    out = tmp_path / "run"
    run = ["train", "--output-dir", out, "--seq-len", "32", "--max-corpus-bytes", "20000",
           "--per-device-train-batch-size", "4", "--eval-batches", "1", "--save-steps", "2",
           "--logging-steps", "1", "--disable-tqdm", "--report-to", "none"]
    status, _, err = cli_here(*run, "--max-steps", "4")
    assert status == 0, err[-2000:]
    saved = files_of(out)
    launched = hputrain("launch", "--nproc-per-node", "1", "--max-restarts", "1", "--cpu",
                        (Path(__file__).parents[1] / "fail_first_attempt_script.py"), *run,
                        "--max-steps", "8", "--seed", "7")
    assert launched.returncode == 2, launched.stderr[-3000:]
    assert error_lines(launched.stderr)[-1] == (
        f"hputrain launch: rank 0 failed (exit code 2): hputrain: error: output_dir {out} holds 2 "
        "checkpoints of an earlier run (the newest: checkpoint-4): add --resume-from-checkpoint "
        "latest to continue it, or --overwrite-output-dir to start over"), launched.stderr
    assert files_of(out) == saved and steps_of(out) == [1, 2, 3, 4]
