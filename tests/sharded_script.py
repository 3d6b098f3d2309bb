"""A sharded training run for tests/checkpoint/test_sharded_checkpoint.py, started through `hputrain
launch` on the CPU with Gloo: the built-in GPT with one `fully_shard` per block and one on the
root (FSDP2), checkpoints written as DCP shards. The global batch is 8 samples whatever the
number of processes. Arguments: OUTPUT_DIR MAX_STEPS [RESUME_FROM].

Until strategy="fsdp" exists in hputrain.distributed.strategies, the sharding strategy is made
here and handed to the Trainer in place of `select_strategy`."""
import os
import sys

import torch

from hputrain import Trainer, TrainingArguments
from hputrain.training import trainer
from hputrain.distributed.blocks import block_modules
from hputrain.distributed.strategies import Strategy
from hputrain.errors import InputError
from hputrain.models.gpt import GPT, GPTConfig

GLOBAL_BATCH, VOCAB = 8, 64


class FullyShard(Strategy):
    """FSDP2 on the default mesh of all processes: gradients reduce-scattered as the mean."""

    name = "fsdp"
    shards_state = True

    def wrap(self, model):
        from torch.distributed.fsdp import fully_shard

        for block in block_modules(model):
            fully_shard(block)
        fully_shard(model)
        return model


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, block_size=16, dropout=0.0))


def rows(n: int = 64) -> list[dict]:
    tokens = torch.randint(0, VOCAB, (n, 17), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


def main(output_dir: str, max_steps: int, resume: str | None = None) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        trainer.select_strategy = lambda *args, **kwargs: FullyShard()
    args = TrainingArguments(output_dir=output_dir, accelerator="cpu", max_steps=max_steps,
                             save_steps=4, logging_steps=1, learning_rate=1e-2, max_grad_norm=0.0,
                             per_device_train_batch_size=GLOBAL_BATCH // world, disable_tqdm=True,
                             report_to="none", throughput_warmup_steps=0,
                             resume_from_checkpoint=resume)
    Trainer(build(), args, train_dataset=rows()).train()


if __name__ == "__main__":
    try:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
    except InputError as exc:  # as the hputrain command line reports bad input
        print(f"hputrain: error: {exc}", file=sys.stderr)
        sys.exit(2)
