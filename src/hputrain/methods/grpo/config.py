"""Online training's settings (GRPO), by TRL 1.16's names and defaults.

`GRPOOptions` are GRPO's fields and `GRPOConfig` is TrainingArguments with them, the `args` of
hputrain's GRPO trainer as TRL's GRPOConfig is its GRPOTrainer's (a reward model's are
methods/reward/config.py's). They are kept apart from PreferenceOptions (DPO): both TRL configs
have a `beta` and a `loss_type`, with other defaults and other meanings.

TRL's names that hputrain spells otherwise or does not take are one line each
(vocabulary.GRPO_CONFIG, vocabulary.REWARD_CONFIG): vLLM is not used, since completions come from
hputrain's own engine, whose shapes never change after warm-up (prompt_buckets, a fixed
max_completion_length).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...config.arguments import TrainingArguments, _refuse_unknown_keywords
from ...config.fields import check, check_choice, fields_given, values_of

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
"""TRL's GRPO loss_type names hputrain computes: four ways to average the same clipped per-token
objective (over the tokens of the global batch, of each completion, of the micro-batch, or over
a constant)."""

OTHER_LOSS_TYPES = {name: f"is not computed here (hputrain computes {', '.join(LOSS_TYPES)})"
                    for name in ("cispo", "sapo", "luspo", "vespo")}
"""TRL 1.16's other loss types: one line each."""

SCALE_REWARDS = ("group", "batch", "none")
"""How advantages are scaled: by the reward's standard deviation in each prompt's group, in the
whole generation batch, or not at all."""

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")

AGGREGATIONS = ("sum_then_normalize",)
"""multi_objective_aggregation's values hputrain computes."""

OTHER_AGGREGATIONS = {"normalize_then_sum": "is not computed here: the weighted rewards are "
                                            "summed, then scaled (sum_then_normalize)"}

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512)
"""The prompt lengths (tokens) a prompt is left-padded to, the nearest that holds it."""

GRPO_DEFAULTS = {"learning_rate": 1e-6, "remove_unused_columns": False}
"""Where GRPO's defaults differ from fine-tuning's, as TRL 1.16's GRPOConfig sets them: a small
learning rate, and every data set column kept, since reward functions get them as keyword
arguments. TRL's other departures from TrainingArguments hputrain has already (logging_steps 10)
or leaves to the user (gradient_checkpointing, bf16: the recipe's precision is auto)."""

