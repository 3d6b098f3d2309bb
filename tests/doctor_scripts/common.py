"""A small training script for `hputrain doctor`, a switch for each kind of problem (or "devices")."""
import sys

import torch

from hputrain import Trainer, TrainingArguments
from hputrain.models.gpt import GPT, GPTConfig


class Model(GPT):
    def __init__(self, problem):
        super().__init__(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64))
        self.problem = problem

    def forward(self, input_ids, labels=None):
        out = super().forward(input_ids, labels)
        if self.problem == "item":
            if out["loss"].item() > 100:  # a host read inside forward
                print("diverged")
        if self.problem == "fallback":
            # nonzero has a data-dependent shape: no graph can hold it
            out["loss"] = out["loss"] + 0 * torch.nonzero(input_ids > 128).shape[0]
        return out


def data(problem, n=64):
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        # ragged: rows of 8 to 63 tokens padded to the batch's longest, a new length almost every batch
        length = int(torch.randint(8, 64, (), generator=g)) if problem == "ragged" else 32
        ids = torch.randint(0, 256, (length + 1,), generator=g)
        rows.append({"input_ids": ids[:-1], "labels": ids[1:]})
    return rows


def main(problem):
    torch.manual_seed(0)
    args = TrainingArguments(output_dir="doctor-should-not-write-here", max_steps=50, logging_steps=2,
                             per_device_train_batch_size=4, learning_rate=1e-3, save_steps=5,
                             devices=2 if problem == "devices" else 1)  # devices: two processes
    trainer = Trainer(Model(problem), args, train_dataset=data(problem), eval_dataset=data("clean", 8))
    if problem != "swallow":
        trainer.train()
        return
    try:  # swallow: a script that carries on after any failure
        trainer.train()
    except Exception:
        print("training failed; carrying on", file=sys.stderr)
    print("the script kept running after the doctor's last step", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
