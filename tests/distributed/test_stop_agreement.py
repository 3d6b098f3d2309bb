"""Every rank stops at the same step, whatever moment a stop request reaches whichever rank.

A rank acts only on what every rank agreed (the trainer's per-step host all-reduce, and the one
before each save), never on its own flag. Each case below delivers a stop on purpose, at a chosen
phase of step K and on chosen ranks (tests/stop_script.py): SIGTERM / SIGINT raised in-process
before, during or after the step's agreement, in forward, in backward (DDP's all-reduce under way),
in the optimizer step, on_log, during an evaluation or a save; to the launcher; a callback's
should_stop on one rank; a loss that becomes NaN on one rank. Two processes started by
`hputrain launch` run many cases one after another (a launch costs seconds, a case a fraction of
one). Each case must stop both ranks at the expected step with the same outcome (exit 143 / 130 /
0 / 2), leave exactly one checkpoint, and resume from it to the uninterrupted run's weights, bit for
bit; no rank may crash in Gloo or hang.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .. import stop_script
from ..stop_script import K, PHASES

ROOT = Path(__file__).parents[2]
SCRIPT = str(ROOT / "tests" / "stop_script.py")
# one intra-op thread per rank: two ranks on two cores, not four threads fighting for them
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HPUTRAIN_CONFIG_FILE": "/nonexistent/hputrain.json",
       "OMP_NUM_THREADS": "1"}
SIGNALS = {"sigterm": 15, "sigint": 2, "mixed": 15, "launcher": 15, "stop": None}
CRASHES = ("Traceback", "terminate called", "EnforceNotMet", "gloo::", "Timed out", "Connection closed")


def launch(out, strategy, cases, timeout=600):
    return subprocess.run([sys.executable, "-m", "hputrain.cli", "launch", "--nproc-per-node", "2", SCRIPT,
                           str(out), strategy, *cases], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=ENV)


def expected(name: str) -> dict:
    case = stop_script.parse(name)
    kind, phase = case["kind"], case["phase"]
    stop = K - 1 if phase == "before_agreement" else K
    if kind == "nan":
        return {"step": K, "exit": 2, "checkpoints": []}
    signum = SIGNALS[kind]
    return {"step": stop, "signal": signum, "exit": 128 + signum if signum else 0, "checkpoints": [stop],
            "resumed_identical": True,
            # the last save writes the whole model (fsdp), unless the stop came after it began
            "consolidated": phase not in ("save", "on_save")}


def check_cases(out, strategy, cases, proc):
    """Every case's outcome on both ranks, all mismatches at once; then the launch's own exit."""
    results = {}
    for rank in (0, 1):
        path = out / f"results-{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            results[record["case"], rank] = record
    problems = []
    for name in cases:
        case, want = stop_script.parse(name), expected(name)
        got = [results.get((name, rank)) for rank in (0, 1)]
        if None in got:
            problems.append(f"{name}: no result from rank {got.index(None)}")
            continue
        for key, value in want.items():
            if key == "consolidated" and strategy != "fsdp":
                continue  # a full (ddp) checkpoint always holds the whole model
            for rank in (0, 1):
                if got[rank].get(key) != value:
                    problems.append(f"{name}: rank {rank} {key}={got[rank].get(key)!r}, want {value!r}")
        if case["kind"] == "nan" and not (got[0]["error"] == got[1]["error"] and "became nan" in got[0]["error"]):
            problems.append(f"{name}: errors differ or are not the NaN's: {got[0]['error']!r} / {got[1]['error']!r}")
        if case["kind"] != "nan":
            fired = [got[rank]["fired"] for rank in (0, 1)]
            if fired != [rank in case["ranks"] for rank in (0, 1)]:
                problems.append(f"{name}: the stop was delivered on ranks {fired}, want {case['ranks']}")
    assert not problems, "\n".join(problems) + "\n" + proc.stderr[-3000:]
    crashes = [word for word in CRASHES if word in proc.stderr]
    assert not crashes, proc.stderr[-5000:]
    # The launch exits as its last case's run. Once one rank has exited, torch's agent ends the
    # others with SIGTERM: a rank still on its way out may show as -15 (killed by the signal).
    last = expected(cases[-1])["exit"]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hputrain launch")]
    assert proc.returncode == last, proc.stderr[-3000:]
    if stop_script.parse(cases[-1])["kind"] == "launcher":
        assert lines == ["hputrain launch: SIGTERM received: passed to every worker to save and stop (exit 143)"]
    elif last == 143:
        assert len(lines) == 1 and re.fullmatch(r"hputrain launch: stopped by SIGTERM \(rank 0 exited "
                                                r"(143|-15), rank 1 exited (143|-15)\); exit 143", lines[0]), lines
    elif last == 2:  # the same line from every rank the agent did not end first: said once
        error = results[cases[-1], 0]["error"]
        assert len(lines) == 1 and re.fullmatch(rf"hputrain launch: ranks? (0|1|0, 1) failed \(exit code 2\): "
                                                rf"hputrain: error: {re.escape(error)}", lines[0]), lines


def run(tmp_path, strategy, cases):
    proc = launch(tmp_path, strategy, cases)
    check_cases(tmp_path, strategy, cases, proc)


# -- what CI runs: one launch per strategy -------------------------------------------------------

CI_CASES = [
    "stop.step_end.1+save",  # should_stop on one rank, then a save of the same step
    "sigterm.after_agreement.0",  # the reported race: the signal lands during the agreement
    "sigterm.during_agreement.1",
    "sigterm.backward.1",  # rank 1 signalled while DDP / FSDP all-reduce its gradients
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.ci), "fsdp"])
def test_stops_agreed_by_every_rank(tmp_path, strategy):
    run(tmp_path, strategy, CI_CASES)


# -- every phase, every rank --------------------------------------------------------------------

SIGNAL_CASES = [f"sigterm.{phase}.{ranks}" for phase in PHASES for ranks in ("0", "1", "both")] + [
    "sigint.backward.1", "sigint.after_agreement.0",
    "mixed.forward.both", "mixed.during_agreement.both",  # SIGINT on rank 0, SIGTERM on rank 1: SIGTERM
    "sigterm.before_agreement.1+save", "sigterm.forward.0+save", "sigterm.log.1+save",
]
CALLBACK_AND_NAN_CASES = [
    *(f"stop.{phase}.{rank}" for phase in ("step_begin", "step_end", "log", "on_evaluate", "on_save")
      for rank in "01"),
    "stop.log.0+save", "stop.on_evaluate.1+save", "stop.step_begin.1+save",
    "nan.save.1",  # found by the check before a save at step K
    "nan.log.0",
    "nan.log.1",  # found by the log of step K; the launch ends with it (exit 2)
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_signal_at_every_phase_on_either_rank_stops_every_rank_at_one_step(tmp_path, strategy):
    run(tmp_path, strategy, SIGNAL_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_callback_stop_or_a_nan_on_one_rank_is_every_ranks(tmp_path, strategy):
    run(tmp_path, strategy, CALLBACK_AND_NAN_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_to_the_launcher_during_backward_stops_every_rank_at_one_step(tmp_path, strategy):
    run(tmp_path, strategy, ["sigterm.optimizer.0", "launcher.backward.1"])
