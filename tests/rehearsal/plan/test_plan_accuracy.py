"""Issue 26: `hputrain plan` against the measured step with 2 processes (ddp and fsdp, on Gloo),
each rank started by `hputrain launch`; the single-process cases are in test_rehearsal_plan.py.
The plan goes through the same path as `hputrain plan --target cpu` (this machine, whose backend
is Gloo); the measurement is rank 0's StepPeak of the third step of a real Trainer run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hputrain.accelerators import detect_accelerator
from hputrain.rehearsal.plan import plan

from ...hf_fixtures import llama_config, on_cpu  # noqa: F401  (fixtures: llama, on_cpu)
from ...plan_step_script import settings
from ...distributed.test_distributed import hputrain_launch

transformers = pytest.importorskip("transformers")
SCRIPT = str((Path(__file__).parents[2] / "plan_step_script.py"))
GPT = ["--model-size", "small", "--seq-len", "128", "--per-device-train-batch-size", "2"]


pytestmark = pytest.mark.usefixtures("on_cpu")



def planned_and_measured(flags: list[str], tmp_path: Path):
    step, args = settings([*flags, "--devices", "2"])
    planned = plan(step, args, "cpu", 2**50, accelerator=detect_accelerator("cpu", "eager"))
    result = tmp_path / "measured.json"
    proc, _ = hputrain_launch("--cpu", "--nproc-per-node", "2", SCRIPT, str(result), *flags,
                              timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return planned, json.loads(result.read_text())


def check(flags: list[str], tmp_path: Path):
    planned, measured = planned_and_measured(flags, tmp_path)
    assert planned.peak_bytes == pytest.approx(measured["peak_bytes"], rel=0.10), (
        planned.breakdown, measured["breakdown"])
    return planned, measured


@pytest.mark.slow
@pytest.mark.ci
def test_gpt_fsdp_on_2_processes_is_within_10_percent(tmp_path):
    planned, measured = check([*GPT, "--precision", "fp32", "--strategy", "fsdp"], tmp_path)
    # each rank holds half of AdamW's moments, in the plan as in the run
    assert planned.breakdown["optimizer"] == pytest.approx(measured["breakdown"]["optimizer"],
                                                           rel=0.02)


@pytest.mark.slow
def test_gpt_ddp_on_2_processes_is_within_10_percent(tmp_path):
    check([*GPT, "--precision", "fp32", "--strategy", "ddp"], tmp_path)


@pytest.mark.slow
def test_llama_fsdp_bf16_checkpointing_on_2_processes_is_within_10_percent(llama, tmp_path):
    """Its peak is the root's reduce-scatter in backward, where Gloo reduces in a copy of the
    input: the plan for the cpu target counts that copy."""
    check(["--model", str(llama), "--block-size", "128", "--per-device-train-batch-size", "2",
           "--precision", "bf16-mixed", "--strategy", "fsdp", "--gradient-checkpointing"],
          tmp_path)


@pytest.mark.slow
def test_llama_lora_fsdp_on_2_processes_is_within_10_percent(llama, tmp_path):
    check(["--model", str(llama), "--block-size", "128", "--per-device-train-batch-size", "2",
           "--precision", "fp32", "--strategy", "fsdp", "--lora-r", "8"], tmp_path)


@pytest.mark.slow
def test_llama_lora_ddp_bf16_checkpointing_on_2_processes_is_within_10_percent(llama, tmp_path):
    check(["--model", str(llama), "--block-size", "128", "--per-device-train-batch-size", "2",
           "--precision", "bf16-mixed", "--strategy", "ddp", "--lora-r", "8",
           "--gradient-checkpointing"], tmp_path)
