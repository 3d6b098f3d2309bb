"""Issue 32: GRPOConfig and RewardConfig by TRL 1.16's names and defaults. The reference is TRL
itself (in the test extra): its GRPOConfig and RewardConfig instantiated here, their defaults and
their derived generation batch compared with ours, and every name of theirs either taken or
refused in one line."""
from __future__ import annotations

import argparse
import dataclasses
import warnings

import pytest

from hputrain.config.fields import ConfigError
from hputrain.config.flags import add_dataclass_flags
from hputrain.methods.grpo.config import (GRPO_DEFAULTS, GRPOConfig, GRPOOptions, generation_layout,
                                          grpo_flags_given, grpo_values)
from hputrain.methods.reward.config import REWARD_DEFAULTS, RewardConfig, RewardOptions, reward_flags_given
from hputrain.methods.dpo.config import DPOConfig
from hputrain.errors import InputError

# TRL's defaults hputrain does not copy, and why: both are TrainingArguments settings that
# hputrain leaves to the user for every method (gradient_checkpointing) or decides by device
# (the recipe's precision is auto); steps_per_generation and generation_batch_size stay unset
# until the number of ranks is known (generation_layout, compared with TRL's below).
NOT_COPIED = {"bf16", "gradient_checkpointing", "steps_per_generation", "generation_batch_size"}


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    monkeypatch.setenv("HPUTRAIN_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def trl():
    module = pytest.importorskip("trl")
    assert module.__version__.startswith("1.16"), module.__version__
    return module


def _theirs(cls, tmp_path, **kwargs):
    with warnings.catch_warnings():  # transformers 5 warns of its own gradient_checkpointing name
        warnings.simplefilter("ignore", FutureWarning)
        return cls(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs)


def _trl_own(trl, theirs, tmp_path) -> set[str]:
    """The fields TRL's config adds to TrainingArguments or gives another default."""
    import transformers

    base = _theirs(transformers.TrainingArguments, tmp_path)
    return {f.name for f in dataclasses.fields(theirs) if f.init and (
        not hasattr(base, f.name) or getattr(base, f.name) != getattr(theirs, f.name))}


def _one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message and isinstance(exc_info.value, InputError)
    return message


# -- defaults --------------------------------------------------------------------------------------

@pytest.mark.parametrize("ours_cls, theirs_name, options_cls, own", [
    (GRPOConfig, "GRPOConfig", GRPOOptions, {"prompt_buckets"}),
    (RewardConfig, "RewardConfig", RewardOptions, set())])
def test_defaults_equal_trl(trl, tmp_path, ours_cls, theirs_name, options_cls, own):
    theirs = _theirs(getattr(trl, theirs_name), tmp_path)
    ours = ours_cls(output_dir=str(tmp_path), report_to=[])
    trl_names = {f.name for f in dataclasses.fields(theirs)}
    # every option is TRL's, by its name, but for hputrain's own
    assert {f.name for f in dataclasses.fields(options_cls)} - trl_names == own
    shared = (_trl_own(trl, theirs, tmp_path) | {f.name for f in dataclasses.fields(options_cls)}) \
        & {f.name for f in dataclasses.fields(ours_cls)} & trl_names
    assert len(shared) > (15 if ours_cls is GRPOConfig else 3)  # not vacuous
    differ = {name for name in shared if getattr(ours, name) != getattr(theirs, name)}
    assert differ == NOT_COPIED & shared, {n: (getattr(ours, n), getattr(theirs, n)) for n in differ}


def test_method_defaults_are_trls(trl, tmp_path):
    grpo, reward = _theirs(trl.GRPOConfig, tmp_path), _theirs(trl.RewardConfig, tmp_path)
    assert GRPO_DEFAULTS == {"learning_rate": grpo.learning_rate,
                             "remove_unused_columns": grpo.remove_unused_columns} \
        == {"learning_rate": 1e-6, "remove_unused_columns": False}
    assert REWARD_DEFAULTS == {"learning_rate": reward.learning_rate} == {"learning_rate": 1e-4}
    assert (reward.max_length, reward.disable_dropout) == (RewardConfig().max_length, True)


def test_grpo_beta_is_not_dpos():
    assert GRPOConfig().beta == 0.0 and DPOConfig().beta == 0.1
    assert GRPOConfig().loss_type == "dapo" and DPOConfig().loss_type == "sigmoid"


@pytest.mark.parametrize("given, means", [(True, "group"), (False, "none"), ("batch", "batch")])
def test_scale_rewards_reads_trls_booleans_as_trl_does(trl, tmp_path, given, means):
    assert _theirs(trl.GRPOConfig, tmp_path, scale_rewards=given).scale_rewards == means
    assert GRPOConfig(scale_rewards=given).scale_rewards == means


def test_values_and_flags_given():
    config = GRPOConfig(num_generations=4, top_k=50, prompt_buckets=[256, 64], learning_rate=1e-5)
    assert grpo_flags_given(config) == ["num_generations", "top_k", "prompt_buckets"]
    assert grpo_values(config)["prompt_buckets"] == (64, 256)
    assert set(grpo_values(config)) == {f.name for f in dataclasses.fields(GRPOOptions)}
    assert grpo_flags_given(GRPOConfig(prompt_buckets=(16, 32, 64, 128, 256, 512))) == []
    assert reward_flags_given(RewardConfig(disable_dropout=False)) == ["disable_dropout"]


# -- the generation batch ------------------------------------------------------------------------

LAYOUTS = [  # per_device_train_batch_size, gradient_accumulation_steps, ranks, options
    (8, 1, 1, {}), (2, 3, 4, {"num_generations": 4}), (4, 2, 2, {"steps_per_generation": 4}),
    (2, 1, 4, {"generation_batch_size": 16}), (3, 4, 2, {"num_generations": 3}),
    (4, 1, 3, {"num_generations": 6, "generation_batch_size": 24}),
    (4, 2, 1, {"num_generations": 16, "steps_per_generation": 8}),
    # refused by both: not a multiple of the global batch; not whole groups
    (4, 1, 2, {"generation_batch_size": 12, "num_generations": 4}),
    (2, 1, 3, {"num_generations": 4}), (3, 2, 1, {"steps_per_generation": 3}),
]


@pytest.mark.parametrize("per_device, accumulation, ranks, options", LAYOUTS)
def test_generation_layout_is_what_trl_derives(trl, tmp_path, per_device, accumulation, ranks,
                                               options):
    # TRL reads the number of ranks from accelerate's state: a subclass stands in for a launch
    on_ranks = type("OnRanks", (trl.GRPOConfig,), {"world_size": property(lambda self: ranks)})
    try:
        theirs = _theirs(on_ranks, tmp_path, per_device_train_batch_size=per_device,
                         gradient_accumulation_steps=accumulation, **options)
        expected = (theirs.generation_batch_size, theirs.steps_per_generation)
    except ValueError:
        expected = None
    ours = GRPOOptions(**options)
    if expected is None:
        with pytest.raises(ConfigError) as exc:
            generation_layout(ours, per_device, accumulation, ranks)
        assert "generation_batch_size" in _one_line(exc) or "generation batch" in _one_line(exc)
    else:
        assert generation_layout(ours, per_device, accumulation, ranks) == expected


@pytest.mark.parametrize("options, says", [
    ({"generation_batch_size": 12, "num_generations": 4},
     "generation_batch_size (12) must be a multiple of the global batch, "
     "per_device_train_batch_size x ranks = 4 x 2"),
    ({"num_generations": 3},
     "the generation batch (per_device_train_batch_size x ranks x steps_per_generation = "
     "4 x 2 x 1 = 8) must hold whole groups of num_generations (3) completions"),
    ({"steps_per_generation": 2, "generation_batch_size": 16}, "are both set: keep one"),
])
def test_layouts_that_do_not_fit_are_one_line(options, says):
    options = GRPOOptions(**options)
    with pytest.raises(ConfigError) as exc:
        generation_layout(options, 4, 1, 2)
    assert says in _one_line(exc)


# -- bad values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, says", [
    ({"num_generations": 1}, "num_generations must be at least 2"),
    ({"max_completion_length": 0}, "max_completion_length must be a whole number of at least 1"),
    ({"max_completion_length": None}, "completions have a fixed length here"),
    ({"temperature": -0.5}, "temperature must not be negative"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"), ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -1}, "top_k must not be negative"),
    ({"min_p": 1.5}, "min_p must be in [0, 1]"), ({"min_p": -0.1}, "min_p must be in [0, 1]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be positive"),
    ({"beta": -0.1}, "beta must not be negative"),
    ({"epsilon": 0.0}, "epsilon must be positive"), ({"epsilon_high": -1.0}, "epsilon_high must be"),
    ({"delta": 0.9}, "delta caps the probability ratio, so it must be above 1"),
    ({"num_iterations": 0}, "num_iterations must be at least 1"),
    ({"steps_per_generation": 2, "generation_batch_size": 16},
     "steps_per_generation=2 and generation_batch_size=16 are both set"),
    ({"steps_per_generation": 0}, "steps_per_generation must be at least 1"),
    ({"generation_batch_size": 12}, "generation_batch_size (12) must be a multiple of "
                                    "per_device_train_batch_size (8)"),
    ({"generation_batch_size": 16, "num_generations": 3}, "whole groups of num_generations (3)"),
    ({"loss_type": "cispo"}, "loss_type='cispo' is not computed here (hputrain computes dapo, grpo"),
    ({"loss_type": "vespo"}, "loss_type='vespo' is not computed here"),
    ({"loss_type": "dr-grpo"}, "did you mean 'dr_grpo'"),
    ({"scale_rewards": "groups"}, "scale_rewards must be one of group, batch, none"),
    ({"importance_sampling_level": "seq"}, "importance_sampling_level must be one of token, sequence"),
    ({"multi_objective_aggregation": "normalize_then_sum"}, "is not computed here"),
    ({"reward_weights": 1.0}, "reward_weights must be a list of numbers"),
    ({"reward_weights": ["one"]}, "reward_weights must be a list of numbers"),
    ({"reward_weights": [1.0, float("inf")]}, "reward_weights must be a list of numbers"),
    ({"prompt_buckets": [64, 0]}, "prompt_buckets must be prompt lengths of at least 1 token"),
    ({"prompt_buckets": [64.5]}, "prompt_buckets must be prompt lengths"),
    ({"prompt_buckets": []}, "prompt_buckets must be prompt lengths"),
    ({"prompt_buckets": 128}, "prompt_buckets must be prompt lengths"),
    ({"betta": 0.1}, "did you mean 'beta'"),
])
def test_each_bad_grpo_value_is_one_line(kwargs, says):
    with pytest.raises(ConfigError) as exc:
        GRPOConfig(**kwargs)
    assert says in _one_line(exc)


