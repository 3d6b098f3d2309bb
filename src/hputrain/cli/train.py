"""`hputrain train`: without --model, the built-in recipe, a GPT on a text corpus; with --model DIR
--dataset PATH, a local Hugging Face model fine-tuned, fully or with LoRA (recipes/).

Every TrainingArguments field is a flag; `--config FILE` (JSON or TOML) may hold the same fields and
the recipe's own. Precedence, lowest first: the recipe's defaults, what `hputrain config` saved,
the file, the flags typed. `--devices N` starts N processes (torchrun underneath).
"""
from __future__ import annotations

from ..config.accelerator_config import AcceleratorConfig
from ..config.arguments import TrainingArguments
from ..config.flags import add_dataclass_flags
from ..errors import InputError
from ..recipes import HFOptions, RecipeOptions, chosen_recipe


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train the built-in GPT, or fine-tune a local Hugging Face "
                                     "model (--model DIR --dataset PATH)",
                       description=__doc__.split("\n\n")[0])
    add_train_flags(p)
    p.set_defaults(func=cmd_train)


def add_train_flags(p) -> None:
    """train's flags (also `hputrain plan`'s, which plans the same run)."""
    p.add_argument("--config", help="JSON or TOML file of settings")
    p.add_argument("--accelerator-config", "--accelerator_config", "--gaudi-config",
                   dest="accelerator_config", help="a GaudiConfig JSON file")
    p.add_argument("--cpu", action="store_true", help="force the CPU")
    add_dataclass_flags(p, RecipeOptions, "the built-in GPT recipe (without --model)")
    add_dataclass_flags(p, HFOptions, "the Hugging Face recipe (--model DIR --dataset PATH)")
    add_dataclass_flags(p, TrainingArguments, "training arguments")


def cmd_train(args) -> int:
    recipe, options, training_args = chosen_recipe(vars(args))
    config = AcceleratorConfig.from_file(args.accelerator_config) if args.accelerator_config else None
    try:
        return recipe.run(options, training_args, config)
    except Exception as exc:  # the device ran out of memory: one line on what would fit
        accelerator = _accelerator(training_args)
        if accelerator is None or not accelerator.is_out_of_memory(exc):
            raise
        from .planning import out_of_memory_line

        raise InputError(out_of_memory_line(vars(args), training_args, accelerator)) from None


def _accelerator(training_args):
    from ..accelerators import detect_accelerator

    try:
        return detect_accelerator(training_args.accelerator, "eager")
    except InputError:
        return None
