"""Hugging Face model folders and PEFT adapter folders as users hand them over, and what task
each one's model does: a causal language model, which generates (CAUSAL_LM), or a sequence
classifier, which scores (SEQ_CLS: a reward model).

A model folder says its task in config.json's `architectures` (LlamaForCausalLM,
LlamaForSequenceClassification); an adapter folder (adapter_config.json and the adapters, what
`hputrain train --lora-r` writes into output_dir/final) in adapter_config.json's `task_type`,
and a sequence classifier's adapters carry their trained score head beside them (PEFT's
modules_to_save). The base model of an adapter folder is `--base-model DIR` when given, else
adapter_config.json's `base_model_name_or_path` (which hputrain writes as an absolute path:
export.py). The tokenizer is the adapter folder's own when it has one (a run's final/, with its
--chat-template), else the base's. The recipes, `hputrain export --merge` and the reward
functions (methods/grpo/rewards.py) all read folders through this module.
"""
from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path

from ..errors import InputError
from ..errors import first_line as _first_line

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
WEIGHTS_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
TOKENIZER_CONFIG = "tokenizer_config.json"

CAUSAL_LM, SEQ_CLS = "CAUSAL_LM", "SEQ_CLS"
"""PEFT's task_type names of the two tasks hputrain loads folders for."""

TASK_WORDS = {CAUSAL_LM: "a causal language model", SEQ_CLS: "a sequence classifier"}

_ARCHITECTURE_TASKS = (("ForCausalLM", CAUSAL_LM), ("LMHeadModel", CAUSAL_LM),
                       ("ForSequenceClassification", SEQ_CLS))
"""How transformers names a class by its task (LlamaForCausalLM, GPT2LMHeadModel,
LlamaForSequenceClassification)."""


def is_adapter_folder(folder: Path) -> bool:
    """A folder PEFT's save_pretrained wrote: adapter_config.json (a model folder's config.json
    may sit beside it; the adapter is what the folder is for)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def adapter_config(folder: Path, flag: str = "--model") -> dict:
    """adapter_config.json of `folder`, or one line saying why it cannot be read."""
    path = Path(folder) / ADAPTER_CONFIG
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
             f"the base model in {Path(folder) / ADAPTER_CONFIG} (base_model_name_or_path: {named!r})")
    raise InputError(f"{flag} {folder} is a PEFT adapter folder, and {where} is not a model folder "
                     "(config.json) on this machine: give the base model's folder with "
                     "--base-model DIR")


def tokenizer_folder(folder: Path, base: Path) -> Path:
    """Where an adapter folder's tokenizer comes from: the folder itself when it holds one (a
    run's final/, with the template it trained with), else the base model's folder."""
    return folder if (Path(folder) / TOKENIZER_CONFIG).is_file() else base


def folder_task(folder: Path, flag: str = "--model") -> str | None:
    """CAUSAL_LM or SEQ_CLS: an adapter folder's task_type (PEFT's default, CAUSAL_LM, when it
    names none), or a model folder's, from its config.json's architectures; None when they name
    another task or none."""
    folder = Path(folder)
    if is_adapter_folder(folder):
        task = adapter_config(folder, flag).get("task_type") or CAUSAL_LM
        return task if task in TASK_WORDS else None
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    names = config.get("architectures") if isinstance(config, dict) else None
    tasks = {task for name in names or () if isinstance(name, str)
             for ending, task in _ARCHITECTURE_TASKS if name.endswith(ending)}
    return tasks.pop() if len(tasks) == 1 else None


def architecture(folder: Path) -> str:
    """The model class a folder's config.json names (for messages), or "a model"."""
    try:
        names = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))["architectures"]
        return str(names[0])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return "a model"