@pytest.mark.parametrize("kwargs, says", [
    ({"center_rewards_coefficient": -0.01}, "center_rewards_coefficient must not be negative"),
    ({"max_length": 0}, "max_length must be at least 1"),
    ({"center_rewards_coeficient": 0.01}, "did you mean 'center_rewards_coefficient'"),
])
def test_each_bad_reward_value_is_one_line(kwargs, says):
    with pytest.raises(ConfigError) as exc:
        RewardConfig(**kwargs)
    assert says in _one_line(exc)


def test_flags_and_files_read_text_lists_and_trls_spellings(tmp_path):
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, GRPOConfig)
    given = vars(parser.parse_args(["--prompt-buckets", "256", "64", "--reward-weights", "1", "0.5",
                                    "--scale-rewards", "False", "--min-p", "none"]))
    config = GRPOConfig(**given)
    assert (config.prompt_buckets, config.reward_weights, config.scale_rewards, config.min_p) == \
        ((64, 256), [1.0, 0.5], "none", None)
    path = tmp_path / "grpo.json"
    path.write_text('{"prompt_buckets": [128, 32], "reward_weights": [2, 1], "loss_type": "grpo"}')
    config = GRPOConfig.from_file(path)
    assert (config.prompt_buckets, config.reward_weights, config.loss_type) == ((32, 128), [2.0, 1.0], "grpo")


