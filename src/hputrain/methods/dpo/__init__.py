"""DPO on preference pairs (TRL 1.16's DPOTrainer's numbers): the method as the Hugging Face
recipe asks it (recipes/hf/methods.py), and its parts.

- config.py: DPOConfig and the DPO settings; data.py: pairs encoded; trainer.py: DPOTrainer and
  its objective; recipe.py: the run of `hputrain train --model`; plan.py: the step
  `hputrain plan` traces.
"""
from __future__ import annotations

from ...errors import InputError
from ...recipes.hf.methods import Method, is_preference, method_named
from .config import DPO_DEFAULTS, PreferenceOptions, check_preference


class DPO(Method):
    name = "dpo"
    label = "DPO"
    data_words = "preference pairs"
    flags = PreferenceOptions
    help_title = "DPO: preference pairs"
    defaults = DPO_DEFAULTS
    uses_reference = True
    trains_blocks = False

    def claims(self, columns, options) -> bool:
        return is_preference(columns)

    def check_data(self, options, columns, taken, found) -> None:
        if options.method == "dpo" and taken != "dpo":
            raise InputError(f"--method dpo needs preference rows ('chosen' and 'rejected', and "
                             f"'prompt'); --dataset {options.dataset} has: {found}")
        if options.method in ("lm", "sft") and taken == "dpo":
            raise InputError(f"--method {options.method}: --dataset {options.dataset} holds preference "
                             "pairs (chosen, rejected): train them with --method dpo (or auto)")

    def flags_given(self, options, taken) -> list[str]:
        reference = options.ref_model and not method_named(taken).uses_reference
        return super().flags_given(options, taken) + (["ref_model"] if reference else [])

    def check(self, options) -> None:
        check_preference(options)

    def references(self, options) -> bool:
        return True

    def train(self, options, training_args, accelerator_config, folder, policy) -> int:
        from .recipe import run_dpo

        return run_dpo(options, training_args, accelerator_config, folder, policy.model,
                       policy.tokenizer, policy.block_size, policy.reference, policy.ref_folder)

    def evaluate(self, options, *, batch_size: int, precision: str, split: str) -> dict:
        from .recipe import evaluate_pairs
        from ...recipes.hf.methods import resolved

        return evaluate_pairs(resolved(options, self), batch_size=batch_size, precision=precision,
                              split=split)

    def plan_step(self, options, step, reference):
        from .plan import dpo_step
        from ...recipes.hf.methods import resolved

        reference = None if options.precompute_ref_log_probs else reference
        return dpo_step(step, resolved(options, self), reference)
