"""Issue 32 (item 5): `hputrain plan` plans a GRPO step (--method grpo, or prompt-only data with
--reward-funcs): the generation's key/value cache held through the run, the reference's weights
when beta > 0 (none under LoRA: the adapter-disabled base), and the training step on
[rows, largest bucket + max_completion_length] with log-probs on the completion positions only.
The cache is checked against its formula; the training step against the same step measured in
a real GRPOTrainer run (rehearsal/plan/measure.py: StepPeak of its third step)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from hputrain.cli import main
from hputrain.rehearsal.plan import CATEGORIES
from hputrain.methods.grpo.plan import KV_CACHE

from ...hf_fixtures import llama_config_folder
from ...plan_step_script import measured, planned

transformers = pytest.importorskip("transformers")

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # the folder below: hidden 128, 4 heads, 2 of keys/values


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return llama_config_folder(tmp_path_factory.mktemp("llama-config"), vocab_size=2048,
                               hidden_size=128, intermediate_size=352, layers=LAYERS, heads=4)


def grpo_flags(llama: Path, *more: str) -> list[str]:
    return ["--model", str(llama), "--method", "grpo", "--per-device-train-batch-size", "4",
            "--num-generations", "4", "--max-completion-length", "64", "--prompt-buckets", "64",
            "--precision", "fp32", *more]


@pytest.mark.parametrize("more, rows, dtype", [
    ([], 4, torch.float32),
    (["--gradient-accumulation-steps", "2"], 8, torch.float32),  # a generation serves 2 micro-batches
    (["--steps-per-generation", "4", "--prompt-buckets", "32", "64", "96"], 16, torch.float32),
    (["--precision", "bf16-mixed"], 4, torch.bfloat16),  # written by the autocast forward
])
def test_the_kv_cache_is_rows_x_length_x_layers_x_2_x_kv_heads_x_head_dim(llama, more, rows, dtype):
    plan = planned(grpo_flags(llama, *more))
    bucket = 96 if "96" in more else 64
    formula = rows * (bucket + 64) * LAYERS * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
    assert plan.breakdown[KV_CACHE] == formula
    assert set(plan.breakdown) == {*CATEGORIES, KV_CACHE}
    assert sum(plan.breakdown.values()) == plan.peak_bytes
    assert all(plan.breakdown[c] > 0 for c in ("parameters", "optimizer", "activations"))


def test_the_reference_is_held_only_with_beta_and_not_under_lora(llama):
    none = planned(grpo_flags(llama))
    copy = planned(grpo_flags(llama, "--beta", "0.04"))
    assert copy.breakdown["parameters"] == pytest.approx(2 * none.breakdown["parameters"], rel=0.01)
    lora, lora_beta = planned(grpo_flags(llama, "--lora-r", "8")), planned(
        grpo_flags(llama, "--lora-r", "8", "--beta", "0.04"))
    assert lora_beta.breakdown["parameters"] == lora.breakdown["parameters"]  # adapters disabled


def test_the_training_step_grows_with_the_completion_not_the_block(llama):
    """The block size is a causal-LM setting; the GRPO step's width is bucket + completion."""
    short, long = planned(grpo_flags(llama)), planned(
        grpo_flags(llama, "--max-completion-length", "192"))
    assert long.breakdown["activations"] > 1.8 * short.breakdown["activations"]
    assert planned(grpo_flags(llama, "--block-size", "32")).peak_bytes == short.peak_bytes


CASES = {
    "fp32": [],
    "frozen copy, beta 0.04": ["--beta", "0.04"],
    "LoRA, beta, num_iterations 2 (old log-probs)": ["--lora-r", "8", "--beta", "0.04",
                                                      "--num-iterations", "2"],
    "bf16 checkpointing": ["--precision", "bf16-mixed", "--gradient-checkpointing"],
}


@pytest.mark.parametrize("case", CASES)
def test_the_grpo_step_is_within_10_percent_of_the_measured_step(case, llama):
    """The measured run generates nothing (fixed completions): no cache to compare; the rest of
    the plan is the training step, which it is compared with."""
    flags = grpo_flags(llama, *CASES[case])
    plan, real = planned(flags), measured(flags)
    assert plan.peak_bytes - plan.breakdown[KV_CACHE] == pytest.approx(real.peak_bytes, rel=0.10), (
        plan.breakdown, real.breakdown)
    assert plan.breakdown["activations"] == pytest.approx(real.breakdown["activations"], rel=0.15)
    assert plan.breakdown["parameters"] == pytest.approx(real.breakdown["parameters"], rel=0.02)


def run_plan(capsys, *argv: str) -> subprocess.CompletedProcess:
    capsys.readouterr()
    status = main(["plan", *argv])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, status, out, err)


def test_prompts_with_reward_funcs_plan_grpo_as_train_picks_it(llama, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q {i}"}) + "\n" for i in range(8)))
    flags = grpo_flags(llama)[4:]  # without --model and --method
    found = run_plan(capsys, "--model", str(llama), "--dataset", str(prompts), "--reward-funcs",
                     "rewards.py:f", *flags)
    assert found.returncode == 0, found.stderr[-2000:]
    assert "GRPO on prompts of up to 64 tokens with 64-token completions" in found.stdout
    assert "kv_cache" in found.stdout
    asked = run_plan(capsys, "--model", str(llama), "--method", "grpo", "--json", *flags)
    assert KV_CACHE in json.loads(asked.stdout)["breakdown"]
    refused = run_plan(capsys, "--model", str(llama), "--method", "grpo", "--dataset",
                       str(prompts), *flags)
    assert refused.returncode == 2 and "GRPO needs --reward-funcs" in refused.stderr
    odd = run_plan(capsys, *grpo_flags(llama, "--num-generations", "3"))
    assert odd.returncode == 2 and len(odd.stderr.strip().splitlines()) == 1
    assert "whole groups of num_generations (3)" in odd.stderr
