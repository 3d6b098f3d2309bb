"""Issue 32: `hputrain plan` prepares the model through the Trainer's own path
(training/prepare.py: kernels, precision, checkpointing, the strategy's wrap), and plans a packed
SFT run's step with the packed blocks the run sees: their `seq_lens` become the block mask on the
device (training/packed.py), a [rows, 1, block, block] tensor in the compute dtype that an unpacked
step does not have. Checked against the same step measured in a real Trainer run
(rehearsal/plan/measure.py: StepPeak of its third step), within 5%."""
from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch

from hputrain import Trainer
from hputrain.cli import main

from ...hf_fixtures import llama_config_folder
from ...plan_step_script import measured, planned, settings

transformers = pytest.importorskip("transformers")

BLOCK, ROWS = 256, 2


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return llama_config_folder(tmp_path_factory.mktemp("llama-config"), vocab_size=2048,
                               hidden_size=128, intermediate_size=352, layers=2, heads=4)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    with open(folder / "chat.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                             {"role": "assistant", "content": "answer"}]}) + "\n")
    with open(folder / "text.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"text": f"document {i}"}) + "\n")
    return folder


def sft_flags(llama: Path, *more: str) -> list[str]:
    return ["--model", str(llama), "--block-size", str(BLOCK), "--per-device-train-batch-size",
            str(ROWS), "--precision", "fp32", *more]


def test_a_packed_run_plans_the_packed_blocks_it_trains_on(llama, data):
    step, _ = settings(sft_flags(llama, "--dataset", str(data / "chat.jsonl")))
    batch = step.batch(ROWS)
    assert "SFT examples packed" in step.name
    assert batch["seq_lens"].shape == batch["position_ids"].shape == (ROWS, BLOCK)
    lengths = batch["seq_lens"][0][batch["seq_lens"][0] > 0]
    assert int(lengths.sum()) == BLOCK  # whole examples filling the block
    starts = torch.cumsum(lengths, 0)[:-1]
    assert (batch["position_ids"][0][starts] == 0).all()  # positions restart at each example
    assert (batch["labels"][0][starts] == -100).all()  # nothing predicts an example's first token
    for unpacked in (sft_flags(llama, "--dataset", str(data / "chat.jsonl"), "--no-packing"),
                     sft_flags(llama, "--dataset", str(data / "text.jsonl"))):
        step, _ = settings(unpacked)
        assert "seq_lens" not in step.batch(ROWS) and "packed" not in step.name


@pytest.mark.parametrize("more", [[], ["--precision", "bf16-mixed", "--gradient-checkpointing"]],
                         ids=["fp32", "bf16 checkpointing"])
def test_the_packed_plan_is_within_5_percent_of_the_measured_packed_step(llama, more):
    flags = sft_flags(llama, "--method", "sft", *more)
    plan, real = planned(flags), measured(flags)
    assert plan.peak_bytes == pytest.approx(real.peak_bytes, rel=0.05), (plan.breakdown,
                                                                         real.breakdown)
    assert plan.breakdown["parameters"] == pytest.approx(real.breakdown["parameters"], rel=0.02)


def test_the_plan_builds_the_block_mask_as_the_run_does_and_text_has_none(llama, data,
                                                                           monkeypatch):
    """The packed step's seq_lens go through the Trainer's PackedInputs in the trace: one block
    mask a forward, [rows, 1, block, block] in the compute dtype. Unpacked rows and text (cut into
    blocks with no examples to keep apart) build none, and plan alike."""
    from hputrain.training import packed as packed_module

    made = []

    def spy(*args, **kwargs):
        mask = block_causal_mask(*args, **kwargs)
        made.append((tuple(mask.shape), mask.dtype))
        return mask

    block_causal_mask = packed_module.block_causal_mask
    monkeypatch.setattr(packed_module, "block_causal_mask", spy)
    chat = str(data / "chat.jsonl")
    packed = planned(sft_flags(llama, "--dataset", chat))
    assert made == [((ROWS, 1, BLOCK, BLOCK), torch.float32)]
    made.clear()
    planned(sft_flags(llama, "--dataset", chat, "--precision", "bf16-mixed"))
    assert made == [((ROWS, 1, BLOCK, BLOCK), torch.bfloat16)]  # autocast's dtype
    made.clear()
    unpacked = planned(sft_flags(llama, "--dataset", chat, "--no-packing"))
    text = planned(sft_flags(llama, "--dataset", str(data / "text.jsonl")))
    assert made == []
    assert text.peak_bytes == unpacked.peak_bytes != packed.peak_bytes
    assert text.breakdown == unpacked.breakdown


def test_the_plan_prepares_the_model_as_the_trainer_does(llama, tmp_path):
    """The same kernels substituted (training/prepare.py), on fake tensors and in the run. Two
    recipe steps: one step's builds share a config, whose attention the first substitution sets."""
    plan = planned(sft_flags(llama))
    step, args = settings(sft_flags(llama))
    trainer = Trainer(step.build(False), dataclasses.replace(args, output_dir=str(tmp_path)))
    assert plan.kernels == trainer.kernels and plan.kernels  # attention and RMSNorm, both
    off = planned(sft_flags(llama, "--no-fused-kernels"))
    assert off.kernels == {}


def run_plan(capsys, *argv: str) -> subprocess.CompletedProcess:
    capsys.readouterr()
    status = main(["plan", *argv])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, status, out, err)


def test_hputrain_plan_says_the_blocks_are_packed_and_the_kernels(llama, data, capsys):
    found = run_plan(capsys, *sft_flags(llama, "--dataset", str(data / "chat.jsonl")))
    assert found.returncode == 0, found.stderr[-2000:]
    header = found.stdout.splitlines()[0]
    assert "SFT examples packed 4 to a block" in header and "kernels attention: sdpa" in header
    gaudi = run_plan(capsys, *sft_flags(llama, "--method", "sft", "--target", "gaudi2"))
    assert "(this machine's, for gaudi2's)" in gaudi.stdout.splitlines()[0]
