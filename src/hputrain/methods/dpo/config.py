"""Preference training's settings (DPO), by TRL's names: `PreferenceOptions` are the fields, which
the Hugging Face recipe's options take as flags (--beta, --loss-type ...), and `DPOConfig` is
TrainingArguments with them, the `args` of `hputrain.DPOTrainer` as TRL's DPOConfig is its
DPOTrainer's.

TRL's DPOConfig names that hputrain spells otherwise or does not take are one line each
(vocabulary.DPO_CONFIG): `max_length` is `--block-size` in the recipe, the many other loss types
are not here.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...config.arguments import TrainingArguments, _refuse_unknown_keywords
from ...config.fields import check, check_choice, fields_given, values_of

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
"""TRL's loss_type names hputrain computes, as TRL 1.16 does (robust and ipo included)."""

OTHER_LOSS_TYPES = {name: f"is not computed here (hputrain computes {', '.join(LOSS_TYPES)})"
                    for name in ("exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot",
                                 "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
                                 "sigmoid_norm")}
"""TRL 1.16's other loss types: one line each."""

DPO_DEFAULTS = {"learning_rate": 1e-6}
"""Where DPO's defaults differ from fine-tuning's, as TRL 1.16's DPOConfig sets them (5e-5 or
LoRA's 1e-4 usually make a full-weight policy collapse). TRL's other departures from
TrainingArguments hputrain either has already (logging_steps 10, max_length 1024, beta 0.1) or
leaves to the user (gradient_checkpointing, for SFT as for DPO)."""


@dataclass(kw_only=True)
class PreferenceOptions:
    """The DPO settings, checked by `check_preference` (called by the dataclasses that take them)."""

    beta: float = 0.1
    """How far the policy may move from the reference: the rewards are beta times the log-ratios."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo (per-token normalised, as TRL), hinge (SLiC), robust (rDPO)."""
    label_smoothing: float = 0.0
    """The chance a pair's preference is flipped: sigmoid becomes conservative DPO (cDPO, as
    TRL up to 0.2x and Optimum's GaudiDPOTrainer compute it), robust uses it as TRL 1.16 does."""
    max_prompt_length: int | None = None
    """Keep only a prompt's last tokens when prompt and completion exceed the block (TRL up to
    0.2x and Optimum's GaudiDPOTrainer); unset keeps the prompt and cuts from the end."""
    precompute_ref_log_probs: bool = False
    """Run the reference over the training and evaluation pairs once before training and cache
    its log-probs under output_dir/.cache, so no reference forward runs during training,
    evaluation, resume or a rerun (a frozen reference model is then freed)."""


def check_preference(options) -> None:
    check(options.beta > 0, f"beta must be positive, got {options.beta}")
    check_choice("loss_type", options.loss_type, LOSS_TYPES, OTHER_LOSS_TYPES)
    check(0 <= options.label_smoothing < 0.5,
          f"label_smoothing must be in [0, 0.5), got {options.label_smoothing}")
    check(options.label_smoothing == 0 or options.loss_type in ("sigmoid", "robust"),
          f"label_smoothing applies to loss_type sigmoid and robust, not {options.loss_type}")
    check(options.max_prompt_length is None or options.max_prompt_length >= 1,
          f"max_prompt_length must be at least 1, got {options.max_prompt_length}")


def preference_values(options) -> dict:
    """The PreferenceOptions fields of `options` (any dataclass that has them)."""
    return values_of(PreferenceOptions, options)


def preference_flags_given(options) -> list[str]:
    """The PreferenceOptions fields `options` sets away from their defaults (None: not set, where
    a field is shared with another method and defaults by method: the recipe's beta)."""
    return fields_given(PreferenceOptions, options, none_is_unset=True)


@_refuse_unknown_keywords
@dataclass(kw_only=True)
class DPOConfig(TrainingArguments, PreferenceOptions):
    """TrainingArguments with the DPO settings: `hputrain.DPOTrainer`'s args."""

    learning_rate: float = DPO_DEFAULTS["learning_rate"]
    """AdamW's initial learning rate: TRL's DPOConfig default (DPO_DEFAULTS)."""
    max_length: int | None = 1024
    """Tokens of prompt + completion kept from the start (TRL's keep_start; rows whose prompt
    alone fills it are left out, counted); None keeps everything."""
    ref_key: str | None = None
    """What identifies the reference for that cache (the recipe gives its folder); unset means a
    fingerprint of its weights."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_preference(self)
        check(self.max_length is None or self.max_length >= 2,
              f"max_length must be at least 2, got {self.max_length}")
