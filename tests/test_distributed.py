"""Processes launched through `hputrain launch` itself (gloo on the CPU): ddp and fast_ddp equal one
process with the doubled batch; two "nodes" started with Lightning's environment variables; a
killed rank ends the job; --max-restarts resumes from the checkpoint."""
import json
import os
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

from . import dist_script

ROOT = Path(__file__).parent.parent
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


@pytest.mark.parametrize("strategy", ["ddp", "fast_ddp"])
def test_two_processes_equal_one_with_the_doubled_batch(tmp_path, reference, strategy):
    proc, _ = hputrain_launch("--nproc-per-node", "2", SCRIPT, str(tmp_path), "4", strategy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.equal(weights(tmp_path / "weights-rank0.pt")["wte.weight"],
                       weights(tmp_path / "weights-rank1.pt")["wte.weight"])
    assert_close_to(reference, tmp_path / "weights-rank0.pt")
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(l)]
    assert steps == list(range(1, 21))  # rank 0 alone writes


def test_fast_ddp_with_bf16_gradients_stays_close(tmp_path, reference):
    proc, _ = hputrain_launch("--nproc-per-node", "2", SCRIPT, str(tmp_path), "4", "fast_ddp",
                              "--bf16-gradients")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_close_to(reference, tmp_path / "weights-rank0.pt", tol=2e-2)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_max_restarts_resumes_from_the_checkpoint(tmp_path, reference):
    proc, _ = hputrain_launch("--nproc-per-node", "2", "--max-restarts", "1", SCRIPT, str(tmp_path), "4",
                              "ddp", "--kill-rank", "1", "--kill-step", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(l)]
    assert steps[-1] == 20 and steps.count(6) == 2  # steps 6.. ran again after resuming from 5
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


def test_launch_bad_input(tmp_path):
    proc, _ = hputrain_launch(str(tmp_path / "missing.py"))
    assert proc.returncode == 2 and "missing.py does not exist" in proc.stderr
    proc, _ = hputrain_launch("--nproc-per-node", "lots", SCRIPT)
    assert proc.returncode == 2 and "number or auto" in proc.stderr


def test_launch_reads_the_saved_defaults(tmp_path):
    (tmp_path / "defaults.json").write_text(json.dumps({"accelerator": "cpu", "nproc_per_node": 2}))
    out = tmp_path / "out"
    out.mkdir()
    proc, _ = hputrain_launch(SCRIPT, str(out), "4", "ddp", "--steps", "2",
                              env={**ENV, "HPUTRAIN_CONFIG_FILE": str(tmp_path / "defaults.json")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "weights-rank1.pt").exists()


def test_strategy_selection():
    from hputrain.accelerators.cpu import CPUAccelerator

    two = ProcessGroup(rank=0, local_rank=0, world_size=2, backend="gloo")
    one = ProcessGroup(rank=0, local_rank=0, world_size=1, backend="gloo")
    cpu = CPUAccelerator()
    assert select_strategy(TrainingArguments(), two, cpu).name == "ddp"
    assert select_strategy(TrainingArguments(strategy="fast_ddp"), two, cpu).name == "fast_ddp"
    assert select_strategy(TrainingArguments(strategy="ddp"), one, cpu).name == "single"
    with pytest.raises(InputError, match="strategy 'single' runs one process"):
        select_strategy(TrainingArguments(strategy="single"), two, cpu)


def test_world_size_must_match_devices_and_nodes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(InputError, match="WORLD_SIZE=3, but devices=2 × num_nodes=2 is 4"):
        relaunch_current_program(2, 2)
