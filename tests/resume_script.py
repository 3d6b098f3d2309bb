"""A training run used by test_resume.py, in-process and as a subprocess that gets killed."""
import sys
import time

import torch

from hputrain import Trainer, TrainingArguments
from hputrain.models.gpt import GPT, GPTConfig


def data(n=96, seq=16):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (n, seq + 1), generator=g)
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


class SlowAfter(GPT):
    """The same GPT, with a pause in forward after `slow_after` calls (so a test can kill it
    mid-run at a known place). The pause changes no number."""

    def __init__(self, config, slow_after=None):
        super().__init__(config)
        self.calls, self.slow_after = 0, slow_after

    def forward(self, *args, **kwargs):
        self.calls += 1
        if self.slow_after is not None and self.calls > self.slow_after:
            time.sleep(0.5)
        return super().forward(*args, **kwargs)


def main(output_dir, resume=None, slow_after=None, max_steps=16):
    torch.manual_seed(0)
    model = SlowAfter(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, dropout=0.1), slow_after)
    args = TrainingArguments(output_dir=output_dir, max_steps=max_steps, save_steps=8, logging_steps=1,
                             learning_rate=3e-3, per_device_train_batch_size=4, disable_tqdm=True,
                             resume_from_checkpoint=resume, throughput_warmup_steps=0)
    Trainer(model, args, train_dataset=data()).train()
    return model


if __name__ == "__main__":
    main(sys.argv[1], resume=None, slow_after=int(sys.argv[2]))
