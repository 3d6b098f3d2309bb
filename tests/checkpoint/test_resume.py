"""Resuming continues exactly: 2N steps equal N steps, a kill -9, and N resumed steps, bitwise;
the resumed run's records start on a fresh line of metrics.jsonl."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hputrain.errors import InputError

from .. import resume_script

HERE = Path(__file__).parents[1]


def losses(run: Path) -> dict:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            out[record["step"]] = record["loss"]
    return out


def test_resume_after_kill_is_bitwise_identical(tmp_path):
    straight = resume_script.main(str(tmp_path / "straight"))

    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(HERE / "resume_script.py"), str(killed), "9"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not (killed / "checkpoint-8").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # well into step 9 or 10, which sleep in forward
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()
    assert not (killed / "checkpoint-16").exists()
    with open(killed / "metrics.jsonl", "a") as f:  # as if killed in the middle of a record
        f.write('{"step": 10, "epoch": 0.4, "lo')

    resumed = resume_script.main(str(killed), resume="latest")
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    steps_after = {s: v for s, v in losses(tmp_path / "straight").items() if s > 8}
    resumed_losses = losses(killed)
    assert {s: resumed_losses[s] for s in steps_after} == steps_after


def hputrain(*argv) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "hputrain.cli", "train", *map(str, argv)],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_a_checkpoint_resumes_on_more_or_fewer_processes(tmp_path):
    """Issue 46 item 6: a 1-process checkpoint resumed with `--devices 2 --strategy ddp` (it
    failed on rank 1 for want of rng_state_1.pt), its 2-process checkpoint resumed on 1 process,
    and the same under fsdp (sharded checkpoints of 1 process, then 2). Rank 0 says once that
    rank 1's generators are seeded; each run continues the step sequence."""
    seeded = ("resuming on 2 processes a checkpoint saved by 1 process: rank 1 has no saved "
              "generator state, so its generators are seeded from seed 42, the rank and step {}")
    for strategy in ("ddp", "fsdp"):
        out = tmp_path / strategy
        run = ["--cpu", "--output-dir", out, "--seq-len", "32", "--max-corpus-bytes", "20000",
               "--per-device-train-batch-size", "2", "--eval-batches", "1", "--save-steps", "2",
               "--logging-steps", "1", "--disable-tqdm", "--report-to", "none", "--precision",
               "fp32", "--strategy", "single" if strategy == "ddp" else "fsdp"]
        first = hputrain(*run, "--max-steps", "2")
        assert first.returncode == 0, first.stderr[-3000:]
        more = hputrain(*run[:-1], strategy, "--devices", "2", "--max-steps", "4",
                        "--resume-from-checkpoint", "latest")
        assert more.returncode == 0, more.stderr[-3000:]
        said = (more.stdout + more.stderr).splitlines()
        assert said.count(seeded.format(2)) == 1, more.stdout + more.stderr
        assert sorted(p.name for p in (out / "checkpoint-4").glob("rng_state_*")) == [
            "rng_state_0.pt", "rng_state_1.pt"]
        fewer = hputrain(*run, "--max-steps", "6", "--resume-from-checkpoint", "latest")
        assert fewer.returncode == 0, fewer.stderr[-3000:]
        assert "no saved generator state" not in fewer.stdout + fewer.stderr
        assert list(losses(out)) == [1, 2, 3, 4, 5, 6], strategy
        assert all(math.isfinite(loss) for loss in losses(out).values())


# -- issue 47 item 16: an error mid-run saves first, or says why not; a rerun logs a step once ----

class RowsThatFail(torch.utils.data.Dataset):
    """resume_script's samples; the `bad`-th sample read raises bad input, as a row that cannot
    be read does when its batch is made."""

    def __init__(self, bad=None):
        self.samples, self.reads, self.bad = resume_script.data(), 0, bad

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == self.bad:
            raise InputError(f"--dataset rows.jsonl line {i + 1}: the row cannot be read")
        return self.samples[i]


class FailsAt(resume_script.SlowAfter):
    """resume_script's GPT, whose forward raises at its `fail_at`-th call (a crash in a step)."""

    def __init__(self, config, fail_at=None):
        super().__init__(config)
        self.fail_at = fail_at

    def forward(self, *args, **kwargs):
        if self.calls + 1 == self.fail_at:
            raise RuntimeError("a crash inside the step, on purpose")
        return super().forward(*args, **kwargs)


