"""Issue 26: where the time goes. `--profile-steps A-B` (and Optimum's profiling_warmup_steps +
profiling_steps) runs torch.profiler over exactly those training steps, one trace per rank whose
ProfilerStep#N is training step N, and the top operations in top_ops.txt and the summary."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hputrain.cli import main

TINY = ["--seq-len", "32", "--per-device-train-batch-size", "2", "--max-corpus-bytes", "40000",
        "--disable-tqdm", "--logging-steps", "1", "--eval-steps", "0", "--save-steps", "-1"]


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.py").write_bytes(Path(os.__file__).read_bytes()[:60_000])
    return folder


def steps_and_ops(trace: Path):
    events = json.loads(trace.read_text())["traceEvents"]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    return steps, ops


def check_trace(trace: Path, first: int, last: int) -> None:
    steps, ops = steps_and_ops(trace)
    assert [e["name"] for e in steps] == [f"ProfilerStep#{n}" for n in range(first, last + 1)]
    start, end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    assert ops and all(start <= e["ts"] and e["ts"] + e["dur"] <= end for e in ops)
    # every step ran forward, backward and the optimizer
    for step in steps:
        inside = {e["name"] for e in ops if step["ts"] <= e["ts"] < step["ts"] + step["dur"]}
        assert {"aten::mm", "aten::addmm"} & inside or "aten::linear" in inside
        assert any("backward" in name.lower() for name in inside)


def test_profile_steps_trace_holds_those_steps_and_nothing_else(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--corpus", str(corpus), "--output-dir", str(out), "--max-steps", "5",
                 "--profile-steps", "3-4", *TINY]) == 0
    trace = out / "profile" / "rank0.steps3-4.pt.trace.json"
    check_trace(trace, 3, 4)
    table = (out / "profile" / "top_ops.txt").read_text()
    assert "Self CPU" in table and sum("aten::" in line for line in table.splitlines()) >= 5
    printed = capsys.readouterr().out
    assert f"profile of steps 3-4: {trace}" in printed and "aten::" in printed


def test_the_self_times_in_top_ops_are_sorted(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--corpus", str(corpus), "--output-dir", str(out), "--max-steps", "2",
                 "--profile-steps", "2", *TINY]) == 0
    check_trace(out / "profile" / "rank0.steps2-2.pt.trace.json", 2, 2)
    rows = [line for line in (out / "profile" / "top_ops.txt").read_text().splitlines()
            if "%" in line and not line.startswith("Self") and "Name" not in line]

    def micros(text: str) -> float:
        for unit, factor in (("us", 1), ("ms", 1e3), ("s", 1e6)):
            if text.endswith(unit):
                return float(text[:-len(unit)]) * factor
        raise AssertionError(text)

    self_times = [micros(line.split()[-5]) for line in rows]
    assert len(self_times) >= 5 and self_times == sorted(self_times, reverse=True)


def test_optimum_names_profile_the_same_steps(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--corpus", str(corpus), "--output-dir", str(out), "--max-steps", "5",
                 "--profiling-warmup-steps", "2", "--profiling-steps", "2", *TINY]) == 0
    check_trace(out / "profile" / "rank0.steps3-4.pt.trace.json", 3, 4)


@pytest.mark.parametrize("flags, says", [
    (["--profile-steps", "4-3"], "1 <= A <= B"),
    (["--profile-steps", "x"], "profile_steps must be steps A-B"),
    (["--profile-steps", "0"], "1 <= A <= B"),
    (["--profile-steps", "4-9"], "ends after max_steps 5"),
    (["--profile-steps", "3-4", "--profiling-steps", "2"], "both set"),
    (["--profiling-warmup-steps", "2"], "needs profiling_steps"),
])
def test_bad_profile_steps_are_one_line_and_exit_2(corpus, tmp_path, capsys, flags, says):
    status = main(["train", "--corpus", str(corpus), "--output-dir", str(tmp_path / "o"),
                   "--max-steps", "5", *flags, *TINY])
    err = capsys.readouterr().err
    assert status == 2 and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "profile").exists()


def test_hpu_profiles_with_gaudis_activity_where_torch_has_it(fake_hpu, monkeypatch):
    from hputrain.accelerators.hpu import HPUAccelerator

    class Older:  # a torch without Gaudi's profiler activity
        CPU = torch.profiler.ProfilerActivity.CPU

    activity = getattr(torch.profiler.ProfilerActivity, "HPU", None)
    if activity is not None:  # torch 2.13 has it
        assert HPUAccelerator().profiler_activities() == [torch.profiler.ProfilerActivity.CPU, activity]
    monkeypatch.setattr(torch.profiler, "ProfilerActivity", Older)
    assert HPUAccelerator().profiler_activities() == [Older.CPU]


@pytest.mark.slow
def test_two_processes_write_one_trace_each(corpus, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--cpu", "--devices", "2",
                           "--corpus", str(corpus), "--output-dir", str(out), "--max-steps", "4",
                           "--profile-steps", "2-3", *TINY], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        check_trace(out / "profile" / f"rank{rank}.steps2-3.pt.trace.json", 2, 3)
