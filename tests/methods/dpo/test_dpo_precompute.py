"""Issue 39, items 10 and 11: DPO's precomputed reference (--precompute-ref-log-probs).

Item 10: once every split carries its log-probs, the frozen reference is freed: the recipe holds
no copy of it (under LoRA the reference is the policy with its adapters disabled, and there is
nothing else to free). Item 11: the pass is split over the ranks (each its share of one
process's batches, the results gathered: the same numbers as one process), the log-probs sit
as an array beside the memory-mapped pairs, and the ranks agree on whether a cache exists
before the collective pass. References: the one-process pass, the per-sequence computation of
test_dpo.py."""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from ...methods.dpo.test_dpo import _on_cpu, load, models, sequence_logp, text_rows, tokenizer_of, write_jsonl  # noqa: F401

transformers = pytest.importorskip("transformers", reason="DPO fine-tunes Hugging Face models")

from hputrain.cli import main  # noqa: E402
from hputrain.methods.dpo.config import DPOConfig  # noqa: E402
from hputrain.methods.dpo.data import EncodedPairs, encode_pairs  # noqa: E402
from hputrain.methods.dpo import trainer as dpo  # noqa: E402

RANKS_SCRIPT = str((Path(__file__).parents[2] / "dpo_precompute_ranks.py"))


def live_models() -> int:
    """Causal LMs (the tiny Llamas) alive in this process, after a full collection."""
    gc.collect()
    return sum(type(o) is transformers.LlamaForCausalLM for o in gc.get_objects())


class PrepareProbe:
    """PreferenceObjective.prepare wrapped: what the objective held before it and what is left
    alive after it, while the recipe's run goes on."""

    def __init__(self, monkeypatch) -> None:
        self.seen: dict = {}
        original = dpo.PreferenceObjective.prepare

        def prepare(objective, train, evaluation):
            seen = self.seen
            seen["models_before"] = live_models()
            reference = objective.reference
            seen["had_reference"] = reference is not None
            probe = weakref.ref(reference) if reference is not None else None
            del reference
            seen["columns"] = train.columns if isinstance(train, EncodedPairs) else None
            train, evaluation = original(objective, train, evaluation)
            seen["models_after"] = live_models()
            seen["freed"] = probe is None or probe() is None
            seen["adapters_are_the_policy"] = objective.adapters is objective.loop.model
            seen["train"] = train
            return train, evaluation

        monkeypatch.setattr(dpo.PreferenceObjective, "prepare", prepare)


@pytest.mark.parametrize("reference", ["frozen copy", "ref-model under lora", "lora"])
def test_the_recipe_frees_the_frozen_reference_after_precomputing(models, tmp_path, monkeypatch,
                                                                  reference):
    """`hputrain train --precompute-ref-log-probs`: after the pass, the frozen reference (a copy
    of the starting weights, or --ref-model's, also beside LoRA adapters) is gone, and the only
    model left is the policy; under LoRA alone no second model is ever made."""
    probe, alive = PrepareProbe(monkeypatch), live_models()  # those of earlier tests, if any
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(6))
    flags = {"frozen copy": [], "ref-model under lora": ["--lora-r", "4", "--ref-model", str(models[1])],
             "lora": ["--lora-r", "4"]}[reference]
    assert main(["train", "--model", str(models[0]), "--dataset", str(data), "--max-steps", "1",
                 "--per-device-train-batch-size", "3", "--precompute-ref-log-probs",
                 "--validation-split-percentage", "0", "--precision", "fp32", "--disable-tqdm",
                 "--output-dir", str(tmp_path / "run"), *flags]) == 0
    seen = probe.seen
    assert seen["freed"]
    assert seen["models_after"] - alive == 1  # the policy alone
    if reference == "lora":  # the reference is the policy, adapters disabled: nothing to free
        assert not seen["had_reference"] and seen["adapters_are_the_policy"]
        assert seen["models_before"] - alive == 1
    else:
        assert seen["had_reference"] and seen["models_before"] - alive == 2