def check_task(folder: Path, wanted: str, flag: str = "--model", use: str = "") -> str:
    """`wanted` (CAUSAL_LM or SEQ_CLS) when `folder` holds that task's model or adapters, or a
    folder that does not say; one line when it holds the other task's (`use`: where that
    folder would go instead, for the message)."""
    task = folder_task(folder, flag)
    if task is None or task == wanted:
        return wanted
    what = (f"LoRA adapters of {TASK_WORDS[task]} (task_type {task})" if is_adapter_folder(folder)
            else f"{TASK_WORDS[task]} ({architecture(folder)})")
    does = {SEQ_CLS: "a reward model: it scores text and does not generate",
            CAUSAL_LM: "a language model, without a score head"}[task]
    raise InputError(f"{flag} {folder} holds {what}, {does}; give {TASK_WORDS[wanted]}'s folder"
                     + (f" ({use})" if use else ""))


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files a load of `folder` reads: an adapter folder's adapters, or a model
    folder's model.safetensors or the files its model.safetensors.index.json names (none where
    the index cannot be read: the loader says why)."""
    folder = Path(folder)
    if is_adapter_folder(folder):
        return [folder / ADAPTER_WEIGHTS] if (folder / ADAPTER_WEIGHTS).exists() else []
    try:
        weight_map = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return [folder / WEIGHTS_FILE] if (folder / WEIGHTS_FILE).exists() else []


def check_weight_files(folder: Path, flag: str = "--model", base_model: str | None = None) -> None:
    """One line naming the first of `folder`'s safetensors files (`weight_files`; an adapter
    folder's and then its base's) that is missing or does not open as one (cut short by a copy,
    a download or a full disk): the loaders would end in safetensors' traceback. Opening reads
    the header alone, and safetensors checks there that the file's length is the one its
    tensors cover."""
    from safetensors import safe_open

    files = weight_files(folder)
    if is_adapter_folder(folder):
        files += weight_files(adapter_base(folder, base_model, flag))
    for file in files:
        if not file.is_file():
            raise InputError(f"{flag} {folder}: {file} is missing or not a regular file "
                             f"({INDEX_FILE} names it)")
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as exc:  # safetensors raises its own type (SafetensorError), or OSError
            raise InputError(f"{flag} {folder}: {file} is not a whole safetensors file "
                             f"({_first_line(exc)}): it was cut short or damaged; copy it "
                             "again") from None


def head_labels(folder: Path) -> int | None:
    """The labels of the classification head a sequence classifier's adapter folder saved
    beside its adapters (the rows of its modules_to_save weight), or None when it has none."""
    path = Path(folder) / ADAPTER_WEIGHTS
    heads = adapter_config(folder).get("modules_to_save") or ()
    if not path.is_file() or not heads:
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            for key in handle.keys():
                parts = key.split(".")
                if len(parts) >= 2 and parts[-2] in heads and parts[-1] == "weight":
                    return int(handle.get_slice(key).get_shape()[0])
    except (OSError, ValueError, RuntimeError):
        return None
    return None


def load_adapter(model, folder: Path, *, trainable: bool = False, flag: str = "--model"):
    """`model` (the base) with the adapters of `folder`, by PEFT's own loader; `trainable`: they
    require grad (training continues on them), else they are frozen for inference."""
    try:
        import peft
    except ImportError:
        raise InputError(f"{flag} {folder} is a PEFT adapter folder: loading it needs peft, which "
                         "is not installed: pip install peft") from None
    try:
        with warnings.catch_warnings():  # PEFT reads a name transformers 5 deprecates: not the user's
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return peft.PeftModel.from_pretrained(model, str(folder), is_trainable=trainable)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"{flag} {folder}: its adapters do not load onto the base model "
                         f"{type(model).__name__}: {first}") from None


@contextlib.contextmanager
def quiet_load_report(transformers):
    """transformers' report of weights drawn anew kept quiet: the caller says what it drew."""
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(verbosity)


def load_classifier(folder: Path, labels: int | None = None, config=None):
    """A sequence classifier in float32 from the model folder `folder`, offline, with its
    config's labels, or with `labels` as the base of a classifier's adapters: their head comes
    with them, so transformers' report of a head drawn is not said then."""
    import torch
    import transformers

    if config is None:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    if labels:
        config.num_labels = labels
    with quiet_load_report(transformers) if labels else contextlib.nullcontext():
        return transformers.AutoModelForSequenceClassification.from_pretrained(
            Path(folder).resolve(), config=config, dtype=torch.float32, local_files_only=True)


def load_scorer(folder: Path, flag: str = "--model"):
    """(sequence classifier, the folder its tokenizer comes from) of a model folder, or of an
    adapter folder of a sequence classifier (its base with the adapters and the trained head
    merged in); one line for a folder of another task's model or adapters, or one that does not
    load."""
    folder = Path(folder)
    check_task(folder, SEQ_CLS, flag, "a reward model, as hputrain train --method reward writes it")
    check_weight_files(folder, flag)
    if is_adapter_folder(folder):
        model, tokenizer_from = classifier_adapters(folder, flag=flag)
        return model.merge_and_unload(), tokenizer_from
    try:
        return load_classifier(folder), folder
    except (OSError, ValueError, KeyError, RuntimeError) as exc:  # RuntimeError: mismatched weights
        raise InputError(f"{flag} {folder} cannot be loaded as a sequence classifier: "
                         f"{_first_line(exc)}") from None


def classifier_adapters(folder: Path, base_model: str | None = None, *, trainable: bool = False,
                        flag: str = "--model"):
    """(PEFT model, the folder its tokenizer comes from) of a sequence classifier's adapter
    folder: its base (`base_model`, else the one adapter_config.json names) as a classifier with
    the adapters and their head; `trainable`: training continues on them."""
    base = adapter_base(folder, base_model, flag)
    try:
        classifier = load_classifier(base, head_labels(folder))
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise InputError(f"{flag} {folder}: its base {base} cannot be loaded as a sequence "
                         f"classifier: {_first_line(exc)}") from None
    return load_adapter(classifier, folder, trainable=trainable, flag=flag), tokenizer_folder(folder, base)
