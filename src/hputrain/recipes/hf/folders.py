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
--chat-template), else the base's.

This module is the one owner of a folder given as --model, --ref-model, --merge or a reward
model: whether it is there and whole (`model_folder`), what it holds and for which task, its
base, its tokenizer, its adapters and a classifier's head, and the model loaded from it
(`load_model`). The recipes, `hputrain evaluate / generate / export` and the reward functions
(methods/grpo/rewards.py) all read folders through it; an image-text-to-text model's folder is
read by its kind (kinds/vlm/recipe.py) on the same pieces.
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

from ...errors import InputError
from ...errors import first_line as _first_line

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
from ...checkpoint.hf_weights import INDEX_FILE, WEIGHTS_FILE  # noqa: F401  (named from here too)
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


# -- a folder given on the command line, loaded ----------------------------------------------------

def tokenizer_source(folder: Path, base_model: str | None = None) -> Path:
    """The folder whose tokenizer files load_model reads for `folder` (a model or adapter folder):
    what the token cache's key is made of."""
    if not is_adapter_folder(folder):
        return folder
    return tokenizer_folder(folder, adapter_base(folder, base_model))


def model_folder(name: str, *, flag: str = "--model", base_model: str | None = None,
                 weights: bool = True) -> Path:
    """`name` as a model folder on this machine, or a PEFT adapter folder whose base model is one
    (`base_model`, --base-model, else the one its adapter_config.json names); else one line
    saying why it is neither. `weights`: its safetensors files are whole too (not for
    --from-scratch), checked before any process starts."""
    folder = Path(name).expanduser()
    if not folder.is_dir():
        if folder.exists():
            raise InputError(f"{flag} {name} is a file: give the folder holding config.json, the "
                             "weights and the tokenizer files")
        raise InputError(f"{flag} {name} is not a folder on this machine: hputrain train works "
                         f"offline; download it first (huggingface-cli download {name} --local-dir DIR)")
    if is_adapter_folder(folder):
        adapter_base(folder, base_model, flag)  # one line now when the base is not found
    elif not (folder / "config.json").is_file():
        raise InputError(f"{flag} {name} has no config.json: give a folder written by save_pretrained "
                         "(config.json, weights, tokenizer files), or a PEFT adapter folder "
                         "(adapter_config.json)")
    if weights:
        check_weight_files(folder, flag, base_model)
    return folder


def load_model(folder: Path, from_scratch: bool = False, *, base_model: str | None = None,
               trainable: bool = False, merge: bool = False, flag: str = "--model",
               sharded: bool = False, task: str | None = CAUSAL_LM):
    """(model in float32, tokenizer) from `folder`, never from the network. Float32 weights: the
    precision plugin casts per op, and the optimizer keeps full-precision weights. `sharded`
    (fsdp or expert parallelism across processes): the model's parameters stay on the meta
    device, and each rank reads its own shards once fsdp has cut them or its experts once they
    are split (recipes/hf/sharded.py); not for a base whose adapters
    are merged into it, nor for --from-scratch (drawn as before). `task`: the model asked for,
    a causal LM unless said (above); a folder of the other task's model
    or adapters is one line; None takes the folder's own (a sequence classifier's adapters load
    onto a sequence classifier of their head's labels, which `merge` keeps).

    An adapter folder (recipes/hf/adapters.py) is its base model with its adapters loaded by PEFT:
    trainable ones with `trainable` (training continues on them), merged into the weights with
    `merge` (a frozen reference needs no adapters), else frozen; the tokenizer is the folder's
    own when it has one."""
    task = check_task(folder, task, flag) if task is not None else folder_task(folder, flag)
    if not is_adapter_folder(folder):
        return _load_folder(folder, from_scratch, flag, sharded, task=task)
    base = adapter_base(folder, base_model, flag)
    labels = head_labels(folder) if task == SEQ_CLS else None
    model, tokenizer = _load_folder(base, False, flag, sharded and not merge, task=task,
                                    labels=labels)
    if tokenizer_folder(folder, base) == folder:
        tokenizer = _load_tokenizer(folder, flag)
    return with_adapters(model, folder, trainable=trainable, merge=merge, flag=flag), tokenizer


def _load_folder(folder: Path, from_scratch: bool, flag: str, sharded: bool = False, *,
                 task: str | None = CAUSAL_LM, labels: int | None = None):
    """(model, tokenizer) of a model folder (see load_model). Loaded from its absolute path, the
    model's name_or_path, which PEFT writes into adapter_config.json as the base, holds from any
    working directory. `task` SEQ_CLS: a sequence classifier of `labels` (load_classifier)."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # read when huggingface_hub is first imported
    import torch
    import transformers

    from .sharded import meta_model

    transformers.utils.logging.disable_progress_bar()  # the run prints its own progress
    try:
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{flag} {folder}: config.json cannot be read: {_first_line(exc)}") from None
    other = _other_model(config) if task == CAUSAL_LM else None
    if other is not None:
        raise InputError(f"{flag} {folder} holds {other}, not a causal language model: {flag} does "
                         "not take one here")
    tokenizer = _load_tokenizer(folder, flag)
    auto = transformers.AutoModelForCausalLM
    try:
        if task == SEQ_CLS:
            return load_classifier(folder, labels, config), tokenizer
        if sharded and not from_scratch and (model := meta_model(folder, config, flag)) is not None:
            return model, tokenizer
        if from_scratch:
            model = auto.from_config(config, dtype=torch.float32)
        else:
            model = auto.from_pretrained(folder.resolve(), config=config, dtype=torch.float32,
                                         local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InputError(f"{flag} {folder} cannot be loaded as {TASK_WORDS[task or CAUSAL_LM]}: "
                         f"{_first_line(exc)}") from None
    return model, tokenizer


def _other_model(config) -> str | None:
    """What the model of `config` is, when a kind with its own recipe says AutoModelForCausalLM
    does not load it (an image-text-to-text model's words); None: it loads."""
    from ...models.kind import own_recipes

    return next((words for own in own_recipes() if (words := own.refusal(config)) is not None), None)


def check_vocabulary(model, tokenizer, folder: Path, flag: str = "--model") -> None:
    """A tokenizer that gives ids the model has no embedding row for (tokens added and the
    embeddings not resized) is one line here, not an IndexError in the first forward."""
    embeddings = model.get_input_embeddings()
    rows = getattr(embeddings, "num_embeddings", None)
    if rows is not None and len(tokenizer) > rows:
        raise InputError(f"{flag} {folder}: its tokenizer has {len(tokenizer)} tokens and the model "
                         f"embeds {rows}: resize the embeddings to the tokenizer "
                         "(model.resize_token_embeddings(len(tokenizer))) and save the folder again")


def _load_tokenizer(folder: Path, flag: str):
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{flag} {folder}: no tokenizer could be loaded ({_first_line(exc)}): save "
                         "the tokenizer into the folder (tokenizer.save_pretrained)") from None


def with_adapters(model, folder: Path, *, trainable: bool, merge: bool, flag: str):
    """`model` (an adapter folder's base, maybe on the meta device for fsdp's sharded loading)
    with the folder's adapters loaded by PEFT: trainable with `trainable`, merged into the
    weights with `merge`, else frozen. On a meta base PEFT's copy of the values is a no-op: they
    are read again once the adapters are on the meta device (hf_sharded.load_adapter_values)."""
    import warnings

    from ...distributed.fsdp import on_meta
    from .sharded import load_adapter_values

    meta = on_meta(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
        model = load_adapter(model, folder, trainable=trainable, flag=flag)
    if meta:
        load_adapter_values(model, folder)
    return model.merge_and_unload() if merge else model
