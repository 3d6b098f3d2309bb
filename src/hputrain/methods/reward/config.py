"""Reward-model training's settings, by TRL 1.16's names and defaults: `RewardOptions` are the
fields, `RewardConfig` is TrainingArguments with them, the `args` of hputrain's RewardTrainer as
TRL's RewardConfig is its RewardTrainer's. TRL's names it does not take are one line each
(vocabulary.REWARD_CONFIG)."""
from __future__ import annotations

from dataclasses import dataclass

from ...config.arguments import TrainingArguments, _refuse_unknown_keywords
from ...config.fields import check, fields_given, values_of

REWARD_DEFAULTS = {"learning_rate": 1e-4}
"""Where reward-model training's defaults differ from fine-tuning's, as TRL 1.16's RewardConfig
sets them."""


@dataclass(kw_only=True)
class RewardFlags:
    """The reward-model settings `hputrain train --model --method reward` takes as flags."""

    center_rewards_coefficient: float | None = None
    """Add this times the squared sum of each pair's two rewards to the loss, which keeps the
    rewards centred on 0 (0.01 in the paper that proposed it); unset adds nothing."""


@dataclass(kw_only=True)
class RewardOptions(RewardFlags):
    """The reward-model settings, checked by `check_reward`."""

    disable_dropout: bool = True
    """Switch dropout off in the model, so that both sequences of a pair are scored alike."""


def check_reward(options) -> None:
    """Each reward-model setting valid (one line otherwise)."""
    check(options.center_rewards_coefficient is None or options.center_rewards_coefficient >= 0,
          f"center_rewards_coefficient must not be negative, got {options.center_rewards_coefficient}")


def reward_values(options) -> dict:
    """The RewardOptions fields of `options` (any dataclass that has them)."""
    return values_of(RewardOptions, options)


def reward_flags_given(options) -> list[str]:
    """The RewardOptions fields `options` sets away from their defaults."""
    return fields_given(RewardOptions, options)


@_refuse_unknown_keywords
@dataclass(kw_only=True)
class RewardConfig(TrainingArguments, RewardOptions):
    """TrainingArguments with the reward-model settings: the reward trainer's args."""

    learning_rate: float = REWARD_DEFAULTS["learning_rate"]
    """AdamW's initial learning rate: TRL's RewardConfig default (REWARD_DEFAULTS)."""
    max_length: int | None = 1024
    """Tokens of prompt + completion at most: pairs whose chosen or rejected sequence is longer
    are left out (counted), as TRL does; None keeps every pair."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_reward(self)
        check(self.max_length is None or self.max_length >= 1,
              f"max_length must be at least 1, got {self.max_length}")
