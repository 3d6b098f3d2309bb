"""Reward models on preference pairs (TRL 1.16's RewardTrainer's numbers): the method as the
Hugging Face recipe asks it (recipes/hf/methods.py), and its parts.

- config.py: RewardConfig and the settings; trainer.py: RewardTrainer and its objective, on DPO's
  pairs (methods/dpo: the one import between methods the contract names); recipe.py: the run of
  `hputrain train --model --method reward`, a sequence classifier loaded with its score head.
"""
from __future__ import annotations

from ...config.fields import ConfigError
from ...recipes.hf.methods import Method
from .config import REWARD_DEFAULTS, RewardFlags


class RewardModel(Method):
    name = "reward"
    label = "a reward model"
    data_words = "preference pairs, --method reward"
    flags = RewardFlags
    defaults = REWARD_DEFAULTS
    loads_model = True  # a sequence classifier with its score head
    trains_blocks = False

    def check_flags(self, options) -> None:
        coefficient = options.center_rewards_coefficient
        if coefficient is not None and (options.method != "reward" or coefficient < 0):
            raise ConfigError("--center-rewards-coefficient is for --method reward and must not be "
                              f"negative, got {coefficient} with --method {options.method}")

    def flags_given(self, options, taken) -> list[str]:
        return []  # --center-rewards-coefficient without --method reward: check_flags' line

    def run(self, options, training_args, accelerator_config, folder) -> int:
        from .recipe import run_reward

        return run_reward(options, training_args, accelerator_config, folder)
