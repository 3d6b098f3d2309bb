"""Full state IO: the whole model and optimizer state, written by rank 0 as MODEL_FILE
(safetensors, each tensor once), EXTRA_STATE_FILE where layers have extra state, and
OPTIMIZER_FILE. Loading uses safetensors and `torch.load(weights_only=True)` only, so a checkpoint
cannot run code, and checks what it loaded against the model and optimizer before using it.

A model with frozen parameters (a PEFT LoRA model's base) is saved as its trainable parameters
only (TRAINABLE_FILE), named in TRAINABLE_RECORD, with their optimizer state. Resuming loads them
into the model built again from the same base, and refuses a checkpoint whose trainable names are
not the model's. A PEFT model's folder also gets adapter_model.safetensors and
adapter_config.json, so `PeftModel.from_pretrained(base, checkpoint)` loads it. ShardedState
writes the same record and adapter files (`write_trainable_files`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import export
from .checks import (check_optimizer_state, check_trainable_names, has_frozen_parameters,
                     named_write, trainable_names)
from .folder import (ADAPTER_FILE, CONFIG_FILE, EXTRA_STATE_FILE, MODEL_FILE, OPTIMIZER_FILE,
                     TRAINABLE_FILE, TRAINABLE_RECORD, fsync, load_pt, reading, torch_save,
                     write_text)
from .host import EXTRA_SUFFIX, model_state, on_cpu
from .state import StateIO


def write_model_config(model: torch.nn.Module, folder: Path) -> None:
    """CONFIG_FILE as the model's library writes it: a transformers config through its own
    `to_json_file` (what `save_pretrained` writes), a dataclass config (the built-in GPT's) as
    the JSON of its fields. A model with neither gets no CONFIG_FILE."""
    config, path = getattr(model, "config", None), folder / CONFIG_FILE
    if hasattr(config, "to_json_file"):
        with named_write(path):
            config.to_json_file(path, use_diff=True)
            fsync(path)
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        write_text(path, json.dumps(dataclasses.asdict(config), indent=2, default=str))


def write_trainable_files(folder: Path, model, tensors: dict[str, torch.Tensor]) -> None:
    """Rank 0, for a model with frozen parameters: TRAINABLE_RECORD naming the trainable
    parameters saved, and for a PEFT model its adapter files from `tensors` (those parameters,
    whole and on the CPU)."""
    write_text(folder / TRAINABLE_RECORD, json.dumps({"parameters": list(tensors)}, indent=2))
    with named_write(folder / ADAPTER_FILE):
        export.write_adapter(model, folder, tensors)


class FullState(StateIO):
    """The whole model and optimizer state, written by rank 0: MODEL_FILE (safetensors, each
    tensor once), or TRAINABLE_FILE and its record for a model with frozen parameters,
    EXTRA_STATE_FILE where layers have extra state, and OPTIMIZER_FILE."""

    shards = False

    @staticmethod
    def found_in(folder: Path) -> bool:
        return (folder / MODEL_FILE).is_file() or (folder / TRAINABLE_FILE).is_file()

    def write(self, folder: Path, *, model, optimizer, rank: int) -> None:
        if rank != 0:
            return
        frozen = has_frozen_parameters(model)
        tensors, extra = model_state(model, trainable_only=frozen)
        file = folder / (TRAINABLE_FILE if frozen else MODEL_FILE)
        with named_write(file):
            save_file(tensors, str(file), metadata={"format": "pt"})
            fsync(file)
        if frozen:
            write_trainable_files(folder, model, tensors)
        if extra:
            with named_write(folder / EXTRA_STATE_FILE):  # torch.save's failure names no file
                torch_save(extra, folder / EXTRA_STATE_FILE)
        if optimizer is not None:
            with named_write(folder / OPTIMIZER_FILE):
                torch_save(on_cpu(optimizer.state_dict()), folder / OPTIMIZER_FILE)

    def load(self, folder: Path, *, model, optimizer, rank: int) -> None:
        if (folder / TRAINABLE_FILE).exists():
            _load_trainable(model, folder)
        else:
            _load_model(model, folder)
        # optimizer.load_state_dict moves its state to each parameter's device
        if optimizer is not None:
            with reading(folder / OPTIMIZER_FILE):
                saved = load_pt(folder / OPTIMIZER_FILE)
                check_optimizer_state(saved, optimizer)
                optimizer.load_state_dict(saved)

    def consolidate(self, path: Path, *, model, rank: int) -> None:
        """MODEL_FILE is already the whole model."""


def _load_model(model: torch.nn.Module, folder: Path) -> None:
    """Load MODEL_FILE into `model`, every tensor of it and nothing else, then the layers' extra
    state from EXTRA_STATE_FILE when the model has any."""
    with reading(folder / MODEL_FILE):
        tensors = load_file(str(folder / MODEL_FILE), device="cpu")
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        # a tied weight is stored once, under its first name: its other names are loaded too
        state = model.state_dict(keep_vars=True)
        loaded = {id(state[name]) for name in tensors if name in state}
        missing = sorted(name for name in missing
                         if not name.endswith(EXTRA_SUFFIX) and id(state[name]) not in loaded)
        if missing or unexpected:
            raise ValueError(f"it does not fit the model (missing: {', '.join(missing) or 'none'}; "
                             f"unexpected: {', '.join(sorted(unexpected)) or 'none'})")
    _load_extra_state(model, folder, state)


def _load_trainable(model: torch.nn.Module, folder: Path) -> None:
    """Load TRAINABLE_FILE once it and its record name exactly the model's trainable parameters."""
    mine = trainable_names(model)
    with reading(folder / TRAINABLE_RECORD):
        record = json.loads((folder / TRAINABLE_RECORD).read_text(encoding="utf-8"))
        check_trainable_names(record.get("parameters") if isinstance(record, dict) else None, mine)
    with reading(folder / TRAINABLE_FILE):
        tensors = load_file(str(folder / TRAINABLE_FILE), device="cpu")
        check_trainable_names(list(tensors), mine)
        model.load_state_dict(tensors, strict=False)  # a shape that differs raises, named
    _load_extra_state(model, folder, model.state_dict(keep_vars=True))


def _load_extra_state(model: torch.nn.Module, folder: Path, state: dict) -> None:
    """The layers' extra state from EXTRA_STATE_FILE, when the model (its `state`) has any."""
    names = {name for name in state if name.endswith(EXTRA_SUFFIX)}
    if names:
        with reading(folder / EXTRA_STATE_FILE):
            extra = load_pt(folder / EXTRA_STATE_FILE)
            if not isinstance(extra, dict) or set(extra) != names:
                found = sorted(map(str, extra)) if isinstance(extra, dict) else type(extra).__name__
                raise ValueError(f"it holds {found}, the model's layers {sorted(names)}")
            model.load_state_dict(extra, strict=False)  # each layer's set_extra_state checks its own
