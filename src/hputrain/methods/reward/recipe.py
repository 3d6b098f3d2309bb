"""`hputrain train --method reward --model DIR --dataset pairs.jsonl`: a reward model trained on
preference pairs (methods/reward/trainer.py), as TRL's RewardTrainer trains one.

The folder is loaded as a sequence classifier with one label (AutoModelForSequenceClassification,
num_labels=1). A causal-LM folder gets a new score head, drawn from --seed, as TRL's does (its
language-model head is not used); its pad token becomes config.pad_token_id, which the model
needs to find each sequence's last token. Under --lora-r the adapters are PEFT's SEQ_CLS kind,
which also trains and saves the score head (modules_to_save), so final/ loads as
PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base,
num_labels=1), final); given as --model, such a final/ is trained on further (its adapters and
head), as a LoRA run's final/ is for the other methods. Validation: the data set's own
"validation" split, else the last --validation-split-percentage of the pairs, as for DPO.
--block-size is the longest sequence kept: longer pairs are left out (TRL's max_length). The rows are encoded once per node by
--dataset-num-proc processes and cached in output_dir/.cache (or --cache-dir), through DPO's
code (hf_dpo.load_pairs). Under fsdp across processes the model is loaded shard by shard, as
the other recipes load it (recipes/hf/sharded.py).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ...recipes.hf.folders import (SEQ_CLS, check_task, classifier_adapters,
                                         is_adapter_folder, quiet_load_report)
from ...errors import InputError, first_line
from ...recipes.hf import data as hf_data
from ...recipes.hf.adapters import wrap_lora
from ...recipes.hf.common import choose_block_size
from ...recipes.hf.sharded import meta_model

SHAPES = {"prompt_chosen_rejected": "reward model on preference pairs ('prompt', 'chosen', "
                                    "'rejected')",
          "implicit_prompt": "reward model on preference pairs ('chosen', 'rejected', each "
                             "sequence scored whole)"}


def run_reward(options, training_args, accelerator_config, folder: Path) -> int:
    """Train a reward model from `folder` on --dataset's pairs; write final/ (see the module
    docstring). Returns the exit status."""
    from .config import RewardConfig
    from .trainer import RewardTrainer
    from ...recipes.finish import train_and_finish
    from ...data.chat import use_chat_template

    from ...recipes.hf.adapters import continued_rank
    from ...recipes.hf.folders import tokenizer_source
    from ...recipes.hf.sharded import loads_sharded

    shape = check_reward_data(options, folder)
    if is_adapter_folder(folder):  # a LoRA reward model's final/: training continues on it
        options = dataclasses.replace(options, lora_r=continued_rank(options, folder))
        model, tokenizer_from = classifier_adapters(folder, options.base_model, trainable=True)
        tokenizer, head = load_tokenizer(tokenizer_from), f"the score head trained with the adapters in {folder}"
    else:
        model, tokenizer, head = load_reward_model(folder, options.from_scratch,
                                                   sharded=loads_sharded(training_args))
    use_chat_template(tokenizer, options.chat_template)
    block_size = choose_block_size(options.block_size, model.config, tokenizer)
    if options.lora_r and not is_adapter_folder(folder):
        model = add_reward_lora(model, options)
    train, validation, stats = load_reward_pairs(
        options, tokenizer, block_size, tokenizer_folder=tokenizer_source(folder, options.base_model),
        cache_dir=options.cache_dir or Path(training_args.output_dir) / ".cache")
    config = RewardConfig(**dataclasses.asdict(training_args), max_length=block_size,
                          center_rewards_coefficient=options.center_rewards_coefficient)
    trainer = RewardTrainer(model, config, train_dataset=train, eval_dataset=validation,
                            processing_class=tokenizer, accelerator_config=accelerator_config)
    return train_and_finish(
        trainer, lambda: _header(trainer, model, options, shape, head, stats, len(train),
                                 len(validation or ()), block_size),
        {"recipe": dataclasses.asdict(options), "block_size": block_size, "method": "reward"},
        lambda final: _load_line(model, final, options), end="")


def check_reward_data(options, folder: Path) -> str:
    """The data's shape (a SHAPES key), refusing in one line what --method reward does not take:
    data that is not preference pairs, DPO's own flags, a causal LM's adapters as --model."""
    from .config import RewardOptions
    from ..dpo.data import pair_shape
    from ...recipes.hf.methods import check_not_empty, is_preference, registered_methods, shared_names

    columns = hf_data.columns_of(options.dataset)
    check_not_empty(options.dataset, columns)
    columns = columns or []
    if not is_preference(columns):
        raise InputError(f"--method reward needs preference rows ('chosen' and 'rejected', and "
                         f"optionally 'prompt' and 'margin'); --dataset {options.dataset} has: "
                         f"{', '.join(map(str, columns)) or 'no columns (plain text)'}")
    given = [name for name in sorted(shared_names()) if getattr(options, name, None) is not None]
    own = {f.name for f in dataclasses.fields(RewardOptions)}  # disable_dropout: a reward model's too
    given += [name for method in registered_methods() if method.name != "reward"
              for name in method.flags_given(options, "reward") if name not in own]
    if given:
        raise InputError(f"--{given[0].replace('_', '-')} is for DPO or GRPO; --method reward "
                         "trains a reward model (its own flag: --center-rewards-coefficient)")
    if is_adapter_folder(folder):  # a reward model's adapters, which training continues on
        check_task(folder, SEQ_CLS, "--model", "a LoRA reward model's final/, or a model folder to "
                                               "train a reward model from")
    return pair_shape(columns)


def load_tokenizer(folder: Path):
    """The tokenizer saved in `folder`, offline, or one line saying why it cannot be read."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--model {folder}: no tokenizer could be loaded: {first_line(exc)}") from None


