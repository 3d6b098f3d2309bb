"""Trains the regression model of test_trainer.py; run by test_rank0.py under torchrun."""
import sys

import torch

from hputrain import Trainer, TrainingArguments
from tests.test_trainer import Regression, regression_data


def main(output_dir, batch):
    model = Regression()
    args = TrainingArguments(output_dir=output_dir, max_steps=10, learning_rate=1e-2, logging_steps=2,
                             per_device_train_batch_size=batch, disable_tqdm=True, save_steps=5,
                             throughput_warmup_steps=0, accelerator="cpu")
    trainer = Trainer(model, args, train_dataset=regression_data(), eval_dataset=regression_data(20))
    trainer.train()
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               f"{output_dir}/weights-rank{trainer.group.rank}.pt")
    return model


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
