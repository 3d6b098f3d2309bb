"""`hputrain export --merge ADAPTER --output DIR`: a PEFT adapter folder (a LoRA run's final/)
merged into its base model (PEFT's merge_and_unload) and written as save_pretrained writes a model
(config.json, model.safetensors, the tokenizer), for servers and tools that want one model
folder. It is written in the dtype the base's config.json names (merged in float32 first), into
a temporary folder renamed into place (checkpoint/export.py's save_model). The adapters of a
sequence classifier (a LoRA reward model, task_type SEQ_CLS) merge into a sequence classifier
that keeps their trained score head (recipes/hf/folders.py); an image-text-to-text model's
into its AutoModelForImageTextToText class, written with its processor (the kind's recipe,
models/kind.py: kinds/vlm/run.py)."""
from __future__ import annotations

import json
from pathlib import Path

from ...checkpoint.export import save_model
from .folders import ADAPTER_CONFIG, adapter_base, is_adapter_folder, load_model, model_folder
from ...errors import InputError


def export_merged(adapter: str, output: str, base_model: str | None = None) -> Path:
    """The adapter folder `adapter` merged into its base (PEFT's merge_and_unload), written to
    `output` as save_pretrained writes a model (config.json, model.safetensors, the tokenizer),
    in the dtype the base's config.json names; returns the folder."""
    folder = model_folder(adapter, flag="--merge", base_model=base_model)
    if not is_adapter_folder(folder):
        raise InputError(f"--merge {adapter} is a model folder already (config.json, no "
                         f"{ADAPTER_CONFIG}): there are no adapters to merge")
    base = adapter_base(folder, base_model, "--merge")
    target = Path(output).expanduser()
    if target.resolve() in (folder.resolve(), base.resolve()):
        raise InputError(f"--output {output} is the folder merged from: choose a new folder")
    # image-text-to-text, written with its processor (a folder without one: the causal-LM path)
    from ...models.kind import own_recipes

    own = next((own for own in own_recipes() if own.merges(folder, base_model)), None)
    if own is not None:  # the kind's own way (kinds/vlm: with its processor)
        merged, tokenizer = own.merged(folder, base_model)
    else:
        merged, tokenizer = load_model(folder, base_model=base_model, flag="--merge", merge=True,
                                       task=None)  # its own task: a classifier keeps its head
    dtype = _stored_dtype(base)
    if dtype is not None:  # loaded in float32 to merge; written as the base is stored
        merged = merged.to(dtype)
        merged.config.dtype = dtype
    return save_model(merged, target, tokenizer)


def _stored_dtype(base: Path):
    """The floating-point dtype the base's config.json names (dtype, formerly torch_dtype)."""
    import torch

    try:
        config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None