def load_reward_model(folder: Path, from_scratch: bool = False, sharded: bool = False):
    """(sequence classifier with num_labels=1 in float32, tokenizer, how its score head came to
    be) from `folder`, offline. A head the folder does not hold (a causal LM's folder, or a
    classifier of more labels) is drawn anew, and said so. `sharded` (fsdp across processes):
    built on the meta device, each rank reading its own shards (recipes/hf/sharded.py; the head drawn
    as from_pretrained draws it), unless the folder's tensors do not map onto it."""
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
        if sharded and (model := meta_model(folder, config, "--model", auto,
                                            new_heads=True)) is not None:
            drawn = [name for name, param in model.named_parameters() if not param.is_meta]
        else:
            model, drawn = _load_whole(auto, folder, config, transformers)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"--model {folder} cannot be loaded as a sequence classifier: "
                         f"{first_line(exc)}") from None
    rows = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:  # one line here, not an IndexError later
        raise InputError(f"--model {folder}: its tokenizer has {len(tokenizer)} tokens and the "
                         f"model embeds {rows}: resize the embeddings to the tokenizer and save "
                         "the folder again")
    architectures = getattr(config, "architectures", None) or ["?"]
    head = (f"a new score head ({', '.join(drawn)}: not in the folder, which holds "
            f"{architectures[0]}), drawn from --seed" if drawn else "the folder's own score head")
    return model, tokenizer, head


