"""A step's loss is the mean over every counted token of its global batch, however the batch is
split into micro-batches and processes (loss.py), on ragged rows padded with -100 labels."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hputrain.training.loss import TokenCount, batch_size

from .. import loss_script

ROOT = Path(__file__).parents[2]


def _losses(folder: Path) -> list[float]:
    records = map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in records if "loss" in r]


def _assert_same_weights(a: dict, b: dict, tol: float = 1e-5) -> None:
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=tol, atol=tol, msg=key)


@pytest.fixture(scope="module")
def llama_one_by_four(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("llama-4x1")
    return folder, loss_script.main([str(folder), "4", "1"])


def test_accumulation_equals_the_whole_batch_for_a_model_that_takes_the_count(tmp_path, llama_one_by_four):
    folder, whole = llama_one_by_four
    split = loss_script.main([str(tmp_path), "2", "2"])
    assert loss_script.build("llama").__class__.__name__ == "LlamaForCausalLM"
    _assert_same_weights(whole, split)
    assert _losses(tmp_path) == pytest.approx(_losses(folder), abs=1e-5)


def test_accumulation_equals_the_whole_batch_for_a_mean_loss_model(tmp_path):
    whole = loss_script.main([str(tmp_path / "whole"), "4", "1", "gpt"])
    split = loss_script.main([str(tmp_path / "split"), "1", "4", "gpt"])
    _assert_same_weights(whole, split)
    assert _losses(tmp_path / "split") == pytest.approx(_losses(tmp_path / "whole"), abs=1e-5)


@pytest.mark.slow
@pytest.mark.ci
def test_two_processes_equal_one_on_ragged_batches(tmp_path, llama_one_by_four):
    folder, whole = llama_one_by_four
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "launch", "--nproc-per-node", "2",
                           str(ROOT / "tests" / "loss_script.py"), str(tmp_path), "2", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same_weights(whole, torch.load(tmp_path / "weights.pt"))
    assert _losses(tmp_path) == pytest.approx(_losses(folder), abs=1e-5)


def test_logged_loss_is_the_token_mean_of_the_step():
    """The first logged loss equals the unsplit model's loss on the whole first global batch."""
    pytest.importorskip("transformers")
    import tempfile

    from hputrain import Trainer, TrainingArguments

    rows = loss_script.ragged_rows()
    with tempfile.TemporaryDirectory() as out:
        model = loss_script.build("llama")
        reference = loss_script.build("llama")
        args = TrainingArguments(output_dir=out, accelerator="cpu", max_steps=1, logging_steps=1,
                                 per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 save_steps=-1, disable_tqdm=True, seed=3)
        trainer = Trainer(model, args, train_dataset=rows)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(3))[:4].tolist()
        batch = trainer.collate([rows[i] for i in order])
        with torch.no_grad():
            expected = reference(**batch).loss.item()  # one forward over the whole global batch
        trainer.train()
        assert _losses(Path(out))[0] == pytest.approx(expected, abs=1e-5)


def test_token_count_follows_the_loss_shift():
    pytest.importorskip("transformers")
    labels = torch.tensor([[5, 6, 7, -100], [8, -100, -100, -100]])
    causal = TokenCount(loss_script.build("llama"))
    assert causal.shifts_labels and causal.takes_item_count
    assert causal({"input_ids": labels.clamp(min=0), "labels": labels}) == 2  # position 0 never a target
    builtin = TokenCount(loss_script.build("gpt"))  # labels come shifted already
    assert not builtin.shifts_labels and not builtin.takes_item_count
    assert builtin({"input_ids": labels.clamp(min=0), "labels": labels}) == 4
    assert builtin({"input_ids": labels, "attention_mask": (labels >= 0).long()}) == 4  # no labels
    assert batch_size({"text": ["a", "b", "c"], "input_ids": labels[:, :2].repeat(2, 1)[:3]}) == 3
