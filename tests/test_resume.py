"""Resuming continues exactly: 2N steps equal N steps, a kill -9, and N resumed steps, bitwise;
the resumed run's records start on a fresh line of metrics.jsonl."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from . import resume_script

HERE = Path(__file__).parent


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
