"""`hputrain train --model DIR --dataset prompts.jsonl --reward-funcs FILE.py:NAME`: online RL
fine-tuning (GRPO, methods/grpo/trainer.py) of a local Hugging Face model on rows with a `prompt` (text,
or TRL's conversational form), every other column going to the reward functions.

Validation, as for SFT and DPO: the data set's own "validation" split, else the last
--validation-split-percentage of the prompts; each is evaluated as TRL's GRPOTrainer evaluates
(completions sampled and rewarded, eval_reward, eval_loss and the other metrics with "eval_").

The reference (only with --beta > 0): the adapter-disabled base under --lora-r, --ref-model DIR,
else a frozen copy of the starting weights. The output is what `hputrain train` writes for SFT
and DPO: final/ with the tokenizer, or the PEFT adapter; completions.jsonl holds what was
generated and how it was rewarded.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .config import GRPOConfig, grpo_values
from .rewards import COMPLETIONS_FILE
from ...errors import InputError
from ...recipes.hf import data as hf_data
from ...recipes.hf.common import held_out, model_line


def run_grpo(options, training_args, accelerator_config, folder: Path, model, tokenizer,
             ref_model, ref_folder: Path | None) -> int:
    """Train `model` (LoRA already added under --lora-r) with GRPO on --dataset's prompts."""
    from .trainer import GRPOTrainer
    from ...recipes.finish import train_and_finish
    from ...data.chat import use_chat_template

    use_chat_template(tokenizer, options.chat_template)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # prompts are left-padded
    rows, validation = load_prompts(options)
    values = {k: v for k, v in dataclasses.asdict(training_args).items()}
    config = GRPOConfig(**values, **grpo_values(options))
    trainer = GRPOTrainer(model, config, reward_funcs=options.reward_funcs, train_dataset=rows,
                          eval_dataset=validation, processing_class=tokenizer, ref_model=ref_model,
                          accelerator_config=accelerator_config)
    def header() -> str:
        return _header(options, model, trainer, len(rows), ref_folder) + _validation_line(options, validation)

    completions = Path(training_args.output_dir) / COMPLETIONS_FILE
    return train_and_finish(trainer, header, {"recipe": dataclasses.asdict(options), "method": "grpo"},
                            lambda final: f"completions and their rewards: {completions}")


def load_prompts(options) -> tuple[list[dict], list[dict] | None]:
    """(training rows, validation rows or None): the data set's own "validation" split, else
    the last --validation-split-percentage of the rows (at least one), as DPO holds pairs out."""
    path, percentage = options.dataset, options.validation_split_percentage
    rows = [row for _, row in hf_data.records(path, hf_data.TRAIN_SPLIT)]
    if not rows:
        raise InputError(f"--dataset {path} holds no prompt")
    if percentage > 0 and hf_data.VALIDATION_SPLIT in hf_data.saved_splits(path):
        held = [row for _, row in hf_data.records(path, hf_data.VALIDATION_SPLIT)]
    elif percentage > 0:
        count = held_out(len(rows), percentage, path, "prompt")
        rows, held = rows[:-count], rows[-count:]
    else:
        held = None
    return rows, held or None


def _validation_line(options, validation) -> str:
    if validation is None:
        return (hf_data.splits_line(options.dataset, False)
                + "hputrain: validation: none (--validation-split-percentage 0)\n")
    own = hf_data.VALIDATION_SPLIT in hf_data.saved_splits(options.dataset)
    where = ("the data set's own validation split" if own else
             f"the last {options.validation_split_percentage:g}% held out "
             "(--validation-split-percentage)")
    return (hf_data.splits_line(options.dataset)
            + f"hputrain: validation: {where}, {len(validation)} prompt(s)\n")


def _header(options, model, trainer, rows: int, ref_folder) -> str:
    objective, config = trainer.objective, trainer.args
    layout = objective.layout
    if config.beta == 0:
        reference = "none (beta 0)"
    elif ref_folder is not None:
        reference = f"--ref-model {ref_folder}"
    elif objective.adapters is not None:
        reference = "the base model with the LoRA adapters disabled"
    else:
        reference = "a frozen copy of the starting weights"
    weights = ", ".join(f"{n} x{w:g}" for n, w in zip(objective.reward_funcs.names,
                                                      objective.reward_funcs.weights.tolist()))
    longest = objective.longest_prompt
    left_out = (f"empty or longer than {longest} tokens, the model's positions less "
                f"--max-completion-length" if longest is not None else "empty")
    sampling = (f"temperature {config.temperature:g}" if config.temperature > 0 else
                "temperature 0: greedy, so a prompt's completions are alike and their advantages 0")
    return (f"{model_line(trainer, model, options)}\n"
            f"hputrain: method: GRPO on prompts, rewards: {weights}\n"
            f"hputrain: loss {config.loss_type}, beta {config.beta:g}, epsilon {config.epsilon:g}, "
            f"learning rate {config.learning_rate:g}; reference: {reference}\n"
            f"hputrain: {rows} rows, {len(objective.kept)} prompts, {objective.left_out} left out "
            f"({left_out})\n"
            f"hputrain: {config.num_generations} completions of {config.max_completion_length} "
            f"tokens per prompt; generation batch {layout.generation_rows} completions "
            f"({layout.prompts_per_generation} prompts) every {layout.micro_per_generation} "
            f"micro-batch(es); {sampling}\n" + _resume_line(config))


def _resume_line(config) -> str:
    """Which checkpoint the run resumes from, when it resumes (a "latest" with none yet: the
    trainer says it starts from the beginning)."""
    from ...checkpoint.saving import resolve_checkpoint

    if not config.resume_from_checkpoint:
        return ""
    try:
        folder = resolve_checkpoint(config.output_dir, config.resume_from_checkpoint)
    except InputError:  # the trainer says why, in one line
        return ""
    return f"hputrain: resuming from {folder.name} (--resume-from-checkpoint)\n"
