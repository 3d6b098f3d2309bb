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

Under fsdp each rank holds a shard of every parameter, so every rank must call `save_model`
(gathering is a collective) and only the main rank writes. A sharded whole model is never held
gathered: its library's writer, given no tensors, writes the folder's other files, and its
weights are gathered, written and dropped one tensor at a time (streamed.py), into the files the
library would write (the same names, split at max_shard_size as transformers splits, with its
index). A transformers model that converts its weights on loading (a mixture of experts' fused
experts) is written in the form on disk that from_pretrained reads, each tensor turned back by
transformers' own reverse conversion as it is gathered (hf_conversion.disk_form). A PEFT model's
adapter goes through the library's writer with the state dict gathered first (host.gathered_state). The
folder is assembled in a hidden `.tmp-NAME` beside it and renamed into place (an existing folder of that name is replaced only then), so a
crash leaves the old folder or the new one, never half of one. Ranks then agree on whether the
write worked, so a failure on the main rank is an error on every rank rather than a hang.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from ..errors import EveryRankError, InputError
from .checks import named_write, write_failure
from .folder import ADAPTER_FILE, MODEL_FILE, finalize, os_reason
from .host import each_once, gathered_state, is_sharded, unwrap_model
from .hf_weights import INDEX_FILE

TOKENIZER_FILE = "tokenizer.json"


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


def _weights_file(model) -> str:
    """The weights file a library's writer writes: PEFT's adapter file, else MODEL_FILE (past
    max_shard_size, transformers' shards are model-K-of-N.safetensors, which its failure does
    not say: MODEL_FILE names them all)."""
    return ADAPTER_FILE if is_peft_model(model) else MODEL_FILE


def _naming(tmp: Path, library_file: str):
    """checks.named_write for a library's writer into `tmp` (a full disk under it): the file
    named is `library_file` where the library's own writer failed (safetensors writes through a
    temporary file it removes, tokenizers in Rust: neither says which), else the newest file in
    `tmp`, the one Python's write() was writing (it names none)."""
    def failed_file(exc: BaseException) -> Path:
        files = [path for path in tmp.iterdir() if path.is_file()] if tmp.is_dir() else []
        newest = max(files, key=lambda path: path.stat().st_mtime_ns, default=None)
        return tmp / library_file if not isinstance(exc, OSError) or newest is None else newest

    return named_write(failed_file)


