"""Two processes (gloo): only global rank 0 logs and writes; the result equals one process with
the doubled batch."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from . import ddp_script

ROOT = Path(__file__).parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_log_once_and_match_one_process(tmp_path):
    out = tmp_path / "ddp"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(ROOT / "tests" / "ddp_script.py"), str(out), "4"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 6, 8, 10]  # once each: rank 0 only
    assert len([r for r in records if "eval_loss" in r]) == 1 and "train_runtime" in records[-1]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-10", "checkpoint-5"]
    assert sorted(p.name for p in (out / "checkpoint-10").glob("rng_state_*")) == ["rng_state_0.pt", "rng_state_1.pt"]
    rank0, rank1 = (torch.load(out / f"weights-rank{r}.pt") for r in (0, 1))
    single = ddp_script.main(str(tmp_path), 8)
    for key, value in single.state_dict().items():
        assert torch.equal(rank0[key], rank1[key])
        torch.testing.assert_close(rank0[key], value, rtol=1e-4, atol=1e-5)
