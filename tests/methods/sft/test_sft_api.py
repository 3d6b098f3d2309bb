"""The SFT Python API (issue 24): `hputrain.sft_dataset` turns a datasets.Dataset of
conversations into packed blocks (or padded rows with their collator) that `hputrain.Trainer`
trains on. The reference is the model called on one example at a time (test_sft_recipe's
reference_loss): a first step whose batch is the whole data set logs exactly that loss. Lazy mode
on the CPU compiles no graph after warm-up on packed blocks of conversations of many lengths."""
from __future__ import annotations

import json

import pytest
import torch

import hputrain
from hputrain import Trainer, TrainingArguments
from hputrain.errors import InputError

from ...hf_fixtures import lazy_rehearses_hf_models
from ...methods.sft.test_sft_recipe import chat_model, chat_rows, conversation, reference_loss  # noqa: F401

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

BLOCK = 256  # two or three conversations a block


def model_and_tokenizer(folder):
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, tokenizer


def train(model, output, data, batch: int, steps: int = 2, **overrides) -> list[dict]:
    args = TrainingArguments(output_dir=str(output), per_device_train_batch_size=batch,
                             max_steps=steps, logging_steps=1, learning_rate=1e-3, precision="fp32",
                             save_steps=0, report_to="none", disable_tqdm=True, accelerator="cpu",
                             **overrides)
    Trainer(model, args, train_dataset=data, data_collator=data.collator).train()
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "unpacked"])
def test_sft_dataset_trains_with_the_trainer_on_the_per_example_loss(
        tmp_path, chat_model, chat_rows, packing):  # noqa: F811
    model, tokenizer = model_and_tokenizer(chat_model)
    data = hputrain.sft_dataset(datasets.Dataset.from_list(chat_rows), tokenizer, BLOCK,
                                packing=packing)
    assert data.rows.rows == data.rows.examples == len(chat_rows)
    assert data.packed.truncated == 0 and data.packed.examples == len(chat_rows)
    if packing:
        assert data.collator is None and len(data) < len(chat_rows)  # several examples a block
        assert {tuple(data[0][k].shape) for k in data[0]} == {(BLOCK,)}
        assert set(data[0]) == {"input_ids", "labels", "position_ids", "seq_lens"}
    else:
        assert data.collator is not None and len(data) == len(chat_rows)
    expected, _ = reference_loss(chat_model, chat_rows)
    logs = train(model, tmp_path / "run", data, batch=len(data))  # step 1: the whole data set
    losses = [row["loss"] for row in logs if "loss" in row]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert losses[0] == pytest.approx(expected, abs=1e-5)


def test_sft_dataset_takes_a_list_of_prompt_completion_rows_and_the_trl_flags(
        chat_model):  # noqa: F811
    _, tokenizer = model_and_tokenizer(chat_model)
    rows = [{"prompt": "to be or not? ", "completion": "that is the question"},
            {"prompt": "a stitch in time? ", "completion": "saves nine"}]
    only = hputrain.sft_dataset(rows, tokenizer, 32)
    everything = hputrain.sft_dataset(rows, tokenizer, 32, completion_only_loss=False)
    learned = [int((d[0]["labels"] != -100).sum()) for d in (only, everything)]
    assert 0 < learned[0] < learned[1]
    cut = hputrain.sft_dataset(rows, tokenizer, 6, completion_only_loss=False)
    assert cut.packed.truncated == 2
    with pytest.raises(InputError, match="anything to learn within 3 tokens"):
        hputrain.sft_dataset(rows, tokenizer, 3)  # the cut leaves only prompt tokens
    with pytest.raises(InputError, match="row 1"):
        hputrain.sft_dataset([{"messages": conversation(0)}, {"messages": []}], tokenizer, 32)


@lazy_rehearses_hf_models
def test_lazy_mode_compiles_no_graph_after_warmup_on_packed_blocks(
        tmp_path, chat_model):  # noqa: F811
    """Conversations of 89 to 165 tokens packed into blocks of 256: every batch is [2, 256]
    whatever the examples' lengths, so after the warm-up steps lazy mode compiles nothing (the
    block mask is built on the device from the lengths, never read back); the losses are eager's."""
    _, tokenizer = model_and_tokenizer(chat_model)
    rows = [{"messages": conversation(i) + conversation(i + 1)[:2] * (i % 3)} for i in range(24)]
    data = hputrain.sft_dataset(rows, tokenizer, BLOCK)
    lengths = [n for block in data.items for n in block["seq_lens"].tolist() if n]
    assert len(set(lengths)) > 5 and len(data) >= 8
    assert len({tuple(n for n in b["seq_lens"].tolist() if n) for b in data.items}) > 3
    runs = {mode: train(model_and_tokenizer(chat_model)[0], tmp_path / mode, data, batch=2, steps=8,
                        execution_mode=mode, throughput_warmup_steps=2)
            for mode in ("lazy", "eager")}
    summary = runs["lazy"][-1]
    assert summary["graph_compiles"] > 0 and summary["graph_compiles_after_warmup"] == 0, summary
    losses = {mode: [row["loss"] for row in logs if "loss" in row] for mode, logs in runs.items()}
    assert len(losses["lazy"]) == 8 and losses["lazy"] == pytest.approx(losses["eager"], abs=1e-4)