def _write_folder(model, folder: Path, state: dict, tokenizer, max_shard_size) -> None:
    """Assemble the folder in `.tmp-NAME` and rename it into place (folder.finalize)."""
    tmp = folder.with_name(f".tmp-{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        with _naming(tmp, _weights_file(model)):
            _write_weights(model, tmp, state, max_shard_size)
        _write_tokenizer(tokenizer, tmp)
        finalize(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_tokenizer(tokenizer, tmp: Path) -> None:
    if tokenizer is not None:
        with _naming(tmp, TOKENIZER_FILE):  # the file tokenizers' Rust writer writes
            tokenizer.save_pretrained(str(tmp))


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
    main = group is None or group.is_main
    streamed = streamed_layout(model, max_shard_size)
    if streamed is not None:  # a sharded whole model: gathered and written one tensor at a time
        failure = _saved(lambda: _write_streamed(model, folder, *streamed, tokenizer, main), folder)
    else:
        # a PEFT model's base is frozen and already on disk: only the adapter is gathered
        state = gathered_state(model, trainable_only=is_peft_model(model) and is_sharded(model))
        failure = _saved(lambda: _write_folder(model, folder, state, tokenizer, max_shard_size),
                         folder) if main else None
    if _any_failed(group, failure is not None):  # the main rank says why; the others, no more
        raise failure or EveryRankError(f"Cannot save the model to {folder}: the main process "
                                        "failed to write it (its message says why).")
    return folder


def _saved(write, folder: Path) -> InputError | None:
    """None once `write()` has written the folder, else the one-line InputError saying why."""
    failure = _attempt(write)
    if isinstance(failure, OSError):  # a read-only or full disk, a parent that is a file
        return InputError(f"Cannot save the model to {folder}: {os_reason(failure)}.")
    return failure


# -- a sharded model, streamed ---------------------------------------------------------------------

def streamed_layout(model: torch.nn.Module, max_shard_size) -> tuple[dict[str, dict], object] | None:
    """For a sharded model (fsdp) saved whole, the files its weights go to, {file name: {name:
    tensor}} (sharded, not yet gathered), laid out as its library's writer lays them out: the
    names each once (a tied weight under its first), split past `max_shard_size` by
    huggingface_hub's own splitter, as transformers splits; and `convert(name, tensor)`, what
    each is written as. A transformers model that converts its weights on loading (MoE experts
    fused) is written in the form on disk, each tensor turned back by transformers' own reverse
    conversion (hf_conversion.DiskForm): the index names the tensors on disk. None where the
    library's writer must see the gathered state: a model that is not sharded (it is whole
    already), a PEFT model (its adapter is small), and a conversion that cannot be reverted one
    tensor at a time."""
    from .hf_conversion import DiskForm
    from .streamed import each_once_by_identity

    if not is_sharded(model) or is_peft_model(model):
        return None
    entries = each_once_by_identity(model)
    if not _is_instance(model, "transformers", "PreTrainedModel"):  # one file, as the built-in
        return {MODEL_FILE: entries}, None  # GPT's and safetensors' writers write
    form = DiskForm.of(model, _placeholders(entries))
    if form is None:
        return None
    from huggingface_hub import split_torch_state_dict_into_shards

    # split by the model's tensors: reverting a conversion moves bytes, it adds or drops none
    split = split_torch_state_dict_into_shards(_placeholders(entries), filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    layout = {file: {name: entries[name] for name in names}
              for file, names in split.filename_to_tensors.items()}
    if split.is_sharded:
        weight_map = {disk: file for file, names in split.filename_to_tensors.items()
                      for name in names for disk in form.names[name]}
        layout[INDEX_FILE] = {"metadata": split.metadata, "weight_map": weight_map}
    return layout, form


def _placeholders(entries: dict) -> dict[str, torch.Tensor]:
    """`entries` as meta tensors of their global shapes and dtypes: what a library's planner reads."""
    from .streamed import placeholder

    return {name: placeholder(t) for name, t in entries.items()}


def _write_streamed(model, folder: Path, layout: dict, convert, tokenizer, main: bool) -> None:
    """Every rank: the weights of `layout` gathered one tensor at a time; the main rank writes
    them, the library's own files (its writer given no tensors: config.json,
    generation_config.json) and the tokenizer into `.tmp-NAME`, then renames it into place. A
    failure on the main rank is raised once every gather is done (the others are in them)."""
    from .streamed import write_safetensors

    tmp = folder.with_name(f".tmp-{folder.name}")
    failure = None
    if main:
        failure = _attempt(lambda: _start_folder(model, tmp))
    for file, entries in layout.items():
        if file != INDEX_FILE:
            path = tmp / file if main and failure is None else None
            failure = _attempt(lambda: write_safetensors(path, entries, metadata={"format": "pt"},
                                                         convert=convert)) or failure
    if main and failure is None:
        failure = _attempt(lambda: _end_folder(model, tmp, folder, layout, tokenizer))
    if failure is not None:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise failure


def _attempt(step) -> OSError | InputError | None:
    """The OSError (a failed write, whichever library wrote: checks.write_failure) or
    InputError `step()` raised, or None."""
    try:
        step()
    except InputError as exc:
        return exc
    except Exception as exc:
        if (error := write_failure(exc)) is None:
            raise
        return error
    return None


def _start_folder(model, tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with _naming(tmp, _weights_file(model)):  # the library's files, an empty weights file
        _write_weights(model, tmp, {}, max_shard_size="5GB")


def _end_folder(model, tmp: Path, folder: Path, layout: dict, tokenizer) -> None:
    import json

    if INDEX_FILE in layout:
        (tmp / MODEL_FILE).unlink(missing_ok=True)  # the library's empty one
        index = {"metadata": {"total_parameters": sum(p.numel() for p in model.parameters()),
                              **layout[INDEX_FILE]["metadata"]},
                 "weight_map": layout[INDEX_FILE]["weight_map"]}
        with _naming(tmp, INDEX_FILE):
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _write_tokenizer(tokenizer, tmp)
    finalize(tmp, folder)
