"""A small GPT run for the distributed tests, started by `hputrain launch`, by plain python (the
Trainer then launches itself, devices × num_nodes), or in-process as the single-process reference.

    dist_script.py OUTPUT_DIR PER_DEVICE_BATCH STRATEGY [--devices N] [--num-nodes M] [--kill-rank R --kill-step S]

A run stopped by SIGTERM / SIGINT exits 128 + the signal after the Trainer saved, without the
weights files; --step-sleep S slows each step, and each rank writes its pid to OUTPUT_DIR/pid-RANK.
"""
import argparse
import os
import signal
import sys
import time

import torch

from hputrain import Trainer, TrainingArguments
from hputrain.models.gpt import GPT, GPTConfig


def data(n=96, seq=16):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (n, seq + 1), generator=g)
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


class Model(GPT):
    """The GPT, which kills its own process at a given step on a given rank (first attempt only)."""

    def __init__(self, kill_rank=None, kill_step=None, step_sleep=0.0):
        super().__init__(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        self.calls, self.kill_rank, self.kill_step = 0, kill_rank, kill_step
        self.step_sleep = step_sleep

    def forward(self, *args, **kwargs):
        self.calls += 1
        if (self.kill_rank == int(os.environ.get("RANK", "0")) and self.calls == self.kill_step
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.step_sleep)
        return super().forward(*args, **kwargs)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("batch", type=int)
    p.add_argument("strategy")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-rank", type=int)
    p.add_argument("--kill-step", type=int)
    p.add_argument("--bf16-gradients", action="store_true")
    p.add_argument("--cp", type=int, default=1, help="context_parallel_size")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--step-sleep", type=float, default=0.0)
    opts = p.parse_args(argv)
    torch.manual_seed(0)
    model = Model(opts.kill_rank, opts.kill_step, opts.step_sleep)
    args = TrainingArguments(output_dir=opts.output_dir, max_steps=opts.steps, learning_rate=3e-3,
                             logging_steps=1, per_device_train_batch_size=opts.batch, save_steps=5,
                             disable_tqdm=True, throughput_warmup_steps=0, accelerator="cpu",
                             strategy=opts.strategy, devices=opts.devices, num_nodes=opts.num_nodes,
                             fast_ddp_bf16_gradients=opts.bf16_gradients, ddp_timeout=60,
                             context_parallel_size=opts.cp, bf16=opts.bf16,
                             resume_from_checkpoint="latest" if opts.resume else None)
    trainer = Trainer(model, args, train_dataset=data())
    with open(os.path.join(opts.output_dir, f"pid-{trainer.group.rank}"), "w") as f:
        f.write(str(os.getpid()))
    output = trainer.train()
    if output.interrupted_by is not None:
        sys.exit(128 + output.interrupted_by)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               os.path.join(opts.output_dir, f"weights-rank{trainer.group.rank}.pt"))
    return model


if __name__ == "__main__":
    main()
