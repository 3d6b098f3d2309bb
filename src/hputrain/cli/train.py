"""`hputrain train`: without --model, the built-in recipe, a GPT on a text corpus; with --model DIR
--dataset PATH, a local Hugging Face model fine-tuned, fully or with LoRA (recipes/).

Every TrainingArguments field is a flag; `--config FILE` (JSON or TOML) may hold the same fields and
the recipe's own. Precedence, lowest first: the recipe's defaults, what `hputrain config` saved,
the file, the flags typed. `--devices N` starts N processes (torchrun underneath).
"""
from __future__ import annotations

import dataclasses
import os

from ..config.accelerator_config import AcceleratorConfig
from ..config.arguments import TrainingArguments
from ..config.flags import add_dataclass_flags
from ..config.sections import help_groups
from ..errors import InputError
from ..recipes import HFOptions, RecipeOptions, chosen_recipe
from ..models.kind import registered
from ..recipes.hf.methods import registered_methods, shared_names


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train the built-in GPT, or fine-tune a local Hugging Face "
                                     "model (--model DIR --dataset PATH)",
                       description=__doc__.split("\n\n")[0],
                       usage="hputrain train [--config FILE] [--model DIR --dataset PATH] [FLAGS]")
    add_train_flags(p)
    p.set_defaults(func=cmd_train)


def add_train_flags(p) -> None:
    """train's flags (also `hputrain plan`'s, which plans the same run)."""
    p.add_argument("--config", metavar="FILE", help="a YAML, JSON or TOML file of settings, "
                   "keyed by the flags' names (max_steps: 100)")
    p.add_argument("--accelerator-config", "--accelerator_config", "--gaudi-config",
                   dest="accelerator_config", help="a GaudiConfig JSON file")
    p.add_argument("--cpu", action="store_true", help="force the CPU")
    add_dataclass_flags(p, RecipeOptions, "the built-in GPT recipe (without --model)")
    shared = shared_names()  # beta and loss_type: several methods', said in the recipe's group
    methods = tuple((m.help_title, frozenset(f.name for f in dataclasses.fields(m.flags)) - shared)
                    for m in (*registered_methods(), *registered()) if m.help_title and m.flags is not None)
    add_dataclass_flags(p, HFOptions, (("the Hugging Face recipe (--model DIR --dataset PATH)", None),
                                       *methods))
    add_dataclass_flags(p, TrainingArguments,
                        (*help_groups(), ("training: Hugging Face's and Optimum's spellings", None)))

def cmd_train(args) -> int:
    recipe, options, training_args = chosen_recipe(vars(args))
    config = AcceleratorConfig.from_file(args.accelerator_config) if args.accelerator_config else None
    _refuse_start_early(training_args)
    try:
        return recipe.run(options, training_args, config)
    except Exception as exc:  # the device ran out of memory: one line on what would fit
        accelerator = _accelerator(training_args)
        if accelerator is None or not accelerator.is_out_of_memory(exc):
            raise
        from .planning import out_of_memory_line

        raise InputError(out_of_memory_line(vars(args), training_args, accelerator)) from None


def _refuse_start_early(training_args) -> None:
    """An output_dir the run would refuse (checkpoint/start.py: an earlier run's checkpoints and
    neither --resume-from-checkpoint latest nor --overwrite-output-dir), refused before any model
    is read or any process started. A launched worker leaves it to the trainer, whose ranks
    decide together and know whether torchrun restarted them."""
    if "LOCAL_RANK" in os.environ:
        return
    from ..checkpoint.start import plan_start  # torch: imported only for a run

    start = plan_start(training_args.output_dir, training_args.resume_from_checkpoint,
                       overwrite=training_args.overwrite_output_dir)
    if start.error is not None:
        raise InputError(start.error)


def _accelerator(training_args):
    from ..accelerators import detect_accelerator

    try:
        return detect_accelerator(training_args.accelerator, "eager")
    except InputError:
        return None
