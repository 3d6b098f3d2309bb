"""What a checkpoint's files must hold before they are loaded: the trainer's state in
trainer_state.json, and an optimizer state that fits the optimizer's parameters; and what a
failed write of one was (`write_failure`).

A crafted file that `torch.load(weights_only=True)` accepts can still hold tensors of the wrong
shape, which a fused optimizer step would write through without looking. Each check raises
ValueError with the reason; checkpoint.py names the file and makes it one line.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import pickle
import re
from pathlib import Path

import torch
from safetensors import SafetensorError

# Sentences of torch's weights_only messages that advise rather than explain, whatever the
# version's wording. They are never shown: one says to load with weights_only=False, which runs
# whatever code the file holds.
_ADVICE = ("weights only load failed", "in pytorch 2.6", "weights_only` set to `false`",
           "weights_only=false", "re-running", "arbitrary code", "trusted source", "if you trust",
           "trust the source", "can still be loaded", "alternatively, to load", "please use",
           "please file an issue", "check the documentation", "add_safe_globals([")


def load_failure_reason(exc: BaseException) -> str:
    """One line saying why a file did not load: torch's weights_only message is a page of advice
    around one sentence of reason ("unsupported GLOBAL posix.system"); only the reason is kept."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # torch puts terminal bold in it
    text = text.replace("WeightsUnpickler error:", "\n")  # what follows is the reason
    sentences = (part.strip() for part in re.split(r"(?<=\.)\s+|\n", text))
    kept = " ".join(part for part in sentences
                    if part and not any(words in part.lower() for words in _ADVICE))
    text = " ".join(kept.split()).rstrip(".")
    if isinstance(exc, pickle.UnpicklingError):
        text = (f"torch.load(weights_only=True) refused it ({text})" if text else
                "torch.load(weights_only=True) refused it: it holds more than tensors and plain data")
    text = text or type(exc).__name__
    return text if len(text) <= 300 else text[:294] + " (...)"


_TORCH_WRITER = ("inline_container.cc", "PytorchStreamWriter")
"""Words of the RuntimeError torch's zip writer (torch.save) raises when a write of it fails."""


def write_failure(exc: BaseException) -> OSError | None:
    """The system's error under a failed write, whichever library wrote: an OSError itself;
    torch.save's RuntimeError ("[enforce fail at inline_container.cc:672] . unexpected pos"),
    raised around the OSError of the file object's write that failed (a full disk), or with
    none (EIO, then); safetensors' SafetensorError and tokenizers' Exception, which carry the
    system's words and number ("File too large (os error 27)"). None for any other error, which
    is no failed write. The OSError names a file where the failed call did (open does, write
    does not)."""
    text = (exc.strerror or "") if isinstance(exc, OSError) else str(exc)
    number = re.search(r"\(os error (\d+)\)", text)  # Rust's words, as folder.writing keeps them
    if number is not None:
        return OSError(int(number.group(1)), os.strerror(int(number.group(1))),
                       getattr(exc, "filename", None))
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, SafetensorError):  # safetensors' own words, without the system's number
        return OSError(errno.EIO, " ".join(text.split()))
    if isinstance(exc, RuntimeError) and any(words in text for words in _TORCH_WRITER):
        cause = exc.__cause__ or exc.__context__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            return OSError(cause.errno, cause.strerror, cause.filename)
        return OSError(errno.EIO, "torch.save stopped short of the whole file (a full disk?)")
    return None


