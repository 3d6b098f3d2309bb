"""PEFT adapter folders where a model folder is taken: what `hputrain train --lora-r` writes into
output_dir/final (adapter_config.json, adapter_model.safetensors, the tokenizer files) is a model
to `hputrain evaluate`, `hputrain generate`, `--ref-model` and `--model` (training continues on
its adapters), and `hputrain export --merge` turns it into one model folder.

The base model is `--base-model DIR` when given, else adapter_config.json's
`base_model_name_or_path` (which hputrain writes as an absolute path, so that the folder works
from any working directory: checkpoint/export.py). The tokenizer is the adapter folder's own when
it has one (a run's final/ does, with its --chat-template), else the base's. Reading such
folders is checkpoint/model_folders.py's (the reward functions read them too); this module adds
what the recipes do with them: continuing training on a folder's adapters.
"""
from __future__ import annotations

from pathlib import Path

from ..checkpoint.model_folders import (adapter_base, adapter_config, is_adapter_folder,
                                        tokenizer_folder)
from ..errors import InputError


def tokenizer_source(folder: Path, base_model: str | None = None) -> Path:
    """The folder whose tokenizer files load_model reads for `folder` (a model or adapter folder):
    what the token cache's key is made of."""
    if not is_adapter_folder(folder):
        return folder
    return tokenizer_folder(folder, adapter_base(folder, base_model))


def continued_rank(options, folder: Path) -> int:
    """The LoRA rank of the adapter folder `folder` given as --model, which training continues on
    as it is: LoRA adapters only (which the recipe trains, saves and disables for DPO's
    reference); --lora-* flags that ask for other adapters, and --from-scratch, are one line (a
    --lora-r equal to the rank is taken: the command that wrote the folder, run again)."""
    config = adapter_config(folder)
    rank, kind = config.get("r"), config.get("peft_type")
    if kind != "LORA" or not isinstance(rank, int):
        raise InputError(f"--model {options.model}: training continues only on LoRA adapters, and "
                         f"this folder holds {kind or 'other'} adapters")
    if options.lora_r is not None and options.lora_r != rank:
        raise InputError(f"--lora-r {options.lora_r}: --model {options.model} holds LoRA adapters of "
                         f"rank {rank}, which training continues on: leave out --lora-r")
    for name in ("lora_alpha", "lora_dropout", "lora_target_modules"):
        if getattr(options, name) is not None:
            raise InputError(f"--{name.replace('_', '-')}: --model {options.model} holds LoRA "
                             "adapters, which training continues on as they are: leave it out")
    if options.from_scratch:
        raise InputError(f"--from-scratch: --model {options.model} is an adapter folder, whose "
                         "base has trained weights: give the base model's folder instead")
    return rank
