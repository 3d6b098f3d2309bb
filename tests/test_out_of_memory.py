"""Issue 26: a training step that runs out of device memory ends with one line (what was asked, the
peak, the plan's breakdown and its cheapest fitting change) and exit status 2, and the last
checkpoint stays whole. The device is a CPU stand-in whose step raises torch's OutOfMemoryError,
as a GPU's allocator does, or the RuntimeError Gaudi's runtime raises."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hputrain.accelerators.cpu import CPUAccelerator
from hputrain.cli import main

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
