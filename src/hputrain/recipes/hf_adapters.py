"""PEFT adapter folders where a model folder is taken: what `hputrain train --lora-r` writes into
output_dir/final (adapter_config.json, adapter_model.safetensors, the tokenizer files) is a model
to `hputrain evaluate`, `hputrain generate`, `--ref-model` and `--model` (training continues on
its adapters), and `hputrain export --merge` turns it into one model folder.

The base model is `--base-model DIR` when given, else adapter_config.json's
`base_model_name_or_path` (which hputrain writes as an absolute path, so that the folder works
from any working directory: checkpoint/export.py). The tokenizer is the adapter folder's own when
it has one (a run's final/ does, with its --chat-template), else the base's.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError

ADAPTER_CONFIG = "adapter_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def is_adapter_folder(folder: Path) -> bool:
    """A folder PEFT's save_pretrained wrote: adapter_config.json (a model folder's config.json
    may sit beside it; the adapter is what the folder is for)."""
    return (folder / ADAPTER_CONFIG).is_file()


def adapter_config(folder: Path, flag: str = "--model") -> dict:
    """adapter_config.json of `folder`, or one line saying why it cannot be read."""
    path = folder / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{flag} {folder}: {ADAPTER_CONFIG} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise InputError(f"{flag} {folder}: {ADAPTER_CONFIG} holds no JSON object")
    return config


def adapter_base(folder: Path, base_model: str | None = None, flag: str = "--model") -> Path:
    """The base model folder of the adapter folder `folder`: `base_model` (--base-model) when
    given, else adapter_config.json's base_model_name_or_path; one line naming both when it is
    not a model folder on this machine."""
    named = base_model or adapter_config(folder, flag).get("base_model_name_or_path")
    base = Path(named).expanduser() if isinstance(named, str) and named else None
    if base is not None and (base / "config.json").is_file():
        return base
    where = (f"--base-model {base_model}" if base_model else
             f"the base model in {folder / ADAPTER_CONFIG} (base_model_name_or_path: {named!r})")
    raise InputError(f"{flag} {folder} is a PEFT adapter folder, and {where} is not a model folder "
                     "(config.json) on this machine: give the base model's folder with "
                     "--base-model DIR")


def tokenizer_folder(folder: Path, base: Path) -> Path:
    """Where an adapter folder's tokenizer comes from: the folder itself when it holds one (a
    run's final/, with the template it trained with), else the base model's folder."""
    return folder if (folder / TOKENIZER_CONFIG).is_file() else base


def tokenizer_source(folder: Path, base_model: str | None = None) -> Path:
    """The folder whose tokenizer files load_model reads for `folder` (a model or adapter folder):
    what the token cache's key is made of."""
    if not is_adapter_folder(folder):
        return folder
    return tokenizer_folder(folder, adapter_base(folder, base_model))


def load_adapter(model, folder: Path, *, trainable: bool = False, flag: str = "--model"):
    """`model` (the base) with the adapters of `folder`, by PEFT's own loader; `trainable`: they
    require grad (training continues on them), else they are frozen for inference."""
    try:
        import peft
    except ImportError:
        raise InputError(f"{flag} {folder} is a PEFT adapter folder: loading it needs peft, which "
                         "is not installed: pip install peft") from None
    try:
        return peft.PeftModel.from_pretrained(model, str(folder), is_trainable=trainable)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"{flag} {folder}: its adapters do not load onto the base model "
                         f"{type(model).__name__}: {first}") from None


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
