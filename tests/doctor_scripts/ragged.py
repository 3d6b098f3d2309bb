"""A tiny Hugging Face Llama (tests/hf_fixtures.tiny_llama_config, nothing downloaded) trained on
ragged rows of 4 to 20 tokens, for `hputrain doctor`.

`python ragged.py buckets|longest`: the batches are padded by data.PadToBuckets to one of two
lengths, 16 or 32 (`buckets`: two shapes, each compiled once), or by default_collate to their
longest row (`longest`: a new length almost every batch, a new graph each time). The collator is
given explicitly, as a user would, so the script does not depend on the Trainer's default.
"""
import sys
from pathlib import Path

import torch

from hputrain import Trainer, TrainingArguments
from hputrain.data.batching import PadToBuckets, default_collate

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.hf_fixtures
from tests.hf_fixtures import tiny_llama_config  # noqa: E402

VOCAB, LONGEST = 64, 32


def model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(VOCAB, max_position_embeddings=LONGEST))


def rows(n=64, shortest=4, longest=20):
    """Causal LM rows: input_ids and labels alike (the model shifts them), lengths at random."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (n,), generator=g).tolist()
    out = []
    for length in lengths:
        ids = torch.randint(4, VOCAB, (length,), generator=g)  # 0-3 are the special tokens
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def collator(layout, config):
    if layout == "buckets":
        return PadToBuckets(config.pad_token_id, buckets=2, max_length=config.max_position_embeddings)
    return default_collate


def main(layout, **overrides):
    settings = dict(output_dir="doctor-should-not-write-here", max_steps=20, logging_steps=2,
                    per_device_train_batch_size=4, learning_rate=1e-3, save_steps=5,
                    throughput_warmup_steps=4)  # both bucket shapes have appeared by step 4
    llama = model()
    args = TrainingArguments(**(settings | overrides))
    return Trainer(llama, args, train_dataset=rows(),
                   data_collator=collator(layout, llama.config)).train()


if __name__ == "__main__":
    main(sys.argv[1])
