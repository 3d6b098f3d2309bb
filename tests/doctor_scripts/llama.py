"""A tiny Hugging Face Llama (built from a config, nothing downloaded) trained for `hputrain doctor`.

`python llama.py fixed|bucketed|ragged|blocks`: rows of 6 to 32 tokens, batched by a collator
that pads every batch to 32 tokens (`fixed`), to its longest row (`ragged`: a new length almost
every batch), or, for rows of 6 to 18 tokens, to the next multiple of 16 (`bucketed`: 16 when
all four rows fit, else 32), as transformers' DataCollatorWithPadding does with
padding="max_length", "longest" and pad_to_multiple_of=16.
Padding is input 0, label -100, attention 0, so the batches carry no attention_mask unless
asked (`--mask`). `blocks` is run_clm's layout: text cut into 32-token blocks, each with an
attention_mask of ones.
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hputrain import Trainer, TrainingArguments

VOCAB, BLOCK = 64, 32


def model(positions=BLOCK):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         pad_token_id=0)
    return LlamaForCausalLM(config)


def rows(layout, n=64):
    g = torch.Generator().manual_seed(0)
    longest = 18 if layout == "bucketed" else BLOCK
    lengths = [BLOCK] * n if layout == "blocks" else torch.randint(6, longest + 1, (n,), generator=g).tolist()
    return [{"input_ids": torch.randint(1, VOCAB, (length,), generator=g)} for length in lengths]


def collator(layout, mask):
    def collate(samples):
        longest = max(len(s["input_ids"]) for s in samples)
        width = {"fixed": BLOCK, "blocks": BLOCK, "bucketed": -(-longest // 16) * 16}.get(layout, longest)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        attention = torch.zeros(len(samples), width, dtype=torch.long)
        for row, sample in enumerate(samples):
            ids[row, :len(sample["input_ids"])] = sample["input_ids"]
            attention[row, :len(sample["input_ids"])] = 1
        batch = {"input_ids": ids, "labels": ids.masked_fill(attention == 0, -100)}
        if mask:
            batch["attention_mask"] = attention
        return batch
    return collate


def main(layout, mask):
    args = TrainingArguments(output_dir="doctor-should-not-write-here", max_steps=20, logging_steps=2,
                             per_device_train_batch_size=4, learning_rate=1e-3, save_steps=5)
    Trainer(model(), args, train_dataset=rows(layout), data_collator=collator(layout, mask)).train()


if __name__ == "__main__":
    main(sys.argv[1], "--mask" in sys.argv[2:] or sys.argv[1] == "blocks")
