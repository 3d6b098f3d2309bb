"""Hugging Face models and datasets drop in (skipped when transformers or datasets is absent)."""
import pytest
import torch

from hputrain import Trainer, TrainingArguments

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install hputrain[hf])")
datasets = pytest.importorskip("datasets", reason="datasets is not installed (pip install hputrain[hf])")


def test_hf_causal_lm_on_a_datasets_dataset(tmp_path):
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)  # built from a config: no download
    rows = []
    for i in range(48):
        length = 8 + i % 9  # ragged: the collator pads
        ids = ((torch.arange(length) * (1 + i % 3)) % 64).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": ids, "text": f"row {i}"})
    dataset = datasets.Dataset.from_list(rows)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=30, learning_rate=5e-3, logging_steps=10,
                             per_device_train_batch_size=8, disable_tqdm=True, save_steps=0)
    trainer = Trainer(model, args, train_dataset=dataset, eval_dataset=dataset)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    assert after < 0.7 * before
    assert (tmp_path / "checkpoint-30" / "model.safetensors").exists()
