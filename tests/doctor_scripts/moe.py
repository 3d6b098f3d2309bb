"""A tiny mixture-of-experts model (a local folder, tests/moe_fixtures.py) trained with hputrain's
Trainer, for `hputrain doctor`.

`python moe.py FOLDER [EXPERTS]`: rows of 32 random tokens (one batch shape for the whole run), so
that what changes from step to step is only the routing: which tokens go to which expert. EXPERTS
is transformers' `experts_implementation` ("eager", "grouped_mm", "batched_mm", ...): given, the
Trainer keeps it (fused_kernels off); left out, the Trainer chooses (fused_kernels "auto").
"""
import sys

import torch
from transformers import AutoModelForCausalLM

from hputrain import Trainer, TrainingArguments


def rows(vocab, n=64, length=32):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(4, vocab, (n, length), generator=g)]


def main(folder, experts):
    torch.manual_seed(0)
    chosen = {} if experts is None else {"experts_implementation": experts}
    model = AutoModelForCausalLM.from_pretrained(folder, **chosen)
    args = TrainingArguments(output_dir="doctor-should-not-write-here", max_steps=20, logging_steps=2,
                             per_device_train_batch_size=2, learning_rate=1e-3, save_steps=5,
                             fused_kernels="auto" if experts is None else False)
    Trainer(model, args, train_dataset=rows(model.config.vocab_size)).train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