def _load_whole(auto, folder: Path, config, transformers):
    """(model, names of the weights drawn) by from_pretrained, its report of them kept quiet."""
    import torch

    with quiet_load_report(transformers):  # it lists the head we know is new: said by the caller
        model, info = auto.from_pretrained(folder.resolve(), config=config, dtype=torch.float32,
                                           local_files_only=True, ignore_mismatched_sizes=True,
                                           output_loading_info=True)
    drawn = sorted({*info.get("missing_keys", ()),
                    *(k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys", ()))})
    return model, drawn


def add_reward_lora(model, options):
    """`model` wrapped by PEFT with LoRA adapters of the SEQ_CLS kind: the adapters and the score
    head (modules_to_save) are trained, and both saved."""
    return wrap_lora(model, options, "SEQ_CLS")


def load_reward_pairs(options, tokenizer, block_size: int, *, cache_dir=None, tokenizer_folder=None):
    """(training pairs, validation pairs or None, RewardStats of every split), split as DPO's
    are and cached the same way, once per node (hf_dpo.load_pairs)."""
    from .trainer import RewardStats
    from ..dpo.recipe import PairForm, load_pairs

    form = PairForm("reward", encode_reward_part, (tokenizer, block_size), RewardPairs.join,
                    _read_reward_pairs, _write_reward_pairs, RewardStats, [],
                    f"every one is longer than --block-size {block_size} tokens")
    return load_pairs(options, tokenizer, block_size, cache_dir=cache_dir,
                      tokenizer_folder=tokenizer_folder, form=form)


class RewardPairs(list):
    """Encoded reward pairs (dicts of chosen_ids, rejected_ids and maybe margin), with the
    take(start, stop) that hf_dpo.load_pairs splits by."""

    def take(self, start: int, stop: int) -> RewardPairs:
        return RewardPairs(self[start:stop])

    @classmethod
    def join(cls, parts: list[list[dict]]) -> RewardPairs:
        """The pairs of every part, in order; every pair has a margin or none does."""
        pairs = cls(pair for part in parts for pair in part)
        if len({"margin" in pair for pair in pairs}) > 1:
            raise InputError("some rows have a 'margin' and others have none: give every row a "
                             "margin, or none")
        return pairs


def encode_reward_part(context, rows: list):
    """The pairs of some (where, row) and their RewardStats: one tokenizing process's work."""
    from .trainer import encode_reward_pairs

    tokenizer, block_size = context
    pairs, stats = encode_reward_pairs(rows, tokenizer, block_size)
    return RewardPairs(pairs), stats


REWARD_ARRAYS = ("chosen_ids", "chosen_ids.offsets", "rejected_ids", "rejected_ids.offsets",
                 "margin", "stats")


def _write_reward_pairs(folder: Path, made) -> None:
    import numpy as np

    from ...data.token_store import Ragged, write_arrays

    pairs, stats = made
    arrays = {}
    for key in ("chosen_ids", "rejected_ids"):
        arrays |= Ragged.of([pair[key] for pair in pairs]).arrays(key)
    margins = [pair["margin"] for pair in pairs if "margin" in pair]  # all of them, or none
    arrays["margin"] = np.asarray(margins, dtype=np.float64)
    arrays["stats"] = np.asarray([getattr(stats, f.name) for f in dataclasses.fields(stats)],
                                 dtype=np.int64)
    write_arrays(folder, arrays)


def _read_reward_pairs(folder: Path):
    """(RewardPairs, RewardStats) from the cache, or None when it is missing or damaged."""
    from ...data.token_store import Ragged, read_arrays
    from .trainer import RewardStats

    arrays = read_arrays(folder, REWARD_ARRAYS)
    if arrays is None or arrays["stats"].shape != (len(dataclasses.fields(RewardStats)),):
        return None
    chosen, rejected = (Ragged.read(arrays, key) for key in ("chosen_ids", "rejected_ids"))
    margins = arrays["margin"]
    if len(chosen) != len(rejected) or len(margins) not in (0, len(chosen)):
        return None
    pairs = RewardPairs({"chosen_ids": chosen[i].tolist(), "rejected_ids": rejected[i].tolist()}
                        | ({"margin": float(margins[i])} if len(margins) else {})
                        for i in range(len(chosen)))
    return pairs, RewardStats(*map(int, arrays["stats"]))


def _header(trainer, model, options, shape: str, head: str, stats, train: int, held: int,
            block_size: int) -> str:
    from ..dpo.recipe import pairs_header

    margin = " - margin" if trainer.train_dataset and "margin" in trainer.train_dataset[0] else ""
    center = options.center_rewards_coefficient
    centering = f" + {center:g} * (r_chosen + r_rejected)^2" if center is not None else ""
    return pairs_header(trainer, model, options, f"{SHAPES[shape]}; score: {head}",
                        f"loss -log sigmoid(r_chosen - r_rejected{margin}){centering}",
                        f"{stats.rows} rows, {train} training and {held} validation pairs, "
                        f"{stats.too_long} left out (longer than --block-size {block_size})")


def _load_line(model, final: Path, options) -> str:
    if options.lora_r:
        base = model.get_base_model().name_or_path
        return (f'load it with PeftModel.from_pretrained(AutoModelForSequenceClassification'
                f'.from_pretrained("{base}", num_labels=1), "{final}")')
    return f'load it with AutoModelForSequenceClassification.from_pretrained("{final}")'
