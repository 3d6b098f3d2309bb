"""GRPO on prompts, rewarded by functions or reward models (TRL 1.16's GRPOTrainer's numbers): the
method as the Hugging Face recipe asks it (recipes/hf/methods.py), and its parts.

- config.py: GRPOConfig and the GRPO settings; rollout.py, trainer.py, loss.py, rewards.py,
  evaluation.py: generation, the objective, the rewards, evaluation; recipe.py: the run of
  `hputrain train --model`; plan.py and doctor.py: what `hputrain plan` traces and the doctor
  says of its rollouts.
"""
from __future__ import annotations

from ...errors import InputError
from ...recipes.hf.methods import Method, is_prompts
from .config import GRPO_DEFAULTS, GRPOFlags, check_grpo


class GRPO(Method):
    name = "grpo"
    label = "GRPO"
    data_words = "prompts with --reward-funcs"
    flags = GRPOFlags
    help_title = "GRPO: prompts rewarded by --reward-funcs"
    defaults = GRPO_DEFAULTS
    uses_reference = True
    trains_blocks = False

    def claims(self, columns, options) -> bool:
        return is_prompts(columns) and bool(options.reward_funcs or options.method == "grpo")

    def check_data(self, options, columns, taken, found) -> None:
        if options.method == "grpo" and taken != "grpo":
            raise InputError(f"--method grpo needs rows with a 'prompt' and no completion (the model "
                             f"writes it); --dataset {options.dataset} has: {found}")
        if taken == "grpo" and options.streaming:
            raise InputError("--streaming trains causal LM and SFT rows; GRPO reads its prompts "
                             "whole: leave out --streaming")
        if taken == "grpo" and not options.reward_funcs:
            raise InputError("GRPO needs --reward-funcs FILE.py:NAME [...] (functions with TRL's "
                             "signature) or a reward-model folder")
        if (options.method == "auto" and is_prompts(columns) and not options.reward_funcs
                and options.text_column not in columns):  # prompts alone: GRPO's, without its rewards
            raise InputError(f"--dataset {options.dataset} holds prompts without completions ({found}): "
                             "GRPO trains on them with --reward-funcs FILE.py:NAME [...] or a "
                             "reward-model folder; SFT needs a 'completion' beside each 'prompt'")
        if taken == "lm_or_sft" and options.reward_funcs:
            raise InputError(f"--reward-funcs trains with GRPO on rows with a 'prompt' and no "
                             f"completion; --dataset {options.dataset} has: {found}")

    def flag_refusal(self, flag, options, taken) -> str:
        return (f"--{flag} is for prompts rewarded by --reward-funcs (GRPO), and --dataset "
                f"{options.dataset} holds " + ("preference pairs" if taken == "dpo" else
                                               "no prompt-only rows"))

    def check(self, options) -> None:
        check_grpo(options)

    def references(self, options) -> bool:
        return options.beta > 0  # a reference only for the KL penalty

    def train(self, options, training_args, accelerator_config, folder, policy) -> int:
        from .recipe import run_grpo

        return run_grpo(options, training_args, accelerator_config, folder, policy.model,
                        policy.tokenizer, policy.reference.pop(), policy.ref_folder)

    def plan_step(self, options, step, reference):
        from .plan import grpo_step
        from ...recipes.hf.methods import resolved

        options = resolved(options, self)
        return grpo_step(step, options, reference if options.beta > 0 else None)
