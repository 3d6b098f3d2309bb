"""Resuming continues exactly: 2N steps equal N steps, a kill -9, and N resumed steps, bitwise;
the resumed run's records start on a fresh line of metrics.jsonl."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

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
