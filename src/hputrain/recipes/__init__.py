"""The recipes of `hputrain train` (cli/train.py): without --model, the built-in recipe, a GPT on a text corpus (gpt.py); with
--model DIR --dataset PATH, a local Hugging Face model fine-tuned, fully or with LoRA (hf.py).

Every TrainingArguments field is a flag; `--config FILE` (JSON or TOML) may hold the same fields and
the recipe's own. Precedence, lowest first: the recipe's defaults, what `hputrain config` saved,
the file, the flags typed. `--devices N` starts N processes (torchrun underneath).
"""
from __future__ import annotations

import dataclasses

from ..config.arguments import TrainingArguments
from ..config.defaults import load_defaults, training_defaults
from ..config.fields import ConfigError, checked_values, read_mapping
from . import gpt, hf
from .gpt import RECIPE_DEFAULTS, RecipeOptions

__all__ = ["RECIPE_DEFAULTS", "HFOptions", "RecipeOptions", "chosen_recipe", "merge_settings",
           "resolve_settings"]

NOT_SETTINGS = ("config", "accelerator_config", "cpu", "func", "command")  # the parser's own


def __getattr__(name: str):
    if name == "HFOptions":  # made once the methods are registered (recipes/hf/methods.py)
        return hf.options_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def options_of(recipe) -> type:
    """The options dataclass of the recipe module `recipe`."""
    return hf.options_class() if recipe is hf else RecipeOptions


def chosen_recipe(flags: dict):
    """(the recipe module, its options, TrainingArguments) for `hputrain train`'s parsed flags and
    their --config file: the Hugging Face recipe when a model is named, else the built-in GPT."""
    file_values = read_mapping(flags["config"]) if flags.get("config") else {}
    recipe = hf if "model" in flags or "model" in file_values else gpt
    return (recipe, *merge_settings(recipe, flags, file_values))


def resolve_settings(flags: dict) -> tuple[RecipeOptions, TrainingArguments]:
    """The built-in GPT recipe's settings from the parsed flags (and their --config file)."""
    file_values = read_mapping(flags["config"]) if flags.get("config") else {}
    return merge_settings(gpt, flags, file_values)


def merge_settings(recipe, flags: dict, file_values: dict):
    """(the recipe's options, TrainingArguments): its defaults < saved < the file < flags typed."""
    options_class = options_of(recipe)
    own = {f.name for f in dataclasses.fields(options_class)}
    where = f"config file {flags.get('config')}"
    typed = {k: v for k, v in flags.items() if k not in NOT_SETTINGS}
    _refuse_the_other_recipes(recipe, typed, file_values, where)
    values = checked_values(options_class, {k: v for k, v in file_values.items() if k in own}, where)
    training = checked_values(TrainingArguments, {k: v for k, v in file_values.items() if k not in own},
                              where)
    options = options_class(**(values | {k: v for k, v in typed.items() if k in own}))
    saved = load_defaults()  # what `hputrain config` wrote
    chosen = ((training_defaults(saved) if saved else {}) | training
              | {k: v for k, v in typed.items() if k not in own})
    # A choice made anywhere (saved, file, flag) outranks the recipe's default for the same thing.
    outranked = {"bf16": "precision", "warmup_ratio": "warmup_steps"}
    defaults = {k: v for k, v in recipe.defaults(options).items()
                if not any(choice in chosen and k == default for choice, default in outranked.items())}
    return options, TrainingArguments(**(defaults | chosen))


def _refuse_the_other_recipes(recipe, typed: dict, file_values: dict, where: str) -> None:
    """One line for an option of the recipe not chosen (--lora-r without --model, --model-size
    with it), which would otherwise be dropped without a word."""
    for other in (gpt, hf):
        if other is recipe:
            continue
        options_class = options_of(other)
        names = {f.name for f in dataclasses.fields(options_class)}
        for name in typed:
            if name in names:
                raise ConfigError(f"--{name.replace('_', '-')} {other.MISPLACED}")
        for name in file_values:
            if name in names:
                raise ConfigError(f"{name} in {where} {other.MISPLACED}")
