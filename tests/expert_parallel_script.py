"""A tiny mixture-of-experts run for tests/kinds/moe/test_expert_parallel.py, started by `hputrain launch`
(expert parallelism over the ranks) or in-process as the single-process reference.

    expert_parallel_script.py OUTPUT_DIR PER_DEVICE_BATCH FAMILY [--ep N] [--strategy S]
        [--steps K] [--save-steps K] [--resume] [--final] [--accumulate K]
        [--capacity-factor F] [--checkpointing]

Global rank 0 writes OUTPUT_DIR/result.pt: {"grads": the whole gradients the optimizer's first
step applies, "weights": the whole weights after training, "losses": the logged losses,
"forwards_run_again": rank 0's count of forwards run again for an overflow}, each split expert
gathered from the expert-parallel group.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hputrain import Trainer, TrainingArguments  # noqa: E402
from hputrain.kinds.moe.expert_parallel import forwards_run_again  # noqa: E402
from hputrain.kinds.moe.experts.parallel import register  # noqa: E402
from tests.moe_fixtures import tiny_moe_config  # noqa: E402


def data(n=48, seq=16, vocab=300):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return [{"input_ids": t[:-1], "labels": t[1:]} for t in tokens]


def whole(model, strategy, tensors: dict) -> dict:
    """`tensors` (by parameter name) whole: a split expert's gathered over its group in rank
    order, a DTensor's gathered (a collective: every rank calls it)."""
    import torch.distributed as dist

    from hputrain.kinds.moe.expert_parallel import expert_parameter_names

    experts = set(expert_parameter_names(model)) if getattr(strategy, "layout", None) else set()
    out = {}
    for name, value in tensors.items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        if name in experts:
            group = strategy.layout.group
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts)
        out[name] = value.detach().clone()
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("batch", type=int)
    p.add_argument("family")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-steps", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--final", action="store_true", help="save_model into OUTPUT_DIR/final")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--checkpointing", action="store_true", help="gradient_checkpointing (recompute)")
    opts = p.parse_args(argv)
    import transformers

    register()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(opts.family),
                                                          dtype=torch.float32)
    args = TrainingArguments(output_dir=opts.output_dir, max_steps=opts.steps, learning_rate=1e-3,
                             logging_steps=1, per_device_train_batch_size=opts.batch,
                             save_steps=opts.save_steps, seed=0, disable_tqdm=True,
                             throughput_warmup_steps=0, accelerator="cpu", strategy=opts.strategy,
                             expert_parallel_size=opts.ep, ddp_timeout=60, report_to="none",
                             max_grad_norm=0.5, gradient_accumulation_steps=opts.accumulate,
                             expert_capacity_factor=opts.capacity_factor,
                             gradient_checkpointing=opts.checkpointing)
    trainer = Trainer(model, args, train_dataset=data())
    names = {id(param): name for name, param in model.named_parameters()}
    first = {}

    def keep_first_grads(optimizer, *_):
        if not first:
            first.update({names[id(param)]: param.grad.detach().clone() for group in optimizer.param_groups
                          for param in group["params"] if param.grad is not None})

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    hook = register_optimizer_step_pre_hook(keep_first_grads)
    trainer.train(resume_from_checkpoint="latest" if opts.resume else None)
    hook.remove()
    if opts.final:
        trainer.save_model(os.path.join(opts.output_dir, "final"))
    grads = whole(model, trainer.strategy, first)
    weights = whole(model, trainer.strategy, dict(model.named_parameters()))
    if trainer.group.is_main:
        records = [json.loads(line) for line in open(os.path.join(opts.output_dir, "metrics.jsonl"))]
        torch.save({"grads": grads, "weights": weights,
                    "losses": [r["loss"] for r in records if "loss" in r],
                    "forwards_run_again": forwards_run_again()},
                   os.path.join(opts.output_dir, "result.pt"))
    return model


if __name__ == "__main__":
    main()
