"""`hputrain train --method reward --model DIR --dataset pairs.jsonl`: a reward model trained on
preference pairs (training/reward.py), as TRL's RewardTrainer trains one.

The folder is loaded as a sequence classifier with one label (AutoModelForSequenceClassification,
num_labels=1). A causal-LM folder gets a new score head, drawn from --seed, as TRL's does (its
language-model head is not used); its pad token becomes config.pad_token_id, which the model
needs to find each sequence's last token. Under --lora-r the adapters are PEFT's SEQ_CLS kind,
which also trains and saves the score head (modules_to_save), so final/ loads as
PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base,
num_labels=1), final). Validation: the data set's own "validation" split, else the last
--validation-split-percentage of the pairs, as for DPO. --block-size is the longest sequence kept:
longer pairs are left out (TRL's max_length). The rows are encoded in memory, in this process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from pathlib import Path

from ..errors import InputError
from . import hf_data
from .hf_common import choose_block_size, first_line

SHAPES = {"prompt_chosen_rejected": "reward model on preference pairs ('prompt', 'chosen', "
                                    "'rejected')",
          "implicit_prompt": "reward model on preference pairs ('chosen', 'rejected', each "
                             "sequence scored whole)"}


def run_reward(options, training_args, accelerator_config, folder: Path) -> int:
    """Train a reward model from `folder` on --dataset's pairs; write final/ (see the module
    docstring). Returns the exit status."""
    from ..config.grpo import RewardConfig
    from ..training.reward import RewardTrainer
    from .finish import report_outputs, save_final, write_recipe
    from .hf_sft import use_chat_template

    shape = check_reward_data(options, folder)
    model, tokenizer, head = load_reward_model(folder, options.from_scratch)
    use_chat_template(tokenizer, options.chat_template)
    block_size = choose_block_size(options.block_size, model.config, tokenizer)
    if options.lora_r:
        model = add_reward_lora(model, options)
    train, validation, stats = load_reward_pairs(options, tokenizer, block_size)
    config = RewardConfig(**dataclasses.asdict(training_args), max_length=block_size,
                          center_rewards_coefficient=options.center_rewards_coefficient)
    trainer = RewardTrainer(model, config, train_dataset=train, eval_dataset=validation,
                            processing_class=tokenizer, accelerator_config=accelerator_config)
    if trainer.group.is_main:
        print(_header(trainer, model, options, shape, head, stats, len(train),
                      len(validation or ()), block_size))
    output = trainer.train()
    final = save_final(trainer, output)  # every rank: a sharded model is gathered first
    if not trainer.group.is_main:
        return 0
    write_recipe(training_args.output_dir, {"recipe": dataclasses.asdict(options),
                                            "block_size": block_size, "method": "reward"})
    status = report_outputs(trainer, output)
    if status is None and final is not None:
        print(_load_line(model, final, options))
    return status or 0


def check_reward_data(options, folder: Path) -> str:
    """The data's shape (a SHAPES key), refusing in one line what --method reward does not take:
    data that is not preference pairs, DPO's own flags, an adapter folder as --model."""
    from ..config.grpo import grpo_flags_given
    from ..config.preference import preference_flags_given
    from ..data.preference import is_preference, pair_shape
    from .hf_adapters import is_adapter_folder

    columns = hf_data.columns_of(options.dataset) or []
    if not is_preference(columns):
        raise InputError(f"--method reward needs preference rows ('chosen' and 'rejected', and "
                         f"optionally 'prompt' and 'margin'); --dataset {options.dataset} has: "
                         f"{', '.join(map(str, columns)) or 'no columns (plain text)'}")
    shared = ("beta", "loss_type")  # both DPO's and GRPO's: None unless given
    given = [name for name in shared if getattr(options, name, None) is not None]
    given += [name for name in preference_flags_given(options) + grpo_flags_given(options)
              if name not in (*shared, "disable_dropout")]  # a reward model's default too
    given += [name for name in ("ref_model", "reward_funcs") if getattr(options, name, None)]
    if given:
        raise InputError(f"--{given[0].replace('_', '-')} is for DPO or GRPO; --method reward "
                         "trains a reward model (its own flag: --center-rewards-coefficient)")
    if is_adapter_folder(folder):
        raise InputError(f"--method reward: --model {folder} is a PEFT adapter folder; give a "
                         "model folder (config.json and weights) to train a reward model from")
    return pair_shape(columns)