def run(out, data, resume=None, fail_at=None):
    from hputrain import Trainer, TrainingArguments
    from hputrain.models.gpt import GPTConfig

    torch.manual_seed(0)
    model = FailsAt(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, dropout=0.1), fail_at)
    args = TrainingArguments(output_dir=str(out), max_steps=16, save_steps=8, logging_steps=1,
                             learning_rate=3e-3, per_device_train_batch_size=4, disable_tqdm=True,
                             resume_from_checkpoint=resume, throughput_warmup_steps=0,
                             report_to="none", precision="fp32")
    Trainer(model, args, train_dataset=data).train()
    return model


def steps(out: Path, name: str = "metrics.jsonl") -> list[int]:
    """The step of each training record (one with a loss) of the run's log, in order."""
    return [r["step"] for r in map(json.loads, (out / name).read_text().splitlines()) if "loss" in r]


def test_bad_data_mid_run_saves_a_checkpoint_first(tmp_path):
    """A row that cannot be read when step 14's batch is made (of 16, saves every 8): the run
    saves checkpoint-13 before it ends in one line that names it (it ended without one, the
    rerun starting again from checkpoint-8); resumed with the data fixed, it ends where a run
    without the bad row ends, bitwise, and metrics.jsonl holds each step once."""
    straight = run(tmp_path / "straight", RowsThatFail())
    out = tmp_path / "failed"
    with pytest.raises(InputError) as error:
        run(out, RowsThatFail(bad=13 * 4 + 2))
    assert re.fullmatch(r"--dataset rows\.jsonl line \d+: the row cannot be read; checkpoint-13 was saved "
                        "first; resume with --resume-from-checkpoint latest once the data is fixed",
                        str(error.value)), error.value
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-13", "checkpoint-8"]
    assert steps(out) == list(range(1, 14))
    resumed = run(out, RowsThatFail(), resume="latest")
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    assert steps(out) == list(range(1, 17)) and losses(out) == losses(tmp_path / "straight")


def test_a_crash_inside_a_step_says_what_is_unsaved_and_a_rerun_logs_each_step_once(tmp_path, capsys):
    """A crash in step 11's forward (checkpoint-8 saved, steps 9 and 10 logged) saves nothing and
    says so; the rerun from checkpoint-8 moves the failed run's records of steps 9 and 10 to
    metrics.superseded.jsonl, so metrics.jsonl holds steps 1 to 16 once each (it held 9 and 10
    twice)."""
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="on purpose"):
        run(out, RowsThatFail(), fail_at=11)
    assert ("hputrain: the run ended at step 10 by RuntimeError inside a step: no checkpoint of steps "
            "9-10 is saved (the step is half done, and other ranks may be inside a collective, where "
            "a save would hang); checkpoint-8 is the last (resume with --resume-from-checkpoint "
            "latest)") in capsys.readouterr().err.splitlines()
    assert steps(out) == list(range(1, 11))
    run(out, RowsThatFail(), resume="latest")
    assert steps(out) == list(range(1, 17))
    assert steps(out, "metrics.superseded.jsonl") == [9, 10]


@pytest.mark.slow
def test_bad_data_on_one_rank_saves_on_every_rank_then_says_its_line_once(tmp_path):
    """Two ranks of `hputrain train` (6 steps, a save every 2): rank 1's data fails at its 4th
    micro-batch (step 4's), while rank 0 goes on to step 4's agreement. Both save checkpoint-3
    (whole: both ranks' generators), then the launcher says rank 1's line once, exit 2; the
    same command resumed finishes with each step logged once."""
    from ..distributed.test_rank_failure import _run, assert_one_line, assert_whole, corpus, TINY

    script = str(HERE / "bad_data_script.py")
    argv = ["train", "--corpus", str(corpus(tmp_path)), "--output-dir", str(tmp_path / "run"), *TINY]
    failed = _run(["-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node", "2", script, "1", "4",
                   *argv], tmp_path)
    assert_one_line(failed, 1, "--dataset rows.jsonl line 4: rank 1's row cannot be read, on purpose; "
                    "checkpoint-3 was saved first; resume with --resume-from-checkpoint latest once "
                    "the data is fixed")
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert_whole(tmp_path / "run" / "checkpoint-3", 3)
    resumed = _run(["-m", "hputrain.cli", "launch", "--cpu", "--nproc-per-node", "2", script, "1", "0",
                    *argv, "--resume-from-checkpoint", "latest"], tmp_path)
    assert resumed.status == 0, resumed.err[-3000:]
    assert steps(tmp_path / "run") == [1, 2, 3, 4, 5, 6]
