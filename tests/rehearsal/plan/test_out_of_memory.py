"""Issue 26: a training step that runs out of device memory ends with one line (what was asked, the
peak, the plan's breakdown and its cheapest fitting change) and exit status 2, and the last
checkpoint stays whole. The device is a CPU stand-in whose step raises torch's OutOfMemoryError,
as a GPU's allocator does, or the RuntimeError Gaudi's runtime raises.

Issue 30 (item 5): under several ranks the plan is made once, by rank 0, in a process of its
own, within a time budget; when there is none, the line says why ("no plan: ...")."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.cli import main
from hputrain.cli.planning import _planned

SCRIPT = str((Path(__file__).parents[2] / "out_of_memory_script.py"))

TINY = ["--seq-len", "32", "--per-device-train-batch-size", "2", "--max-corpus-bytes", "40000",
        "--disable-tqdm", "--logging-steps", "1", "--eval-steps", "0", "--max-steps", "5",
        "--save-steps", "2", "--precision", "fp32"]


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.py").write_bytes(Path(os.__file__).read_bytes()[:60_000])
    return folder


def run_out_of_memory_at_step(monkeypatch, step: int, error: Exception, argv: list[str]) -> int:
    """Train with mark_step (called after each micro-batch's backward and each optimizer step)
    raising `error` in step `step`'s backward."""
    calls = {"n": 0}
    original = CPUAccelerator.mark_step

    def mark_step(self):
        calls["n"] += 1
        if calls["n"] == 2 * (step - 1) + 1:
            raise error
        return original(self)

    monkeypatch.setattr(CPUAccelerator, "mark_step", mark_step)
    return main(argv)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
                                   RuntimeError("synStatus 26 [Device out of memory]")])
def test_out_of_memory_is_one_line_exit_2_and_the_checkpoint_is_whole(corpus, tmp_path, capsys,
                                                                    monkeypatch, error):
    out = tmp_path / "run"
    status = run_out_of_memory_at_step(monkeypatch, 3, error, [
        "train", "--corpus", str(corpus), "--output-dir", str(out), *TINY])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    line = err.strip()
    assert "out of memory" in line and "micro-batch 2" in line and "peak" in line
    assert "planned" in line and "parameters" in line and "activations" in line
    assert "--resume-from-checkpoint latest" in line
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    monkeypatch.undo()  # the device has its memory back: the run resumes from checkpoint-2
    capsys.readouterr()
    assert main(["train", "--corpus", str(corpus), "--output-dir", str(out), *TINY,
                 "--resume-from-checkpoint", "latest"]) == 0
    assert "resumed" in capsys.readouterr().out.lower() or (out / "checkpoint-5").is_dir()
    assert (out / "checkpoint-5").is_dir()


def test_other_errors_are_not_taken_for_out_of_memory(corpus, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="not memory"):
        run_out_of_memory_at_step(monkeypatch, 2, ValueError("not memory"), [
            "train", "--corpus", str(corpus), "--output-dir", str(tmp_path / "o"), *TINY])


def test_the_accelerator_says_what_is_out_of_memory():
    cpu = CPUAccelerator()
    assert cpu.is_out_of_memory(torch.OutOfMemoryError("x"))
    assert cpu.is_out_of_memory(RuntimeError("Device out of memory"))
    assert not cpu.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not cpu.is_out_of_memory(MemoryError())  # the host's own, not the device's


def test_a_plan_not_made_within_the_budget_is_said_so(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HPUTRAIN_OUT_OF_MEMORY_PLAN_SECONDS", "0.2")
    start = time.monotonic()
    status = run_out_of_memory_at_step(monkeypatch, 2, torch.OutOfMemoryError("out of memory"), [
        "train", "--corpus", str(corpus), "--output-dir", str(tmp_path / "o"), *TINY])
    line = capsys.readouterr().err.strip()
    assert status == 2 and len(line.splitlines()) == 1, line
    assert "no plan: not made within the 0.2 s allowed" in line and "planned" not in line
    assert "hputrain plan" in line  # what to run instead
    assert time.monotonic() - start < 60


def test_a_plan_that_cannot_be_traced_says_why(tmp_path):
    """The model folder is gone by the time the step runs out of memory: the planning process
    refuses it in one line, which the out-of-memory line carries."""
    flags = {"model": str(tmp_path / "gone"), "dataset": str(tmp_path / "data.jsonl"),
             "func": print}  # the parser's callable is not sent to the planning process
    text = _planned(flags, "cpu", 2**34, budget=60)
    assert text.startswith("no plan: --model ") and "gone" in text, text
    assert "Traceback" not in text and "\n" not in text


def launch_out_of_memory(tmp_path: Path, corpus: Path, env: dict, timeout: float):
    """A 2-process fsdp run whose every rank runs out of memory in step 3: (exit status, stderr,
    seconds); fails if any of its processes (ranks, launcher, planning process) is left."""
    argv = [sys.executable, SCRIPT, "3", "train", "--corpus", str(corpus), "--output-dir",
            str(tmp_path / "run"), *TINY, "--devices", "2", "--strategy", "fsdp"]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        leftover = _group_alive(proc.pid)
        if leftover or proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not leftover, "a process of the run was still alive after it ended"
    return proc.returncode, err, time.monotonic() - start


def _group_alive(group: int) -> bool:
    for _ in range(20):  # processes reparented at the end are reaped within moments
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.25)
    return True


def _env(**more) -> dict:
    root = str(Path(__file__).parents[3])
    return {**os.environ, "PYTHONPATH": root, "HPUTRAIN_ACCELERATOR": "cpu",
            "HPUTRAIN_CONFIG_FILE": "/nonexistent/hputrain.json", **more}


def _lines(err: str) -> list[str]:
    """Each rank's one line (two processes writing to one stream may share a line of it)."""
    return re.findall(r"hputrain: error: out of memory.*?--resume-from-checkpoint latest", err)


@pytest.mark.slow  # make test: the one-process line and its plan (above)
def test_under_2_process_fsdp_rank_0s_line_carries_the_plan(corpus, tmp_path):
    status, err, seconds = launch_out_of_memory(tmp_path, corpus, _env(), timeout=240)
    assert status == 2, err[-3000:]
    assert "Traceback" not in err
    lines = _lines(err)
    planned = [line for line in lines if "; planned " in line]
    assert len(planned) == 1, err[-3000:]  # made once, by rank 0
    assert "a rank (parameters " in planned[0] and "activations" in planned[0]
    # rank 1 makes none: its line (when the launcher has not ended it first, rank 0 having
    # failed) says rank 0's carries it
    assert all("no plan on rank 1: rank 0 makes it" in line for line in lines if line not in planned)
    assert "; planned " in err.split("rank 0 failed (exit code 2)")[1].splitlines()[0]


@pytest.mark.slow
def test_under_2_process_fsdp_a_plan_over_budget_is_said_so(corpus, tmp_path):
    status, err, seconds = launch_out_of_memory(
        tmp_path, corpus, _env(HPUTRAIN_OUT_OF_MEMORY_PLAN_SECONDS="0.5"), timeout=240)
    assert status == 2, err[-3000:]
    first = err.split("rank 0 failed (exit code 2)")[1].splitlines()[0]
    assert "no plan: not made within the 0.5 s allowed" in first
    assert not any("; planned " in line for line in _lines(err))