@contextlib.contextmanager
def named_write(file):
    """A failed write in the block (`write_failure`) raised as an OSError naming `file` where it
    names none (a failed write() names no path), for `save_checkpoint` and export to make one
    line; any other error as it is. `file` may be a function of the error, for a writer that
    does not say which of its files failed."""
    try:
        yield
    except Exception as exc:
        error = write_failure(exc)
        if error is None:
            raise
        if not error.filename and error.strerror is not None:  # OSError("...") would print "[Errno None]"
            error.filename = str(file(exc) if callable(file) else file)
        if error is exc:
            raise
        raise error from exc


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A finite int or float (JSON's NaN and Infinity, and booleans, are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The trainer's fields of STATE_FILE: what each must be when present ("step" always is).
_STATE_FIELDS = {
    "step": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "global_step": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "epoch": (lambda v: _is_real(v) and v >= 0, "a finite number >= 0"),
    "world_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    "seed": (lambda v: _is_int(v) and -2**63 <= v < 2**64, "a 64-bit integer"),
    "global_batch_size": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
}


def check_trainer_state(state, folder: Path) -> None:
    """Raise ValueError unless `state` holds a step that fits the folder's name, and the
    trainer's fields have their types and ranges."""
    if not isinstance(state, dict):
        raise ValueError("it does not hold a JSON object")
    if "step" not in state:
        raise ValueError("it has no step")
    for name, (fits, what) in _STATE_FIELDS.items():
        if name in state and not fits(state[name]):
            raise ValueError(f"{name} must be {what}, not {json.dumps(state[name])[:40]}")
    if state.get("global_step", state["step"]) != state["step"]:
        raise ValueError(f"global_step {state['global_step']} is not its step {state['step']}")
    named = re.fullmatch(r"checkpoint-(\d+)", folder.name)
    if named and int(named.group(1)) != state["step"]:
        raise ValueError(f"its step {state['step']} is not the folder's {folder.name}")


def _same_kind(value, mine) -> bool:
    """Whether a saved hyper-parameter is of the kind of the optimizer's own: a flag, a finite
    number, a tuple of them (betas)."""
    if isinstance(mine, bool) or mine is None:
        return isinstance(value, bool) or value is None
    if isinstance(mine, (int, float)):
        return _is_real(value)
    if isinstance(mine, (tuple, list)):
        return (isinstance(value, (tuple, list)) and len(value) == len(mine)
                and all(map(_is_real, value)))
    return type(value) is type(mine)


def _check_group(index: int, saved, group: dict) -> list:
    """The parameter numbers of saved parameter group `index`, once checked against the
    optimizer's `group`: as many parameters, and its hyper-parameters (load_state_dict takes
    them from the file) of the same kinds. A missing flag is fine: the optimizer's default fills it."""
    numbers = saved.get("params") if isinstance(saved, dict) else None
    if not isinstance(numbers, list) or not all(map(_is_int, numbers)):
        raise ValueError(f"parameter group {index} has no list of parameter numbers")
    if len(numbers) != len(group["params"]):
        raise ValueError(f"parameter group {index} has {len(numbers)} parameters, the "
                         f"optimizer's {len(group['params'])}")
    check_param_group_kinds(index, saved, group)
    return numbers


def check_param_group_kinds(index: int, saved, group: dict) -> None:
    """Raise ValueError unless saved parameter group `index`'s hyper-parameters are of the kinds
    of the optimizer's `group` (a missing flag is fine: the optimizer's default fills it)."""
    if not isinstance(saved, dict):
        raise ValueError(f"parameter group {index} is not a dict")
    for key, mine in group.items():
        if key == "params" or (key not in saved and (isinstance(mine, bool) or mine is None)):
            continue
        if not _same_kind(saved.get(key), mine):
            raise ValueError(f"parameter group {index}'s {key} is {str(saved.get(key))[:40]}, "
                             f"where the optimizer has {mine}")


def _check_step(index: int, value) -> None:
    step = value
    if isinstance(value, torch.Tensor):  # one real number, or it does not count
        real = value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool
        step = value.item() if real else None
    if not _is_real(step) or step < 0:
        raise ValueError(f"parameter {index}'s step must be a finite number >= 0, not "
                         f"{str(value)[:40]}")


def _check_param_state(index: int, entry, param: torch.Tensor, required: set) -> None:
    """Raise ValueError unless `entry`, the saved state of `param`, has its shape and kind."""
    if not isinstance(entry, dict):
        raise ValueError(f"the state of parameter {index} is not a dict")
    if missing := sorted(required - set(entry)):
        raise ValueError(f"the state of parameter {index} lacks {', '.join(missing)}")
    for name, value in entry.items():
        if name == "step":
            _check_step(index, value)
        elif isinstance(value, torch.Tensor):
            kind_fits = (value.is_floating_point() if param.is_floating_point()
                         else value.dtype == param.dtype)
            if value.layout != torch.strided or value.shape != param.shape or not kind_fits:
                raise ValueError(f"parameter {index}'s {name} is {value.dtype} of shape "
                                 f"{tuple(value.shape)}, the parameter {param.dtype} of shape "
                                 f"{tuple(param.shape)}")
            if not (value.is_contiguous() or value.stride() == param.stride()):
                # e.g. one number expanded to the shape: a fused step writes every element
                raise ValueError(f"parameter {index}'s {name} has strides {value.stride()}, "
                                 f"neither dense nor the parameter's {param.stride()}")
        elif value is not None and not _is_real(value):
            raise ValueError(f"parameter {index}'s {name} is a {type(value).__name__}")


def check_optimizer_state(saved, optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless `saved` fits `optimizer`'s parameters: as many groups and
    parameters, each state tensor with its parameter's shape and kind of dtype, a finite step
    >= 0. Fused kernels write through these tensors without looking at their shapes."""
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
            and isinstance(saved.get("param_groups"), list)):
        raise ValueError("it is not an optimizer's state (a dict of state and param_groups)")
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(groups):
        raise ValueError(f"it has {len(saved['param_groups'])} parameter groups, the optimizer "
                         f"{len(groups)}")
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    params, required = {}, {}  # parameter number -> the parameter; the state keys its step reads
    for index, (theirs, mine) in enumerate(zip(saved["param_groups"], groups)):
        numbers = _check_group(index, theirs, mine)
        needs = {"step", "exp_avg", "exp_avg_sq"} if adam else set()
        needs |= {"max_exp_avg_sq"} if adam and theirs.get("amsgrad") else set()
        for number, param in zip(numbers, mine["params"]):
            params[number], required[number] = param, needs
    if len(params) != sum(len(group["params"]) for group in groups):
        raise ValueError("its parameter groups list a parameter number twice")
    for number, entry in saved["state"].items():
        if number not in params:
            raise ValueError(f"it holds state for parameter {str(number)[:40]}, which no group lists")
        _check_param_state(number, entry, params[number], required[number])


# -- the trainable parameters of a model with a frozen base (LoRA) --------------------------------
def has_frozen_parameters(model: torch.nn.Module) -> bool:
    """Whether some parameter is frozen (a PEFT model's base): its checkpoints then hold only the
    trainable parameters, and the frozen ones come from the model as built again for resuming."""
    return any(not param.requires_grad for param in model.parameters())


def trainable_names(model: torch.nn.Module) -> list[str]:
    """The state-dict names of the trainable parameters, a tied one under its first name only."""
    seen, names = set(), []
    for name, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter) and value.requires_grad and id(value) not in seen:
            seen.add(id(value))
            names.append(name)
    return names


def check_trainable_names(saved, mine: list[str]) -> None:
    """Raise ValueError unless the checkpoint's trainable parameter names are the model's: a
    checkpoint of another adapter (other target modules, another rank's names) is refused."""
    if not isinstance(saved, list) or not all(isinstance(name, str) for name in saved):
        raise ValueError("it does not hold a list of parameter names")
    missing, unexpected = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or unexpected:  # the names are long: the first of each tells which adapter
        raise ValueError(f"its trainable parameters are not the model's: {len(missing)} missing "
                         f"({missing[0] if missing else 'none'}), {len(unexpected)} unexpected "
                         f"({unexpected[0] if unexpected else 'none'}); build the model as the "
                         "run that saved it did (same base, same adapter)")
