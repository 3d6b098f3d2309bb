"""The GRPO step for `hputrain plan` (plan.py): what a run of GRPO on prompts holds on a device
(methods/grpo/trainer.py), not a causal-LM step of the same model.

What changes against the causal-LM step, as GRPOTrainer runs it:

- the generation's key/value cache: the static generator (execution/generation.py) keeps one
  per (rows, prompt bucket) from the first rollout to the end of the run, so it is held through
  every training step. Planned for the largest bucket: this rank's rows of a generation batch
  (per_device_train_batch_size x steps_per_generation) x (largest prompt bucket +
  max_completion_length) x layers x 2 (keys and values) x kv heads x head dim, in the forward's
  compute dtype (the cache is written by the autocast forward, whose keys are in that dtype).
  Its shapes are the generator's own (KeyValueBuffers.allocate), on the meta device. Beside it
  the generator's mask of valid key columns (rows x length booleans, counted as temporary);
- the reference (beta > 0 only): its weights are held all along (a frozen copy of the starting
  weights, or --ref-model's, placed as the Trainer places it); under LoRA none (the policy with
  its adapters disabled). Its forward runs in the rollout, before the step: the step reads its
  log-probs from the batch;
- the training step: [rows, largest bucket + max_completion_length] tokens, log-probs (and
  entropies) taken on the completion positions only, in chunks (training/logps.py), by
  GRPOObjective's own compute_loss, with the old policy's log-probs in the batch when the
  generation batch outlives one step (num_iterations > 1, or more micro-batches per generation
  than per step), as the run has them.

The rollout's own peak (prefill at the generation batch's rows with no gradient, the decode
steps' one-position logits) is below the training step's for the models the plan is for: the
plan's peak is the training step's, with the cache held beside it.
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import torch

from .config import GRPOConfig, generation_layout, grpo_values
from ...data.batching import base_model
from ...execution.generation import KeyValueBuffers
from .trainer import GRPOObjective, GRPOTrainer
from .rollout import Layout
from ...rehearsal.plan import StepModel, call_model

KV_CACHE = "kv_cache"
"""The plan's category for the generation's key/value cache (GRPO's steps only)."""


def grpo_step(base: StepModel, options, reference_model: Callable[[], torch.nn.Module] | None
              = None) -> StepModel:
    """`base` (a causal-LM step of the model) as a GRPO step. `options`: the GRPO settings (the
    fields of config.grpo.GRPOOptions, method defaults resolved); `reference_model()` builds
    --ref-model's architecture (None: no --ref-model)."""
    settings = grpo_values(options)
    completion = settings["max_completion_length"]
    bucket = max(settings["prompt_buckets"])
    referenced = settings["beta"] > 0

    def reference(lora: bool):
        if not referenced:
            return None
        if reference_model is not None:
            return reference_model()
        return None if lora else base.build(False)  # the starting weights, frozen

    def batch(size: int) -> dict:
        width = bucket + completion
        tokens = base.batch(size)["input_ids"]  # the model's own ids, repeated to the width
        ids = tokens.repeat(1, -(-width // tokens.shape[1]))[:, :width].clone()  # own storage
        rows = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "completion_mask": torch.ones(size, completion, dtype=torch.int32),
                "advantages": torch.zeros(size), "num_items": torch.tensor(float(size * completion))}
        if referenced:  # the reference's log-probs, computed in the rollout
            rows["ref_logps"] = torch.zeros(size, completion)
        return rows

    def objective(frozen, model, sharded: bool, args):
        grpo = _objective(settings, args)
        layout = grpo.layout
        if layout.accumulate % layout.micro_per_generation == 0:
            return grpo.compute_loss

        def with_old_logps(module, rows: dict):  # the old policy's, computed in the rollout
            old = torch.zeros(rows["completion_mask"].shape)
            return grpo.compute_loss(module, {**rows, "old_logps": old})

        return with_old_logps

    def held(model, args, precision) -> dict[str, int]:
        layout = _layout(settings, args)
        rows = layout.rows * layout.steps_per_generation
        return kv_cache_bytes(model, rows, bucket + completion, precision.compute_dtype)

    reference_name = ("no reference (beta 0)" if not referenced
                      else "reference: --ref-model" if reference_model is not None
                      else "reference: the adapter-disabled base" if base.lora
                      else "reference: a frozen copy of the starting weights")
    return dataclasses.replace(
        base, batch=batch, reference=reference, objective=objective, held=held, grpo=settings,
        trainer=_measured_trainer,
        name=f"{base.name.partition(', blocks of ')[0]}, GRPO on prompts of up to {bucket} tokens with {completion}-token "
             f"completions ({reference_name})")


def kv_cache_bytes(model, rows: int, length: int, dtype: torch.dtype) -> dict[str, int]:
    """{kv_cache: the generator's key/value buffers, temporary: its valid-column mask} in bytes
    for `rows` sequences of `length` positions of `model` (made on the meta device by the
    generator's own KeyValueBuffers: nothing allocated)."""
    buffers = KeyValueBuffers(length)
    buffers.allocate(base_model(model).config, rows, dtype, torch.device("meta"))
    cache = sum(b.numel() * b.element_size() for b in buffers.buffers())
    return {KV_CACHE: cache, "temporary": rows * length * torch.bool.itemsize}


def grpo_config(settings: dict, args) -> GRPOConfig:
    """The GRPOConfig of the run: its TrainingArguments with the GRPO settings."""
    return GRPOConfig(**dataclasses.asdict(args), **settings)


def _layout(settings: dict, args) -> Layout:
    """The run's Layout, as GRPOObjective.bind makes it (one line when the sizes disagree)."""
    config = grpo_config(settings, args)
    ranks = args.devices * args.num_nodes
    _, steps = generation_layout(config, config.per_device_train_batch_size,
                                 config.gradient_accumulation_steps, ranks)
    return Layout(config.per_device_train_batch_size, config.gradient_accumulation_steps, ranks,
                  0, config.num_generations, steps, config.num_iterations)


class _OnePromptToken:
    """The tokenizer GRPOObjective is built with in a plan: the plan reads no prompt (the batch
    fills the largest bucket), so one token stands for the one placeholder prompt."""

    eos_token_id = pad_token_id = 0

    def __call__(self, text: str) -> dict:
        return {"input_ids": [0]}


def _objective(settings: dict, args) -> GRPOObjective:
    """GRPOObjective as the run makes it, with what bind() would give its loss (the layout, how
    to call the model); no generator: the plan holds its cache by size (kv_cache_bytes)."""
    objective = GRPOObjective(grpo_config(settings, args), (), [{"prompt": "."}],
                              _OnePromptToken())
    objective.layout = _layout(settings, args)
    objective.loop = types.SimpleNamespace(call_model=call_model)
    return objective


def _measured_trainer(step: StepModel, args, model, copies: int, peak) -> GRPOTrainer:
    """The GRPOTrainer a GRPO step is measured with (rehearsal/plan/measure.py, StepModel.trainer;
    `copies` unused: its prompts are counted here): the prompts fill the largest bucket and the
    completions are fixed ones of max_completion_length tokens with no end (GRPOTrainer's
    `complete` hook: no generation, so no key/value cache, which the plan holds beside the step by
    its size); the rollout runs before the step StepPeak counts, as in the run, and the reference
    (beta > 0) is held as the plan holds it."""
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
