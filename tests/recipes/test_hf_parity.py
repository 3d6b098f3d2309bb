"""The Hugging Face ecosystem around hputrain's Trainer: per-step loss parity with transformers.Trainer
on the same model, seed, data and settings; TensorBoard event files that TensorBoard's own reader
loads. Each test is skipped, with the reason, when the package it needs is absent."""
import copy
import json
import random
from itertools import islice

import pytest
import torch

from hputrain import Trainer, TrainingArguments
from hputrain.data.batching import MicroBatches, TokenWindows
from hputrain.models.gpt import GPT, GPTConfig

SEED, STEPS, BATCH = 0, 20, 4
WORDS = ("the cat dog sat ran on under a mat log red blue big small and then it was very quiet loud "
         "house tree bird sang today").split()


def _hf():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (hputrain[hf])")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed (hputrain[hf])")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate, which is not installed")
    return transformers, datasets


def _tokenizer(transformers):
    """A word-level tokenizer built here (no download): ids for WORDS, [PAD] 0, [UNK] 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, **{word: i + 2 for i, word in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]",
                                                model_input_names=["input_ids", "attention_mask"])


def _text_dataset(datasets, tokenizer, rows: int = 96):
    """Runs of 3 to 16 words in WORDS' order (something to learn), from random starting words,
    tokenized: input_ids and attention_mask of different lengths."""
    rng = random.Random(SEED)
    runs = [(rng.randrange(len(WORDS)), rng.randint(3, 16)) for _ in range(rows)]
    texts = [" ".join(WORDS[(start + k) % len(WORDS)] for k in range(length)) for start, length in runs]
    return datasets.Dataset.from_dict({"text": texts}).map(
        lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])


def _gpt2(transformers, vocab_size: int):
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                     eos_token_id=None, pad_token_id=0)
    torch.manual_seed(SEED)
    return transformers.GPT2LMHeadModel(config)  # built from a config: no download


def _hputrain_order(num_rows: int) -> list[int]:
    """The row indices hputrain's Trainer trains on in its first STEPS steps, in order."""
    batches = MicroBatches(list(range(num_rows)), list, BATCH, seed=SEED).iterate()
    return [i for batch in islice(batches, STEPS) for i in batch]


def test_losses_match_the_hugging_face_trainer(tmp_path):
    transformers, datasets = _hf()
    tokenizer = _tokenizer(transformers)
    dataset = _text_dataset(datasets, tokenizer)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)  # pads; labels -100 on padding

    order = _hputrain_order(len(dataset))
    first = collator([dataset[i] for i in order[:BATCH]])
    padding = first["attention_mask"] == 0
    assert padding.any() and (first["labels"][padding] == -100).all()

    model = _gpt2(transformers, len(tokenizer))
    # Settings both trainers take; eps 1e-8 and torch's fused AdamW are hputrain's CPU defaults,
    # spelled out on both sides.
    same = dict(max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=5e-3, weight_decay=0.1,
                adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
                lr_scheduler_type="linear", warmup_steps=5, logging_steps=1, seed=SEED, disable_tqdm=True)

    ours = TrainingArguments(output_dir=str(tmp_path / "hputrain"), accelerator="cpu", save_steps=0, **same)
    Trainer(copy.deepcopy(model), ours, train_dataset=dataset, data_collator=collator).train()
    with open(tmp_path / "hputrain" / "metrics.jsonl") as f:
        hputrain_losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]

    class SameBatches(transformers.Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return order  # hputrain's shuffled order; the HF Trainer's own would differ

    theirs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), use_cpu=True, optim="adamw_torch_fused", save_strategy="no",
        eval_strategy="no", report_to="none", dataloader_num_workers=0, **same)
    hf = SameBatches(model=copy.deepcopy(model), args=theirs, train_dataset=dataset, data_collator=collator)
    # The model then takes the plain token mean, as it does under hputrain. Left to itself,
    # transformers 5.23's Trainer passes num_items_in_batch counted over the unshifted labels for
    # GPT2LMHeadModel (its class name maps to no loss_type, so the Trainer does not know the loss
    # shifts them): it divides by the predicted tokens plus one per row, and reports and trains on
    # a loss (n - rows) / n of the mean, 0.81x on the first batch here.
    hf.model_accepts_loss_kwargs = False
    hf.train()
    hf_losses = [r["loss"] for r in hf.state.log_history if "loss" in r]

    assert len(hputrain_losses) == len(hf_losses) == STEPS
    assert hputrain_losses[-1] < hputrain_losses[0] - 1.0  # it learned
    assert hputrain_losses == pytest.approx(hf_losses, abs=1e-4, rel=0)


def test_hf_collator_batches_train(tmp_path):
    transformers, datasets = _hf()
    tokenizer = _tokenizer(transformers)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)  # returns a BatchEncoding
    args = TrainingArguments(output_dir=str(tmp_path), accelerator="cpu", max_steps=2, logging_steps=1,
                             per_device_train_batch_size=BATCH, save_steps=0, disable_tqdm=True)
    dataset = _text_dataset(datasets, tokenizer)
    model = _gpt2(transformers, len(tokenizer))
    output = Trainer(model, args, train_dataset=dataset, data_collator=collator).train()
    assert output.global_step == 2 and output.training_loss > 0


def test_tensorboard_reads_the_logged_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (hputrain[tensorboard])")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, 256, (32 * 40 + 1,), generator=generator, dtype=torch.uint8)
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32))
    args = TrainingArguments(output_dir=str(tmp_path), accelerator="cpu", max_steps=6, logging_steps=2,
                             per_device_train_batch_size=4, save_steps=0, disable_tqdm=True)
    Trainer(model, args, train_dataset=TokenWindows(tokens, 32)).train()
    with open(tmp_path / "metrics.jsonl") as f:
        logged = {r["step"]: r for r in map(json.loads, f) if "loss" in r}

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "summary/train_tokens_per_second"} <= scalars
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [2, 4, 6] == sorted(logged)
    assert [e.value for e in loss] == pytest.approx([logged[s]["loss"] for s in (2, 4, 6)], rel=1e-6)
    assert [e.step for e in events.Scalars("summary/train_tokens_per_second")] == [6]
