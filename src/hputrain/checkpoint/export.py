"""What `save_pretrained` writes, for every kind of model the Trainer takes.

`save_model` writes a folder that the model's own library loads back:
- a transformers model (PreTrainedModel): config.json, generation_config.json where the model
  generates, model.safetensors (or shards and model.safetensors.index.json past max_shard_size),
  by the model's own `save_pretrained`, so `AutoModelForCausalLM.from_pretrained` reads it;
- a PEFT model (peft.PeftModel): adapter_model.safetensors and adapter_config.json by PEFT's own
  `save_pretrained`, for `PeftModel.from_pretrained(base, folder)`;
- the built-in GPT: model.safetensors and config.json (`GPT.from_pretrained` reads it);
- any other module: model.safetensors alone, each tensor once.
The tokenizer, when given, is saved beside it with its own `save_pretrained`.

The libraries' writers get the state dict gathered first (host.gathered_state): under fsdp
each rank holds a shard of every parameter, so every rank must call `save_model` (gathering is a
collective) and only the main rank writes. The folder is assembled in a hidden `.tmp-NAME`
beside it and renamed into place (an existing folder of that name is replaced only then), so a
crash leaves the old folder or the new one, never half of one. Ranks then agree on whether the
write worked, so a failure on the main rank is an error on every rank rather than a hang.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from ..errors import InputError
from .folder import MODEL_FILE, finalize, os_reason
from .host import each_once, gathered_state, is_sharded, unwrap_model


def _is_instance(model, module: str, name: str) -> bool:
    """isinstance against a class of an optional library, without importing the library: a model
    of that library means it is imported already."""
    library = sys.modules.get(module)
    return library is not None and isinstance(model, getattr(library, name))


def is_peft_model(model) -> bool:
    return _is_instance(model, "peft", "PeftModel")


def write_adapter(model: torch.nn.Module, folder: Path, state: dict[str, torch.Tensor]) -> None:
    """For a PEFT model, adapter_model.safetensors and adapter_config.json from `state` (names
    as the model's state dict has them; PEFT keeps its adapter's); nothing for other models."""
    if is_peft_model(model):
        _absolute_base_path(model)
        model.save_pretrained(str(folder), state_dict=state, safe_serialization=True,
                              is_main_process=True)


def _absolute_base_path(model) -> None:
    """adapter_config.json's base_model_name_or_path as an absolute path where it names a folder
    on this machine: the relative path typed at training time breaks from any other working
    directory. The base model's own name_or_path (the folder it was loaded from) comes first."""
    loaded_from = getattr(model.get_base_model(), "name_or_path", None)
    for config in model.peft_config.values():
        named = loaded_from or config.base_model_name_or_path
        if isinstance(named, str) and named and Path(named).expanduser().is_dir():
            config.base_model_name_or_path = str(Path(named).expanduser().resolve())


def _write_weights(model: torch.nn.Module, folder: Path, state: dict, max_shard_size) -> None:
    from safetensors.torch import save_file

    from ..models.gpt import GPT

    if is_peft_model(model):
        write_adapter(model, folder, state)
    elif _is_instance(model, "transformers", "PreTrainedModel"):
        model.save_pretrained(str(folder), state_dict=state, max_shard_size=max_shard_size,
                              is_main_process=True)
    elif isinstance(model, GPT):
        model.save_pretrained(folder, state_dict=state)
    else:
        save_file(each_once(state), str(folder / MODEL_FILE), metadata={"format": "pt"})


def _write_folder(model, folder: Path, state: dict, tokenizer, max_shard_size) -> None:
    """Assemble the folder in `.tmp-NAME` and rename it into place (folder.finalize)."""
    tmp = folder.with_name(f".tmp-{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        _write_weights(model, tmp, state, max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        finalize(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_arguments(folder: Path, tokenizer) -> None:
    """Fail on every rank, before any collective, for what each can see is wrong."""
    if folder.exists() and not folder.is_dir():
        raise InputError(f"Cannot save the model to {folder}: it is a file, not a folder; "
                         "choose another output folder.")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise InputError(f"processing_class ({type(tokenizer).__name__}) has no save_pretrained: "
                         "pass a transformers tokenizer or processor, or none.")


def _any_failed(group, failed: bool) -> bool:
    """Every rank learns whether the main rank failed; also the barrier that ends the save."""
    if group is None or not getattr(group, "distributed", False):
        return failed
    return group.host_sum([float(failed)])[0] > 0


def save_model(model: torch.nn.Module, folder, tokenizer=None, group=None,
               max_shard_size: int | str = "5GB") -> Path:
    """Write `model` (and `tokenizer`) to `folder` as `save_pretrained` does (see the module
    docstring) and return the folder. With several processes every rank calls it with the
    ProcessGroup `group`. A folder that cannot be written is an InputError on every rank."""
    folder = Path(folder).expanduser()
    _check_arguments(folder, tokenizer)
    model = unwrap_model(model)
    # a PEFT model's base is frozen and already on disk: only the adapter is gathered
    state = gathered_state(model, trainable_only=is_peft_model(model) and is_sharded(model))
    failure = None
    if group is None or group.is_main:
        try:
            _write_folder(model, folder, state, tokenizer, max_shard_size)
        except OSError as exc:  # a read-only or full disk, a parent that is a file
            failure = InputError(f"Cannot save the model to {folder}: {os_reason(exc)}.")
        except InputError as exc:
            failure = exc
    if _any_failed(group, failure is not None):
        raise failure or InputError(f"Cannot save the model to {folder}: the main process failed "
                                    "to write it (its message says why).")
    return folder
