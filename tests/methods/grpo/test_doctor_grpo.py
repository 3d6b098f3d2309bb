"""Issue 32 item 4: `hputrain doctor` on a GRPO script (tests/doctor_scripts/grpo_script.py, the
Python API on a tiny Llama). The references: the rollouts' own micro-batches (made with fixed
completions) for the shapes the doctor describes without generating, and the lazy backend's
compile counter for the steps it watches: nothing compiled after warm-up, in a step or between
steps (the rollouts), with the default prompt_buckets; a recompilation finding with a bucket per
prompt length."""
from __future__ import annotations

import re
import sys
from itertools import islice
from pathlib import Path

import pytest

from ...hf_fixtures import lazy_rehearses_hf_models, tiny_llama_folder

transformers = pytest.importorskip("transformers", reason="GRPO fine-tunes Hugging Face models")

from hputrain import GRPOConfig, GRPOTrainer  # noqa: E402
from hputrain.rehearsal.doctor import run, walk_run_batches  # noqa: E402
from hputrain.methods.grpo.doctor import ROLLOUT_READ  # noqa: E402

SCRIPT = Path(__file__).parents[2] / "doctor_scripts" / "grpo_script.py"


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_llama_folder(tmp_path_factory.mktemp("doctor_grpo") / "llama", seed=0)


def doctor(folder: Path, *args: str) -> dict:
    return run(str(SCRIPT), [str(folder), *args], 6, 2)


def kinds(report: dict) -> list[str]:
    return sorted(f["kind"] for f in report["findings"])


def watched_widths(report: dict) -> set[int]:
    return {int(w) for s in report["shapes"]["distinct"] for w in re.findall(r"input_ids: \[4, (\d+)\]", s)}


@pytest.mark.parametrize("buckets", [None, list(range(1, 64))], ids=["default", "exact"])
def test_the_described_shapes_are_the_rollouts_own_and_nothing_is_generated(folder, tmp_path, buckets):
    """walk_run_batches describes a GRPO run's micro-batches without generating (the `complete`
    hook is never called); the same rollouts, then made with fixed completions, have exactly
    those input_ids widths, new in the same order."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from grpo_script import brevity, prompts
    finally:
        sys.path.remove(str(SCRIPT.parent))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    calls = []

    def complete(generation, prompt_ids):
        calls.append(generation)
        return [[5, 6, 7] for _ in prompt_ids]

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=40, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=8, report_to=[], disable_tqdm=True,
                      **({"prompt_buckets": buckets} if buckets else {}))
    trainer = GRPOTrainer(model, args, reward_funcs=[brevity], train_dataset=prompts(),
                          processing_class=tokenizer, complete=complete)
    trainer.total_steps, trainer.global_step = 40, 0
    walk = walk_run_batches(trainer)
    assert calls == [] and walk.collator == "rollouts" and walk.between_steps
    census = walk.census
    assert census.batches == 20 and walk.walked.startswith("an epoch of 20 steps")
    real = [list(b["input_ids"].shape) for b in islice(trainer.train_batches().iterate(0), 20)]
    assert len(calls) == 20
    order = list(dict.fromkeys(f"[{r}, {w}]" for r, w in real))
    assert census.shapes == order and census.widths == {w for _, w in real}
    if buckets is None:
        assert order == ["[4, 24]"] and census.bounded  # every prompt (2 to 13 tokens) in 16
    else:
        assert len(order) > 8 and not census.bounded and census.padding == "longest row"


@lazy_rehearses_hf_models
def test_doctor_on_a_grpo_script_agrees_lazy_mode_compiles_nothing_after_warm_up(folder, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = doctor(folder)
    assert list(tmp_path.iterdir()) == []  # completions.jsonl too went to the doctor's folder
    assert report["steps"] == 6
    assert report["compiles_per_step"][0] > 0 and report["compiles_per_step"][2:] == [0] * 4
    between = report["compiles_between_steps"]  # the rollouts: generation's graphs
    assert between[0] > 0 and between[2:] == [0] * 4, between
    assert "recompilation" not in kinds(report)
    walk = report["run_shapes"]
    assert walk["count"] == 1 and walk["listing"] == "[4, 24]" and walk["micro_batches"] == 20
    assert watched_widths(report) == {24} and len(report["shapes"]["distinct"]) == 1
    assert any("[rows, prompt bucket + max_completion_length]: [4, 16 + 8]" in n for n in report["notes"])
    assert ROLLOUT_READ in report["notes"]
    assert any(n.startswith("graphs compiled between steps") and "none after the 2 warm-up" in n
               for n in report["notes"])
    # the rollout's read is not a step's, and the training forward reads nothing back: its 4-D
    # mask is made on the device (transformers checks a 2-D one on the host)
    assert report["host_syncs_per_step"] == [0] * 6
    assert "host_sync" not in kinds(report) and "fallback" not in kinds(report)


@lazy_rehearses_hf_models
def test_doctor_finds_a_bucket_for_every_prompt_length(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = doctor(folder, "exact")
    assert "recompilation" in kinds(report)
    [finding] = [f for f in report["findings"] if f["kind"] == "recompilation"]
    assert "prompt_buckets has 63" in finding["message"] and "1 shape(s) for these prompts" in finding["message"]
    walk = report["run_shapes"]
    assert walk["count"] > 8 and not walk["bounded"]
    assert watched_widths(report) <= set(walk["sequence_lengths"])  # described = generated
    assert any(report["compiles_per_step"][2:]) and any(report["compiles_between_steps"][2:])
    assert any("after the warm-up, before steps" in n for n in report["notes"])
