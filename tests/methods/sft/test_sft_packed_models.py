"""Packed examples keep to themselves (issue 24) in a tiny Qwen2 from transformers and in the
built-in GPT: a block of three examples gives, token for token, the logits of each example run
alone (1e-5, fp32), and the loss of one example has a gradient of exactly 0 with respect to the
input embeddings of the others, in training mode. The Llama checks are in test_sft_data.py."""
from __future__ import annotations

import json

import pytest
import torch

from hputrain.data import packing
from hputrain.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

VOCAB, BLOCK, LENGTHS = 64, 16, (7, 5, 3)  # one block: the examples at 0..6, 7..11, 12..14


@pytest.fixture(scope="module")
def block():
    """The packed block (batch of one, pad id 3) and its examples' ids."""
    gen = torch.Generator().manual_seed(1)
    examples = []
    for n in LENGTHS:
        ids = torch.randint(4, VOCAB, (n,), generator=gen).tolist()
        examples.append({"input_ids": ids, "labels": ids})
    blocks, _ = packing.pack(examples, BLOCK, pad_token_id=3)
    assert len(blocks) == 1 and blocks[0]["seq_lens"][:4].tolist() == [*LENGTHS, 0]
    return {k: v[None] for k, v in blocks[0].items()}


def qwen2():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      attention_dropout=0.0, attn_implementation="sdpa")
    model = transformers.Qwen2ForCausalLM(config).train()  # as the Trainer runs it
    assert model.config.use_cache  # left at its default: the trap of issue 24
    return model


def gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=32)).train()


def logits_of(model, **inputs):
    out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out["logits"]


def starts():
    return [sum(LENGTHS[:k]) for k in range(len(LENGTHS))]


@pytest.mark.parametrize("build", [qwen2, gpt], ids=["qwen2", "gpt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool], ids=["additive", "boolean"])
def test_packed_logits_equal_each_example_alone(block, build, dtype):
    model = build()
    mask = packing.block_causal_mask(block["seq_lens"], dtype=dtype)
    with torch.no_grad():
        packed = logits_of(model, input_ids=block["input_ids"], position_ids=block["position_ids"],
                           attention_mask=mask)
        unmasked = logits_of(model, input_ids=block["input_ids"],
                             position_ids=block["position_ids"])
        for start, n in zip(starts(), LENGTHS):
            alone = logits_of(model, input_ids=block["input_ids"][:, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, atol=1e-5, rtol=0)
            if start:  # without the mask, the later examples see the earlier ones
                assert (unmasked[:, start:start + n] - alone).abs().max() > 1e-3


def embedding_module(model):
    return model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model.wte


@pytest.mark.parametrize("build", [qwen2, gpt], ids=["qwen2", "gpt"])
def test_no_gradient_crosses_examples(block, build):
    """The loss of the middle example (tokens 7..11) reaches its own embeddings only."""
    model = build()
    mask = packing.block_causal_mask(block["seq_lens"], dtype=torch.float32)
    embedded = []
    hook = embedding_module(model).register_forward_hook(lambda m, i, out: embedded.append(out))
    try:
        def middle_grad(**extra):
            embedded.clear()
            logits = logits_of(model, input_ids=block["input_ids"],
                               position_ids=block["position_ids"], **extra)
            targets = block["input_ids"][0, 8:12]  # tokens 7..10 predict 8..11
            loss = torch.nn.functional.cross_entropy(logits[0, 7:11], targets)
            return torch.autograd.grad(loss, embedded[0])[0][0]

        grad = middle_grad(attention_mask=mask)
        assert torch.count_nonzero(grad[:7]) == 0 and torch.count_nonzero(grad[12:]) == 0
        assert torch.count_nonzero(grad[7:11]) > 0
        assert torch.count_nonzero(middle_grad()[:7]) > 0  # the mask is what cut them off
    finally:
        hook.remove()


def test_the_trainer_trains_the_gpt_on_packed_blocks_as_on_each_example(tmp_path, block):
    """Through hputrain.Trainer (seq_lens -> block mask on the device, training/packed.py): the
    first step's loss on a packed block is the token mean of the examples' own losses. The GPT
    takes labels already shifted: a packed block's labels moved left by one, which puts -100 at
    each example's last token (pack labels each example's first token -100)."""
    from hputrain import Trainer, TrainingArguments

    shifted = dict(block)
    shifted["labels"] = torch.cat([block["labels"][:, 1:], torch.full((1, 1), -100)], dim=1)
    model = gpt()
    total, count = 0.0, 0
    with torch.no_grad():
        for start, n in zip(starts(), LENGTHS):
            ids = block["input_ids"][:, start:start + n]
            logits = model(ids[:, :-1])["logits"]
            loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum")
            total += loss.item()
            count += n - 1
    assert int((shifted["labels"] != -100).sum()) == count
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, logging_steps=1,
                             per_device_train_batch_size=1, precision="fp32", save_steps=0,
                             report_to="none", disable_tqdm=True, accelerator="cpu")
    Trainer(model, args, train_dataset=[{k: v[0] for k, v in shifted.items()}]).train()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    logged = [line for line in lines if '"loss"' in line]
    assert json.loads(logged[0])["loss"] == pytest.approx(total / count, abs=1e-5)


def _sliding(kind: str):
    """A tiny model whose sliding window (4 tokens) is shorter than the examples (7 and 5): Gemma 3
    (text) and GPT-OSS (eager: its attention sinks have no sdpa path) alternate sliding and full
    layers (layer_types), Mistral slides in every layer without types."""
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 sliding_window=4, attn_implementation="sdpa")
    if kind == "gemma3":
        config = transformers.Gemma3TextConfig(**small, head_dim=8,
                                               layer_types=["sliding_attention", "full_attention"])
        return transformers.Gemma3ForCausalLM(config).train()
    if kind == "gpt_oss":
        config = transformers.GptOssConfig(**(small | {"attn_implementation": "eager"}), head_dim=8,
                                           num_local_experts=4,
                                           num_experts_per_tok=2,
                                           layer_types=["sliding_attention", "full_attention"])
        return transformers.GptOssForCausalLM(config).train()
    return transformers.MistralForCausalLM(transformers.MistralConfig(**small)).train()


@pytest.mark.parametrize("kind", ["gemma3", "gpt_oss", "mistral"])
def test_sliding_layers_keep_their_window_in_a_longer_block(block, kind):
    """The Trainer's packed mask (training/packed.BlockMask) on a model with sliding layers: each
    example's logits are its own alone, where transformers builds the window itself; one plain
    block mask for every layer lets the sliding layers see past their window."""
    from hputrain.training.packed import BlockMask

    model = _sliding(kind)
    inputs = {"input_ids": block["input_ids"], "position_ids": block["position_ids"]}
    with torch.no_grad():
        packed = logits_of(model, **BlockMask.of(model.config)(dict(inputs), block["seq_lens"],
                                                               torch.float32))
        plain = logits_of(model, **inputs, attention_mask=packing.block_causal_mask(
            block["seq_lens"], dtype=torch.float32))
        for start, n in zip(starts(), LENGTHS):
            alone = logits_of(model, input_ids=block["input_ids"][:, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, atol=1e-5, rtol=0)
        first = logits_of(model, input_ids=block["input_ids"][:, :LENGTHS[0]])
        assert (plain[:, :LENGTHS[0]] - first).abs().max() > 1e-4
