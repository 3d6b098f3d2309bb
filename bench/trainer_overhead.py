"""Trainer overhead: the same model, data and settings through hputrain's Trainer and through a
hand-written PyTorch loop, interleaved, median step time after warm-up.

Step time is taken from inside the model (a forward pre-hook stamps each step's start), so start-up,
data set-up and the end of the run do not count.

    python bench/trainer_overhead.py [--steps 60] [--warmup 10] [--repeats 5] [--size tiny]
"""
from __future__ import annotations

import tempfile
import time

import torch

from hputrain import Trainer, TrainingArguments
from hputrain.accelerators import detect_accelerator
from hputrain.models.gpt import GPT, GPTConfig

from common import bf16_where_native, median_step, model_and_data, parser, print_table
from hputrain.training.optim import lr_lambda


def stamped_model(config: GPTConfig, stamps: list) -> GPT:
    torch.manual_seed(0)
    model = GPT(config)
    model.register_forward_pre_hook(lambda module, inputs: stamps.append(time.perf_counter()))
    return model


def hand_written(config, data, opts, device, synchronize) -> list[float]:
    stamps: list[float] = []
    model = stamped_model(config, stamps).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda("linear", 0, opts.steps))
    loader = torch.utils.data.DataLoader(data, batch_size=opts.batch, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0))
    batches = iter(loader)
    for step in range(1, opts.steps + 1):
        batch = {k: v.to(device) for k, v in next(batches).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=opts.bf16):
            loss = model(**batch)["loss"]
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f} grad_norm {norm.item():.3f}", end="\r")
    synchronize()
    stamps.append(time.perf_counter())
    return stamps


def with_trainer(config, data, opts, device, synchronize) -> list[float]:
    stamps: list[float] = []
    model = stamped_model(config, stamps)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=opts.steps, learning_rate=1e-3, weight_decay=0.1,
                                 logging_steps=10, save_steps=0, bf16=opts.bf16, disable_tqdm=True,
                                 per_device_train_batch_size=opts.batch, max_grad_norm=1.0)
        trainer = Trainer(model, args, train_dataset=data)
        trainer.train()
    stamps.append(time.perf_counter())  # train() synchronised before its summary
    return stamps


def main() -> None:
    p = parser(__doc__, steps=60, repeats=5)
    opts = p.parse_args()
    accelerator = detect_accelerator()
    opts.bf16 = bf16_where_native(accelerator, opts.bf16)
    device = accelerator.setup(0)
    config, data = model_and_data(opts)
    runs = {"hand-written loop": [], "hputrain Trainer": []}
    for _ in range(opts.repeats):  # interleaved, so drift in the machine hits both alike
        runs["hand-written loop"].append(median_step(
            hand_written(config, data, opts, device, accelerator.synchronize), opts.warmup))
        runs["hputrain Trainer"].append(median_step(
            with_trainer(config, data, opts, device, accelerator.synchronize), opts.warmup))
    print()
    print_table(accelerator, opts, runs, baseline="hand-written loop", column="loop")

if __name__ == "__main__":
    main()
