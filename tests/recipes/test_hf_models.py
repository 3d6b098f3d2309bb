"""Hugging Face models as a new user trains them: text columns, ragged predictions, lazy mode on
the CPU followed by save_pretrained (skipped when transformers or datasets is absent)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hputrain import Trainer, TrainingArguments

from ..hf_fixtures import lazy_rehearses_hf_models

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install hputrain[hf])")
datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install hputrain[hf])")

ROOT = Path(__file__).parents[2]


def _args(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path), accelerator="cpu", max_steps=2, logging_steps=1,
                    per_device_train_batch_size=2, per_device_eval_batch_size=2, save_steps=-1,
                    disable_tqdm=True)
    return TrainingArguments(**(settings | overrides))


def _qwen2():
    """Tied input and output embeddings, as Qwen2's small models have."""
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config)


def _text_first_rows(count=12):
    """What `Dataset({"text": ...}).map(tokenize)` gives: the text column first."""
    rows = []
    for i in range(count):
        ids = [(i * 3 + j) % 60 + 1 for j in range(6 + i % 5)]
        rows.append({"text": " ".join(map(str, ids)), "input_ids": ids, "attention_mask": [1] * len(ids),
                     "labels": ids})
    return datasets.Dataset.from_list(rows)


def test_a_text_first_dataset_trains(tmp_path):
    dataset = _text_first_rows()
    assert dataset.column_names[0] == "text"
    output = Trainer(_qwen2(), _args(tmp_path), train_dataset=dataset).train()
    assert output.global_step == 2 and output.training_loss > 0


def _t5():
    config = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16,
                                   decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)


def _seq2seq_rows():
    rows = []
    for i in range(7):  # 7 rows in batches of 2: ragged targets across batches, a short last batch
        rows.append({"input_ids": [(i + j) % 60 + 1 for j in range(5)],
                     "labels": [(i * 2 + j) % 60 + 1 for j in range(2 + i % 4)]})
    return rows


def test_predict_pads_ragged_outputs_and_weights_the_loss_like_evaluate(tmp_path):
    model, rows = _t5(), _seq2seq_rows()
    trainer = Trainer(model, _args(tmp_path), eval_dataset=rows)
    trainer.model.train()
    output = trainer.predict(rows)
    evaluated = trainer.evaluate()["eval_loss"]
    assert trainer.model.training  # predict() and evaluate() restore the mode they found
    longest = max(len(r["labels"]) for r in rows)
    assert output.predictions.shape[:2] == (len(rows), longest)
    assert output.label_ids.shape == (len(rows), longest)
    for row, labels in zip(rows, output.label_ids):
        n = len(row["labels"])
        assert labels[:n].tolist() == row["labels"] and (labels[n:] == -100).all()
    # the loss over all target tokens at once, as one would compute it unsplit
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(input_ids=torch.tensor([r["input_ids"]]),
                                  labels=torch.tensor([r["labels"]])).logits[0] for r in rows])
    targets = torch.cat([torch.tensor(r["labels"]) for r in rows])
    token_mean = torch.nn.functional.cross_entropy(logits, targets).item()
    assert output.metrics["test_loss"] == pytest.approx(token_mean, abs=1e-5)
    assert evaluated == pytest.approx(token_mean, abs=1e-5)


@lazy_rehearses_hf_models
def test_lazy_training_hands_back_a_saveable_model_with_ties_intact(tmp_path):
    model = _qwen2()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    trainer = Trainer(model, _args(tmp_path / "run", execution_mode="lazy"), train_dataset=_text_first_rows(),
                      eval_dataset=_text_first_rows(4))
    trainer.train()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu"
    trainer.evaluate()  # back to the lazy device and home again
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "saved")
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


@pytest.mark.slow
@pytest.mark.ci
def test_lazy_hputrain_train_exits_cleanly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hputrain.cli", "train", "--cpu", "--execution-mode", "lazy",
                           "--max-steps", "2", "--logging-steps", "1", "--per-device-train-batch-size", "2",
                           "--seq-len", "32", "--max-corpus-bytes", "20000", "--eval-batches", "1",
                           "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "sample:" in proc.stdout and "Traceback" not in proc.stderr
