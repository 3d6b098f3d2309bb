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
    (["--profile-steps", "3-"], "profile_steps must be steps A-B"),
    (["--profile-steps", "-2"], "profile_steps must be steps A-B"),
    (["--profiling-steps", "-1"], "must not be negative"),
    (["--max-steps", "-1", "--num-train-epochs", "1", "--profile-steps", "100000"],
     "ends after the run's last step"),
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
        assert HPUAccelerator().profiler_activities() == [torch.profiler.ProfilerActivity.CPU,
                                                          activity]
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
    traces = sorted(p.name for p in (out / "profile").glob("*.pt.trace.json"))
    assert traces == ["rank0.steps2-3.pt.trace.json", "rank1.steps2-3.pt.trace.json"]
    for trace in traces:
        check_trace(out / "profile" / trace, 2, 3)


def test_a_resumed_run_profiles_the_steps_it_runs(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--corpus", str(corpus), "--output-dir", str(out), "--max-steps", "3",
                 *TINY, "--save-steps", "3"]) == 0
    assert main(["train", "--corpus", str(corpus), "--output-dir", str(out), "--max-steps", "5",
                 "--resume-from-checkpoint", "latest", "--profile-steps", "3-5", *TINY]) == 0
    traces = sorted(p.name for p in (out / "profile").glob("*.json"))
    assert traces == ["rank0.steps4-5.pt.trace.json"]  # steps 1-3 ran in the first run
    check_trace(out / "profile" / traces[0], 4, 5)


def test_lazy_mode_profiles_the_same_steps(corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--corpus", str(corpus), "--output-dir", str(out), "--max-steps", "3",
                 "--execution-mode", "lazy", "--profile-steps", "2-3", *TINY]) == 0
    check_trace(out / "profile" / "rank0.steps2-3.pt.trace.json", 2, 3)


class _Run:
    """What the profiler reads of a Trainer."""

    def __init__(self, global_step: int, total_steps: int) -> None:
        self.global_step, self.total_steps, self.device = global_step, total_steps, "cpu"
        self.lines: list[str] = []

    def log_message(self, text: str) -> None:
        self.lines.append(text)


class _RecordsMemory:
    """A device whose profiler keeps a memory timeline (as CUDA's does), on the host."""

    def profiler_activities(self):
        return [torch.profiler.ProfilerActivity.CPU]

    def profiler_records_memory(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def _train_steps(callback, run: _Run) -> None:
    weight = torch.randn(64, 64, requires_grad=True)
    callback.on_train_begin(run)
    while run.global_step < run.total_steps:
        callback.on_step_begin(run)
        (torch.randn(32, 64) @ weight).square().mean().backward()
        run.global_step += 1
        callback.on_step_end(run)
    callback.on_train_end(run)


@pytest.mark.parametrize("matplotlib", [True, False])
def test_a_device_that_records_memory_gets_a_timeline_beside_the_trace(tmp_path, monkeypatch,
                                                                       matplotlib):
    from hputrain.callbacks import profiler as module
    from hputrain.config.sections import ProfilingSettings

    if not matplotlib:  # the HTML plot needs it; the points do not
        find_spec = module.importlib.util.find_spec
        monkeypatch.setattr(module.importlib.util, "find_spec",
                            lambda name: None if name == "matplotlib" else find_spec(name))
    settings = ProfilingSettings(output_dir=str(tmp_path), steps=(2, 3), record_shapes=False,
                                 with_stack=False)
    run = _Run(global_step=0, total_steps=4)
    _train_steps(module.StepProfiler(settings, _RecordsMemory(), rank=0), run)
    folder = tmp_path / "profile"
    check_steps = steps_and_ops(folder / "rank0.steps2-3.pt.trace.json")[0]
    assert [e["name"] for e in check_steps] == ["ProfilerStep#2", "ProfilerStep#3"]
    if matplotlib:
        assert "<html" in (folder / "rank0.memory.html").read_text().lower()
    else:
        times, sizes = json.loads((folder / "rank0.memory.json").read_text())
        assert times and len(sizes) == len(times)
    assert len(run.lines) == 1 and "top operations" in run.lines[0]


def test_only_rank_0_prints_and_writes_the_table(tmp_path):
    from hputrain.callbacks.profiler import StepProfiler
    from hputrain.config.sections import ProfilingSettings

    settings = ProfilingSettings(output_dir=str(tmp_path), steps=(1, 1), record_shapes=True,
                                 with_stack=False)
    accelerator = type("Host", (_RecordsMemory,), {"profiler_records_memory": lambda self: False})
    run = _Run(global_step=0, total_steps=2)
    _train_steps(StepProfiler(settings, accelerator(), rank=1), run)
    assert (tmp_path / "profile" / "rank1.steps1-1.pt.trace.json").is_file()
    assert not (tmp_path / "profile" / "top_ops.txt").exists() and run.lines == []
    assert not list((tmp_path / "profile").glob("*.memory.*"))
