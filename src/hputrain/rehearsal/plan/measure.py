"""The real step a plan is checked against (bench/plan_accuracy.py, tests/rehearsal/plan/test_plan_accuracy.py):
a 3-step run of hputrain's Trainer on the model a StepModel builds (random weights) and batches of
its shape, whose third step StepPeak counts (rehearsal/plan/tracking.py). A packed step's blocks
(rehearsal.plan.packed_step) carry their position_ids and seq_lens, as the run's blocks do; an
image step's blocks go through the run's collator. A method's step brings its own trainer
(StepModel.trainer): DPOTrainer on pairs (methods/dpo/plan.py), GRPOTrainer on prompts with fixed
completions (methods/grpo/plan.py).
"""
from __future__ import annotations

import dataclasses

import torch

from . import StepModel
from .tracking import StepPeak, Trace


def measure_step(step: StepModel, args, output_dir: str) -> tuple[Trace, bool]:
    """(StepPeak's trace of the third step on this rank, whether this is the main rank). Every
    rank of a multi-process run calls it."""
    from ...training.trainer import Trainer

    args = dataclasses.replace(args, output_dir=output_dir, max_steps=3, save_steps=-1,
                               logging_steps=10, disable_tqdm=True, report_to="none",
                               eval_steps=0)
    torch.manual_seed(0)
    model = step.build(step.lora)
    peak = StepPeak(3)
    copies = 4 * args.devices * args.num_nodes  # every rank has batches for each step
    if step.trainer is not None:  # the method's own (DPO's, GRPO's: their plan.py)
        trainer = step.trainer(step, args, model, copies, peak)
    elif getattr(step.vision, "blocks", None) is not None:  # image blocks, the run's collator
        samples = step.vision.blocks.blocks(args.per_device_train_batch_size) * copies
        trainer = Trainer(model, args, train_dataset=samples, callbacks=[peak],
                          data_collator=step.vision.collator())  # it makes the inputs, as in the run
    else:
        batch = step.batch(args.per_device_train_batch_size)  # packed blocks where the run packs
        samples = [{k: v[i] for k, v in batch.items() if isinstance(v, torch.Tensor)}
                   for i in range(args.per_device_train_batch_size)] * copies
        trainer = Trainer(model, args, train_dataset=samples, callbacks=[peak])
    trainer.train()
    return peak.trace, trainer.group.is_main