# -- TRL's names hputrain does not take -----------------------------------------------------------

@pytest.mark.parametrize("ours_cls, theirs_name", [(GRPOConfig, "GRPOConfig"),
                                                   (RewardConfig, "RewardConfig")])
def test_every_trl_name_is_taken_or_refused_in_one_line(trl, ours_cls, theirs_name):
    theirs = [f.name for f in dataclasses.fields(getattr(trl, theirs_name)) if f.init]
    refused = [name for name in theirs if name not in ours_cls.__dataclass_fields__]
    assert len(refused) > 60  # the Trainer's names as well as TRL's own
    for name in refused:
        with pytest.raises(ConfigError) as exc:
            ours_cls(**{name: True})
        message = _one_line(exc)
        assert message.startswith(f"{ours_cls.__name__}: {name} ") and "unknown" not in message, message


@pytest.mark.parametrize("name, says", [
    ("use_vllm", "vLLM is not used; generation runs on hputrain's static-shape engine"),
    ("vllm_mode", "vLLM is not used"), ("vllm_importance_sampling_correction", "vLLM is not used"),
    ("use_transformers_paged", "static-shape engine"), ("cache_implementation", "static KV cache"),
    ("tools", "no tool calls"), ("max_tool_calling_iterations", "no tool calls"),
    ("sync_ref_model", "the reference stays the starting weights"),
    ("top_entropy_quantile", "is not computed here"), ("entropy_coef", "is not computed here"),
    ("sapo_temperature_neg", "is not computed here"),
    ("generation_kwargs", "temperature, top_p, top_k, min_p and repetition_penalty"),
    ("log_completions", "completions.jsonl"), ("num_completions_to_print", "completions.jsonl"),
    ("max_prompt_length", "is prompt_buckets here"),
    ("fp16", "use bf16=True"),
])
def test_trl_grpo_names_say_what_instead(name, says):
    with pytest.raises(ConfigError) as exc:
        GRPOConfig(**{name: True})
    assert says in _one_line(exc)


def test_trl_names_are_refused_as_flags_too():
    parser = argparse.ArgumentParser()
    add_dataclass_flags(parser, GRPOConfig)
    with pytest.raises(SystemExit):
        parser.parse_args(["--use-vllm"])
    with pytest.raises(argparse.ArgumentError, match="use_vllm is not there: vLLM is not used"):
        parser.exit_on_error = False
        parser.parse_args(["--use_vllm", "true"])