def load_reward_model(folder: Path, from_scratch: bool = False):
    """(sequence classifier with num_labels=1 in float32, tokenizer, how its score head came to
    be) from `folder`, offline. A head the folder does not hold (a causal LM's folder, or a
    classifier of more labels) is drawn anew, and said so."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # the run prints its own progress
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, num_labels=1)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--model {folder} cannot be read: {first_line(exc)}") from None
    auto = transformers.AutoModelForSequenceClassification
    try:
        if from_scratch:
            return auto.from_config(config, dtype=torch.float32), tokenizer, "random weights"
        with _quiet_load_report(transformers):  # it lists the head we know is new: said below
            model, info = auto.from_pretrained(folder.resolve(), config=config, dtype=torch.float32,
                                               local_files_only=True, ignore_mismatched_sizes=True,
                                               output_loading_info=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"--model {folder} cannot be loaded as a sequence classifier: "
                         f"{first_line(exc)}") from None
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:  # one line here, not an IndexError later
        raise InputError(f"--model {folder}: its tokenizer has {len(tokenizer)} tokens and the "
                         f"model embeds {rows}: resize the embeddings to the tokenizer and save "
                         "the folder again")
    drawn = sorted({*info.get("missing_keys", ()),
                    *(k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ()))})
    architectures = getattr(config, "architectures", None) or ["?"]
    head = (f"a new score head ({', '.join(drawn)}: not in the folder, which holds "
            f"{architectures[0]}), drawn from --seed" if drawn else "the folder's own score head")
    return model, tokenizer, head


@contextlib.contextmanager
def _quiet_load_report(transformers):
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(verbosity)


def add_reward_lora(model, options):
    """`model` wrapped by PEFT with LoRA adapters of the SEQ_CLS kind: the adapters and the score
    head (modules_to_save) are trained, and both saved."""
    try:
        import peft
    except ImportError:
        raise InputError("--lora-r needs peft, which is not installed: pip install peft") from None
    targets = options.lora_target_modules
    if not targets:  # peft knows the attention projections of the architectures it lists
        known = getattr(peft.utils, "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING", {})
        targets = None if getattr(model.config, "model_type", None) in known else "all-linear"
    config = peft.LoraConfig(task_type="SEQ_CLS", r=options.lora_r,
                             lora_alpha=options.lora_alpha or 2 * options.lora_r,
                             lora_dropout=0.05 if options.lora_dropout is None else options.lora_dropout,
                             target_modules=targets)
    try:
        with warnings.catch_warnings():  # PEFT reads a name transformers 5 deprecates: not the user's
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return peft.get_peft_model(model, config)
    except ValueError as exc:
        raise InputError(f"LoRA cannot wrap {type(model).__name__}: {first_line(exc)} (name its "
                         "layers with --lora-target-modules)") from None


def load_reward_pairs(options, tokenizer, block_size: int):
    """(training pairs, validation pairs or None, RewardStats of every split)."""
    from ..training.reward import RewardStats, encode_reward_pairs

    path, percentage = options.dataset, options.validation_split_percentage
    pairs, stats = encode_reward_pairs(hf_data.records(path, hf_data.TRAIN_SPLIT), tokenizer, block_size)
    held = None
    if percentage > 0 and hf_data.VALIDATION_SPLIT in hf_data.saved_splits(path):
        held, more = encode_reward_pairs(hf_data.records(path, hf_data.VALIDATION_SPLIT), tokenizer,
                                         block_size)
        stats = RewardStats(*(getattr(stats, f.name) + getattr(more, f.name)
                              for f in dataclasses.fields(RewardStats)))
    elif percentage > 0:
        count = max(1, int(len(pairs) * percentage / 100))
        if count >= len(pairs):
            raise InputError(f"--dataset {path} has {len(pairs)} pair(s), too few to hold "
                             f"{percentage:g}% out for validation: give more rows, or "
                             "--validation-split-percentage 0")
        pairs, held = pairs[:-count], pairs[-count:]
    if not pairs:
        raise InputError(f"--dataset {path}: no pair is left to train on (every one is longer "
                         f"than --block-size {block_size} tokens)")
    return pairs, held or None, stats


def _header(trainer, model, options, shape: str, head: str, stats, train: int, held: int,
            block_size: int) -> str:
    from .finish import kernels_line

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    name = type(model.get_base_model() if options.lora_r else model).__name__
    name += f" + LoRA r={options.lora_r}" if options.lora_r else ""
    margin = " - margin" if trainer.train_dataset and "margin" in trainer.train_dataset[0] else ""
    center = options.center_rewards_coefficient
    centering = f" + {center:g} * (r_chosen + r_rejected)^2" if center is not None else ""
    return (f"hputrain: {name}, {trainable:,} of {total:,} parameters trainable, on "
            f"{trainer.accelerator.name} in "
            f"{str(trainer.precision.compute_dtype).removeprefix('torch.')}{kernels_line(trainer)}\n"
            f"hputrain: method: {SHAPES[shape]}; score: {head}\n"
            f"hputrain: loss -log sigmoid(r_chosen - r_rejected{margin}){centering}\n"
            f"hputrain: {stats.rows} rows, {train} training and {held} validation pairs, "
            f"{stats.too_long} left out (longer than --block-size {block_size})")


def _load_line(model, final: Path, options) -> str:
    if options.lora_r:
        base = model.get_base_model().name_or_path
        return (f'load it with PeftModel.from_pretrained(AutoModelForSequenceClassification'
                f'.from_pretrained("{base}", num_labels=1), "{final}")')
    return f'load it with AutoModelForSequenceClassification.from_pretrained("{final}")'
