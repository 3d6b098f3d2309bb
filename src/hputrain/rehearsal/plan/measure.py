"""The real step a plan is checked against (bench/plan_accuracy.py, tests/test_plan_accuracy.py):
a 3-step run of hputrain's Trainer (DPOTrainer for a DPO step) on the model a StepModel builds
(random weights) and batches of its shape, whose third step StepPeak counts (rehearsal/plan/tracking.py).
A packed step's blocks (rehearsal.plan.packed_step) carry their position_ids and seq_lens, as
the run's blocks do.

For DPO the pairs fill the block (a prompt of half the block, completions of the other half),
as the plan assumes; the reference is what the run would have: a frozen model built as the plan
builds it, the adapter-disabled policy under LoRA, or log-probs precomputed (by a frozen copy,
freed before training) under precompute_ref_log_probs.

For GRPO (GRPOTrainer) the prompts fill the largest bucket and the completions are fixed ones of
max_completion_length tokens with no end (GRPOTrainer's `complete` hook: no generation, so no
key/value cache, which the plan holds beside the step by its size); the rollout runs before the
step StepPeak counts, as in the run, and the reference (beta > 0) is held as the plan holds it.
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
    if step.grpo is not None:
        trainer = _grpo_trainer(step, args, model, peak)
    elif getattr(step.vision, "blocks", None) is not None:  # image blocks, the run's collator
        samples = step.vision.blocks.blocks(args.per_device_train_batch_size) * copies
        trainer = Trainer(model, args, train_dataset=samples, callbacks=[peak],
                          data_collator=step.vision.collator())  # it makes the inputs, as in the run
    elif step.preference is None:
        batch = step.batch(args.per_device_train_batch_size)  # packed blocks where the run packs
        samples = [{k: v[i] for k, v in batch.items() if isinstance(v, torch.Tensor)}
                   for i in range(args.per_device_train_batch_size)] * copies
        trainer = Trainer(model, args, train_dataset=samples, callbacks=[peak])
    else:
        trainer = _dpo_trainer(step, args, model, copies, peak)
    trainer.train()
    return peak.trace, trainer.group.is_main


def _dpo_trainer(step: StepModel, args, model, copies: int, peak):
    from ...methods.dpo.config import DPOConfig, preference_values
    from ...methods.dpo.trainer import DPOTrainer

    size, settings = args.per_device_train_batch_size, step.preference
    batch = step.batch(size)
    ids, width = batch["input_ids"].tolist(), batch["input_ids"].shape[1]
    half = width // 2
    pairs = [{"prompt_ids": ids[i][:half], "chosen_ids": ids[i][half:],
              "rejected_ids": ids[size + i][half:]} for i in range(size)] * copies
    if settings.precompute_ref_log_probs:  # a frozen copy computes them, then is freed
        reference = None if step.lora else step.build(False)
    else:
        reference = step.reference(step.lora) if step.reference else None
    config = DPOConfig(**dataclasses.asdict(args), **preference_values(settings),
                       max_length=width, ref_key="plan-measure")
    trainer = DPOTrainer(model, config, ref_model=reference, train_dataset=pairs,
                         callbacks=[peak])
    return trainer


def _grpo_trainer(step: StepModel, args, model, peak):
    from ...methods.grpo.trainer import GRPOTrainer
    from ...methods.grpo.plan import grpo_config

    config = grpo_config(step.grpo, args)
    bucket, length = max(config.prompt_buckets), config.max_completion_length
    vocab = model.get_output_embeddings().weight.shape[0]
    ranks = args.devices * args.num_nodes
    prompts = 4 * ranks * config.per_device_train_batch_size * config.gradient_accumulation_steps

    def complete(generation: int, prompt_ids: list[list[int]]) -> list[list[int]]:
        return [[1 + (7 * row + t) % (vocab - 1) for t in range(length)]  # never 0, the end
                for row in range(len(prompt_ids))]

    def alternate(prompts, completions, completion_ids, **columns):  # advantages not all 0
        return [float(i % 2) for i in range(len(prompts))]

    reference = step.reference(step.lora) if step.reference else None
    return GRPOTrainer(model, config, reward_funcs=[alternate],
                       train_dataset=[{"prompt": str(i)} for i in range(prompts)],
                       processing_class=_BucketTokenizer(bucket), ref_model=reference,
                       complete=complete, callbacks=[peak])


class _BucketTokenizer:
    """Every prompt as `bucket` tokens (the largest bucket, full, as the plan assumes), 0 the
    end and padding token."""

    eos_token_id = pad_token_id = 0

    def __init__(self, bucket: int) -> None:
        self.bucket = bucket

    def __call__(self, text: str) -> dict:
        return {"input_ids": [1 + (int(text) + t) % 97 for t in range(self.bucket)]}

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [" ".join(map(str, row)) for row in ids]