@dataclass(kw_only=True)
class GRPOOptions:
    """The GRPO settings, checked by `check_grpo` (called by the dataclasses that take them)."""

    num_generations: int = 8
    """Completions sampled per prompt, the group whose rewards make each one's advantage
    (at least 2). The generation batch must hold whole groups."""
    num_generations_eval: int | None = None
    """Completions sampled per validation prompt when evaluating (fewer saves time); unset
    means num_generations."""
    max_completion_length: int = 512
    """Tokens generated per completion: every completion is decoded to this length (a static KV
    cache, one graph for the decode step), then cut after its end of sequence."""
    temperature: float = 1.0
    """Sampling temperature; higher gives more varied completions, and the log-probs are taken at
    it, as TRL takes them. 0 decodes greedily, the log-probs then the model's own (temperature
    1): every completion of a prompt is then alike, so there is no advantage to learn from."""
    top_p: float = 1.0
    """Nucleus sampling: keep the fewest most likely tokens whose probabilities reach this sum,
    in (0, 1]; 1 keeps all."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    min_p: float | None = None
    """Keep only tokens at least this fraction of the most likely one's probability, in [0, 1];
    unset keeps all."""
    repetition_penalty: float = 1.0
    """Divide the logits of tokens already in the prompt or completion by this (above 1 repeats
    less); 1 changes nothing."""
    beta: float = 0.0
    """The weight of the KL divergence from the reference; 0 needs no reference model (nor its
    forward), as TRL's default."""
    epsilon: float = 0.2
    """The clip range of the probability ratio: [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: float | None = None
    """The upper clip (DAPO's clip-higher, 0.28 in its paper); unset means epsilon."""
    delta: float | None = None
    """Two-sided clipping (INTELLECT-2): the ratio is also capped at delta (above 1 + epsilon,
    as its authors advise); unset leaves it uncapped."""
    num_iterations: int = 1
    """Optimizer passes over each generation batch (mu in the GRPO paper); more than 1 uses the
    log-probs at generation time as the old policy's."""
    steps_per_generation: int | None = None
    """Optimizer micro-steps each generation batch feeds; unset means gradient_accumulation_steps
    (or what generation_batch_size implies). Not with generation_batch_size."""
    generation_batch_size: int | None = None
    """Completions generated at once, across all ranks; unset means per_device_train_batch_size x
    ranks x steps_per_generation. Not with steps_per_generation."""
    loss_type: str = "dapo"
    """dapo (tokens of the global batch), grpo (each completion's mean), bnpo (tokens of the
    micro-batch) or dr_grpo (a constant, max_completion_length)."""
    scale_rewards: str = "group"
    """Divide advantages by the rewards' standard deviation in each group (group), in the whole
    generation batch (batch), or not (none; Dr. GRPO); TRL's True and False mean group and none."""
    mask_truncated_completions: bool = False
    """Leave completions without an end of sequence out of the loss (DAPO)."""
    importance_sampling_level: str = "token"
    """Probability ratios per token, or one per completion from its mean log-ratio (sequence;
    GSPO, which pairs it with loss_type grpo)."""
    reward_weights: list[float] | None = None
    """One weight per reward function, in their order; unset weighs each 1."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """How several rewards make one: summed with their weights, then scaled (TRL's default;
    normalize_then_sum is not computed here)."""
    use_bias_correction_kl: bool = True
    """Multiply the KL term by the probability ratio, which makes its gradient the unbiased
    reverse-KL one (DeepSeek-V3.2), when beta is above 0."""
    disable_dropout: bool = False
    """Switch dropout off in the policy (and reference), so that log-probs of the same tokens
    agree between generation, reference and training."""
    prompt_buckets: list[int] | tuple[int, ...] = PROMPT_BUCKETS
    """hputrain's own: the prompt lengths a prompt is left-padded to (the nearest that holds it),
    so generation and training see a few fixed shapes, which lazy mode and graphs compile once
    each, instead of one per prompt length. A longer prompt is kept whole, as TRL keeps it, and
    padded to the next multiple of the largest; only one that the model's positions cannot hold
    beside max_completion_length tokens is left out (counted in the header)."""


def check_grpo(options) -> None:
    """Each GRPO setting valid (one line otherwise); TRL's older spellings (scale_rewards=True)
    and values read as text (flags) are put in their current form."""
    check(options.num_generations >= 2, "num_generations must be at least 2 (an advantage compares "
          f"completions of the same prompt), got {options.num_generations}")
    check(options.num_generations_eval is None or options.num_generations_eval >= 1,
          f"num_generations_eval must be at least 1, got {options.num_generations_eval}")
    check(isinstance(options.max_completion_length, int) and options.max_completion_length >= 1,
          "max_completion_length must be a whole number of at least 1 (completions have a fixed "
          f"length here), got {options.max_completion_length!r}")
    check(options.temperature >= 0, f"temperature must not be negative, got {options.temperature}")
    check(0 < options.top_p <= 1, f"top_p must be in (0, 1], got {options.top_p}")
    check(options.top_k >= 0, f"top_k must not be negative (0 keeps all tokens), got {options.top_k}")
    check(options.min_p is None or 0 <= options.min_p <= 1,
          f"min_p must be in [0, 1], got {options.min_p}")
    check(options.repetition_penalty > 0,
          f"repetition_penalty must be positive, got {options.repetition_penalty}")
    check(options.beta >= 0, f"beta must not be negative, got {options.beta}")
    check(options.epsilon > 0, f"epsilon must be positive, got {options.epsilon}")
    check(options.epsilon_high is None or options.epsilon_high > 0,
          f"epsilon_high must be positive, got {options.epsilon_high}")
    check(options.delta is None or options.delta > 1,
          f"delta caps the probability ratio, so it must be above 1, got {options.delta}")
    check(options.num_iterations >= 1, f"num_iterations must be at least 1, got {options.num_iterations}")
    _check_generation_sizes(options)
    check_choice("loss_type", options.loss_type, LOSS_TYPES, OTHER_LOSS_TYPES)
    options.scale_rewards = _scale_rewards(options.scale_rewards)
    check_choice("scale_rewards", options.scale_rewards, SCALE_REWARDS)
    check_choice("importance_sampling_level", options.importance_sampling_level,
                 IMPORTANCE_SAMPLING_LEVELS)
    check_choice("multi_objective_aggregation", options.multi_objective_aggregation, AGGREGATIONS,
                 OTHER_AGGREGATIONS)
    options.reward_weights = _reward_weights(options.reward_weights)
    options.prompt_buckets = _prompt_buckets(options.prompt_buckets)


def _check_generation_sizes(options) -> None:
    check(options.steps_per_generation is None or options.generation_batch_size is None,
          f"steps_per_generation={options.steps_per_generation} and generation_batch_size="
          f"{options.generation_batch_size} are both set: keep one (the other follows from it)")
    for name in ("steps_per_generation", "generation_batch_size"):
        value = getattr(options, name)
        check(value is None or value >= 1, f"{name} must be at least 1, got {value}")


def _scale_rewards(value):
    """TRL's boolean spellings (also as flag text) as the names TRL maps them to."""
    if isinstance(value, bool):
        return "group" if value else "none"
    return {"true": "group", "false": "none"}.get(str(value).lower(), value)


def _reward_weights(weights) -> list[float] | None:
    if weights is None:
        return None
    try:  # flags give the weights as text; a lone number or text is not a list of them
        values = [] if isinstance(weights, (str, int, float)) else [float(w) for w in weights]
    except (TypeError, ValueError):
        values = []
    check(values and all(math.isfinite(v) for v in values),
          f"reward_weights must be a list of numbers (one per reward function), got {weights!r}")
    return values


def _prompt_buckets(buckets) -> tuple[int, ...]:
    """The buckets as increasing whole numbers (flags give them as text, in any order)."""
    try:  # float() then int(): a bucket of 64.5 tokens is refused, not cut to 64
        values = [] if isinstance(buckets, (str, int)) else [int(float(b)) for b in buckets]
        whole = all(float(b) == v for b, v in zip(buckets, values))
    except (TypeError, ValueError, OverflowError):
        values, whole = [], False
    check(values and whole and min(values) >= 1,
          f"prompt_buckets must be prompt lengths of at least 1 token, got {buckets!r}")
    return tuple(sorted(set(values)))


def generation_layout(options, per_device_train_batch_size: int, gradient_accumulation_steps: int,
                      world_size: int) -> tuple[int, int]:
    """(generation_batch_size, steps_per_generation) as TRL's GRPOConfig derives them, where
    per_device_train_batch_size counts completions; one line when they do not fit together."""
    _check_generation_sizes(options)
    global_batch = per_device_train_batch_size * world_size
    steps, size = options.steps_per_generation, options.generation_batch_size
    if size is None:
        steps = steps or gradient_accumulation_steps
        size = global_batch * steps
        how = (f"per_device_train_batch_size x ranks x steps_per_generation = "
               f"{per_device_train_batch_size} x {world_size} x {steps} = {size}")
    else:
        check(size % global_batch == 0,
              f"generation_batch_size ({size}) must be a multiple of the global batch, "
              f"per_device_train_batch_size x ranks = {per_device_train_batch_size} x {world_size}")
        steps = size // global_batch
        how = f"generation_batch_size = {size}"
    check(size % options.num_generations == 0,
          f"the generation batch ({how}) must hold whole groups of num_generations "
          f"({options.num_generations}) completions")
    return size, steps


@dataclass(kw_only=True)
class GRPOFlags(GRPOOptions):
    """GRPO's flags of `hputrain train --model`: its settings, and the rewards."""

    reward_funcs: list[str] | None = None
    """The rewards, each FILE.py:NAME (a function f(prompts, completions, completion_ids,
    **columns) -> list of floats or None, TRL's signature) or a reward-model folder; a data set of
    prompts with --reward-funcs trains with GRPO."""


def grpo_values(options) -> dict:
    """The GRPOOptions fields of `options` (any dataclass that has them)."""
    return values_of(GRPOOptions, options)


def grpo_flags_given(options) -> list[str]:
    """The GRPOOptions fields `options` sets away from their defaults."""
    return fields_given(GRPOOptions, options)


@_refuse_unknown_keywords
@dataclass(kw_only=True)
class GRPOConfig(TrainingArguments, GRPOOptions):
    """TrainingArguments with the GRPO settings: the GRPO trainer's args."""

    per_device_train_batch_size: int = 8
    """Completions (not prompts) per device per micro-batch, as TRL counts them."""
    learning_rate: float = GRPO_DEFAULTS["learning_rate"]
    """AdamW's initial learning rate: TRL's GRPOConfig default (GRPO_DEFAULTS)."""
    remove_unused_columns: bool = GRPO_DEFAULTS["remove_unused_columns"]
    """Drop the data set's columns other than the prompt; TRL's GRPOConfig keeps them, since
    reward functions get them as keyword arguments."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_grpo(self)
        # what holds on any number of ranks; generation_layout checks the rest once it is known
        size = self.generation_batch_size
        check(size is None or size % self.per_device_train_batch_size == 0,
              f"generation_batch_size ({size}) must be a multiple of per_device_train_batch_size "
              f"({self.per_device_train_batch_size}) times the number of ranks")
        check(size is None or size % self.num_generations == 0,
              f"generation_batch_size ({size}) must hold whole groups of num_generations "
              f"({self.num_generations}) completions")