def test_log_probs_sit_beside_the_memory_mapped_pairs(models, tmp_path, monkeypatch):
    """The recipe's pairs stay its memory-mapped arrays (no Python list of pairs), with the
    log-probs as one float64 array beside them, equal to each sequence's own computation."""
    probe = PrepareProbe(monkeypatch)
    data = write_jsonl(tmp_path / "pairs.jsonl", text_rows(6))
    assert main(["train", "--model", str(models[0]), "--ref-model", str(models[1]), "--dataset",
                 str(data), "--max-steps", "1", "--per-device-train-batch-size", "3",
                 "--per-device-eval-batch-size", "4", "--precompute-ref-log-probs",
                 "--validation-split-percentage", "0", "--precision", "fp32", "--disable-tqdm",
                 "--output-dir", str(tmp_path / "run")]) == 0
    train = probe.seen["train"]
    assert isinstance(train, EncodedPairs) and train.columns is probe.seen["columns"]
    assert all(isinstance(c.values, np.memmap) for c in train.columns.values())
    assert train.ref_logps.dtype == np.float64 and train.ref_logps.shape == (6, 2)
    reference = load(models[1])
    for i, pair in enumerate(train):
        start = len(pair["prompt_ids"])
        for j, key in enumerate(("chosen_ids", "rejected_ids")):
            expected = sequence_logp(reference, pair["prompt_ids"] + pair[key], start)
            assert train.ref_logps[i, j] == pytest.approx(expected, abs=1e-4)
            assert pair[("ref_chosen_logps", "ref_rejected_logps")[j]] == train.ref_logps[i, j]


def one_process_logps(models, tmp_path) -> np.ndarray:
    """The reference's log-probs of test 2-rank case's pairs, on one process, in batches of 2."""
    tokenizer = tokenizer_of(models[0])
    pairs, _ = encode_pairs(((str(i), r) for i, r in enumerate(text_rows(10))), tokenizer,
                            max_length=128)
    args = DPOConfig(output_dir=str(tmp_path / "one"), precompute_ref_log_probs=True,
                     per_device_eval_batch_size=2, report_to="none", disable_tqdm=True, max_length=128)
    trainer = dpo.DPOTrainer(load(models[0]), args, ref_model=load(models[1]),
                             processing_class=tokenizer, train_dataset=pairs)
    values = trainer.precompute_reference(pairs).ref_logps
    assert trainer.precompute_forwards == 5
    return values


def test_two_ranks_split_the_pass_and_agree_on_the_cache(models, tmp_path):
    """2 processes under fsdp, 5 batches: rank 0 runs 3, rank 1 runs 2 (and one repeat to keep
    in step, not counted); both hold all 10 pairs' log-probs, equal to one process's; the frozen
    reference is freed. Then rank 1 is made blind to the cache rank 0 reads: on main, rank 0
    skipped the pass that rank 1 ran alone in fsdp's gathers, and rank 1 died when rank 0 left
    ("Connection closed by peer"). Both must run it, also when rank 0 is the blind one. With the
    cache seen by both, neither runs a forward."""
    out = tmp_path / "ranks"
    proc = subprocess.Popen([sys.executable, "-m", "hputrain.cli", "launch", "--nproc-per-node",
                             "2", "--cpu", RANKS_SCRIPT, str(models[0]), str(models[1]), str(out),
                             "fsdp"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        said, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        said, _ = proc.communicate()
        pytest.fail(f"the 2 ranks did not finish within 240 s (hung?): {said[-3000:]}")
    assert proc.returncode == 0, said[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = one_process_logps(models, tmp_path)
    assert [r["trained"]["forwards"] for r in ranks] == [3, 2]
    for blind in (1, 0):  # rank 1, then rank 0, saw no cache: both ran the pass, agreed
        assert [r[f"blind {blind}"]["forwards"] for r in ranks] == [3, 2]
    assert [r["blind None"]["forwards"] for r in ranks] == [0, 0]  # both read the cache
    assert all(r["trained"]["freed"] for r in ranks)
    for seen in ranks:
        for run in ("trained", "blind 1", "blind 0", "blind None"):
            np.testing.assert_allclose(seen[run]["ref_logps"], expected, rtol=1e-6, atol=1e-6)
