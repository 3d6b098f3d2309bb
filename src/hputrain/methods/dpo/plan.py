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

from .trainer import PreferenceObjective
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
                               preference=preference,
                               name=f"{base.name}, DPO on pairs ({reference_name})")


