"""The DPO step for `hputrain plan` (plan.py): the step a run on preference pairs takes
(methods/dpo/trainer.py), not a causal-LM step of the same model.

What changes against the causal-LM step, as DPOTrainer runs it:

- the rows: a micro-batch of N pairs is one forward of 2N rows (each pair's chosen sequence,
  then its rejected one), block-size wide (the longest a bucket gets: the peak);
- the reference: a no-grad forward of a frozen model before the policy's (after it, under fsdp
  with LoRA), whose weights are held all along: a frozen copy of the starting weights, or
  --ref-model's (plan.py places it as DPOTrainer does: the run's precision, bf16 storage under
  bf16, sharded like the policy under fsdp); under LoRA without --ref-model, the policy with its
  adapters disabled (no second model); with --precompute-ref-log-probs, none at all (the
  batch carries the log-probs, and the frozen model is freed before training);
- the loss: methods/dpo/trainer.py's own PreferenceObjective (completion log-probs in float32 over the
  vocabulary, TRL's loss), called on the module as the Trainer calls it.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import torch

from .config import DPOConfig, preference_values
from .trainer import DPOTrainer, PreferenceObjective
from ...rehearsal.plan import StepModel, call_model


def dpo_step(base: StepModel, preference, reference_model: Callable[[], torch.nn.Module] | None
             = None) -> StepModel:
    """`base` (a causal-LM step of the model) as a DPO step. `preference`: the DPO settings (beta,
    loss_type, label_smoothing, precompute_ref_log_probs: any object that has them);
    `reference_model()` builds --ref-model's architecture (None: no --ref-model)."""
    precomputed = bool(preference.precompute_ref_log_probs)
    config = types.SimpleNamespace(beta=preference.beta, loss_type=preference.loss_type,
                                   label_smoothing=preference.label_smoothing)

    def reference(lora: bool):
        if precomputed:
            return None
        if reference_model is not None:
            return reference_model()
        return None if lora else base.build(False)  # the starting weights, frozen

    def batch(size: int) -> dict:
        ids = base.batch(2 * size)["input_ids"]  # chosen rows, then rejected rows
        completion = torch.zeros_like(ids)
        completion[:, ids.shape[1] // 2:] = 1  # the prompt, then the completion
        rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "completion_mask": completion}
        if precomputed:
            rows["ref_logps"] = torch.zeros(ids.shape[0])
        return rows

    def objective(frozen, model, sharded: bool, args):
        adapters = (model if frozen is None and not precomputed
                    and hasattr(model, "disable_adapter") else None)
        objective = PreferenceObjective(config, adapters=adapters)
        objective.reference = frozen  # placed by the plan already
        objective.loop = types.SimpleNamespace(sharded=sharded, call_model=call_model)
        return objective.compute_loss

    reference_name = ("reference log-probs precomputed" if precomputed
                      else "reference: --ref-model" if reference_model is not None
                      else "reference: the adapter-disabled base" if base.lora
                      else "reference: a frozen copy of the starting weights")
    return dataclasses.replace(base, batch=batch, reference=reference, objective=objective,
                               preference=preference, trainer=_measured_trainer,
                               name=f"{base.name}, DPO on pairs ({reference_name})")


def _measured_trainer(step: StepModel, args, model, copies: int, peak) -> DPOTrainer:
    """The DPOTrainer a DPO step is measured with (rehearsal/plan/measure.py, StepModel.trainer):
    the pairs fill the block (a prompt of half the block, completions of the other half), as the
    plan assumes; the reference is what the run would have: a frozen model built as the plan
    builds it, the adapter-disabled policy under LoRA, or log-probs precomputed (by a frozen
    copy, freed before training) under precompute_ref_log_probs."""
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
    return DPOTrainer(model, config, ref_model=reference, train_dataset=pairs, callbacks=[peak])


