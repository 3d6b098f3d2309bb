"""Rewards for online training (GRPO): the user's reward functions, called with TRL 1.16's
signature, and reward models, scored as TRL scores them; and the completions log.

A reward function written for TRL runs here unchanged. It is called once per batch of completions
with keywords: `prompts`, `completions` (strings, or `[{"role": "assistant", "content": ...}]`
for conversational prompts), `completion_ids`, every data set column other than the prompt
(one value per completion), `trainer_state` (an object with `global_step`), `log_extra` and
`log_metric`. It returns one number per completion, or None where it has no opinion (NaN: the
other functions decide). A function that takes no `**kwargs` gets only the keywords it names, so
`def f(completions, answer)` works too (TRL would fail on it).

A reward model is a sequence-classification model with one label: prompt and completion are
joined (as text, or through its tokenizer's chat template when the prompt is a conversation),
padded on the right, and the score is the model's one logit.

On the command line an entry is `FILE.py:NAME` (a function in a Python file) or a reward model:
a model folder, or the adapter folder of a LoRA reward model (recipes/hf/folders.py).
Every fault of an entry or of a function's answer is one line naming the function (and the step).
"""
from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import json
import math
import numbers
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...callbacks.writers import json_safe
from ...recipes.hf.folders import ADAPTER_CONFIG, is_adapter_folder, load_scorer
from ...errors import InputError

FIXED_KEYS = ("prompt", "completion", "completion_ids")
"""Columns TRL never passes to a reward function as data set columns (it passes its own)."""

TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""The keywords every reward function gets besides the data set's columns."""

COMPLETIONS_FILE = "completions.jsonl"
"""The completions log's name in output_dir."""


@dataclass
class RewardState:
    """What a reward function sees as `trainer_state` (TRL passes its TrainerState): enough for
    reward shaping by progress, global_step / max_steps (max_steps: the run's steps; 0 outside
    training, TRL's default)."""
    global_step: int
    max_steps: int = 0


def conversational(prompt) -> bool:
    """Whether `prompt` is a conversation: a list of messages with a "role" (TRL's test)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def completion_for(prompt, text: str):
    """The completion as reward functions receive it: `text`, or TRL's one assistant message when
    the prompt is a conversation."""
    return [{"role": "assistant", "content": text}] if conversational(prompt) else text


def per_completion_columns(rows: list[dict], generations: int) -> dict[str, list]:
    """The data set columns of `rows` (one row per prompt) repeated for each of its `generations`
    completions, in TRL's order (a prompt's completions next to each other)."""
    keys = [key for key in (rows[0] if rows else {}) if key not in FIXED_KEYS]
    return {key: [row[key] for row in rows for _ in range(generations)] for key in keys}


# -- entries: callables, models, command-line strings ---------------------------------------------

def _load_function(entry: str) -> Callable:
    """NAME from the Python file in `entry` ("FILE.py:NAME"), imported by path."""
    file, _, name = entry.rpartition(":")
    path = Path(file).expanduser()
    if not name or not path.is_file():
        raise InputError(f"reward function {entry}: {file or entry} is not a file (give FILE.py:NAME "
                         f"or a reward model folder)")
    module_name = f"hputrain_reward_{path.stem}_{abs(hash(str(path.resolve()))):x}"
    module = sys.modules.get(module_name) or _import_file(path, module_name, entry)
    if not hasattr(module, name):
        raise InputError(f"reward function {entry}: {file} has no {name!r}")
    function = getattr(module, name)
    if not callable(function):
        raise InputError(f"reward function {entry}: {name} is a {type(function).__name__}, not a function")
    return function


def _import_file(path: Path, module_name: str, entry: str):
    """The module that the Python file at `path` makes, registered under `module_name` (two
    entries from one file share one import)."""
    file = entry.rpartition(":")[0]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"reward function {entry}: {file} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look their module up here
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # so that the file may import its neighbours
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - any failure of user code is one line
        sys.modules.pop(module_name, None)
        raise InputError(f"reward function {entry}: {file} does not import: {_one_line(error)}") from None
    finally:
        if folder in sys.path:  # the file's own code may have taken it out
            sys.path.remove(folder)
    return module


def _load_model(folder: Path, entry: str):
    """The sequence classifier in `folder` (a model folder, or a classifier's adapter folder,
    merged: recipes/hf/folders.py) with its tokenizer; refuses more than one label."""
    import transformers

    where = f"reward model {entry}:"
    if not (folder / "config.json").is_file() and not is_adapter_folder(folder):
        raise InputError(f"{where} no config.json nor {ADAPTER_CONFIG} in the folder (a model or "
                         "adapters, as save_pretrained writes them)")
    model, tokenizer_from = load_scorer(folder, flag="reward model")
    labels = model.config.num_labels
    if labels != 1:
        raise InputError(f"{where} has {labels} labels; a reward model has one score (num_labels=1)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
    except Exception as error:  # noqa: BLE001
        raise InputError(f"{where} its tokenizer cannot be loaded: {_one_line(error)}") from None
    model.config._name_or_path = str(folder)  # its name in the metrics: the folder given
    return model, tokenizer


def _model_with_tokenizer(model: nn.Module, tokenizer):
    """`tokenizer` (or the one saved with the model), padding with end-of-sequence when it has no
    pad token; the model told which id pads, since it scores the last token that is not padding."""
    if tokenizer is None:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(_model_id(model))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    config.pad_token_id = tokenizer.pad_token_id
    return tokenizer


def _model_id(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "_name_or_path", "") or ""


def _name_of(function) -> str:
    """TRL's name: the model's id after its last "/", a function's __name__ (through partials),
    or a callable object's class name."""
    if isinstance(function, nn.Module):
        return _model_id(function).split("/")[-1]
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__name__", type(function).__name__)


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _resolve(entry) -> tuple[Any, Any]:
    """(function or model, tokenizer or None) for one entry."""
    if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], nn.Module):
        return entry
    if isinstance(entry, nn.Module) or callable(entry):
        return entry, None
    if isinstance(entry, (str, os.PathLike)):
        text = os.fspath(entry)
        folder = Path(text.rstrip("/\\") or text).expanduser()
        if folder.is_dir():
            return _load_model(folder, text)
        if ":" in text:
            return _load_function(text), None
        raise InputError(f"reward function {text}: neither FILE.py:NAME nor a reward model folder")
    raise InputError(f"reward function {entry!r}: a {type(entry).__name__} is neither a function, "
                     f"a model, FILE.py:NAME nor a model folder")


def _keywords_taken(function) -> set[str] | None:
    """The keywords `function` accepts, or None when it takes any (**kwargs) or cannot be read."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _keywords_required(function) -> list[str]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty]


# -- the rewards of a batch -----------------------------------------------------------------------

class RewardFunctions:
    """The reward functions and models of a run: `names` (TRL's), `weights` ([F] float32, ones
    unless given) and, called on a batch of completions, their rewards [N, F] (NaN: no reward)."""

    def __init__(self, entries, weights=None, *, device="cpu", chat_template_kwargs=None,
                 batch_size: int = 32):
        entries = list(entries) if isinstance(entries, (list, tuple)) and not _is_model_pair(entries) \
            else [entries]
        if not entries:
            raise InputError("no reward function given (a FILE.py:NAME or a reward model folder)")
        resolved = [_resolve(entry) for entry in entries]
        self.functions = [function for function, _ in resolved]
        # TRL's names, made unique (final, final_2: two folders named alike keep their metrics)
        self.names = _unique_keys([], [_name_of(function) for function in self.functions])
        self.device = torch.device(device)
        self.tokenizers = [_model_with_tokenizer(f, t) if isinstance(f, nn.Module) else None
                           for f, t in resolved]
        for function in self.functions:
            if isinstance(function, nn.Module):
                function.to(self.device).eval()
        self.weights = _weights(weights, self.names)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.batch_size = batch_size
        self._taken = [None if isinstance(f, nn.Module) else _keywords_taken(f) for f in self.functions]
        self._required = [[] if isinstance(f, nn.Module) else _keywords_required(f) for f in self.functions]
        self.extra: dict[str, list] = {}
        self.metrics: dict[str, list[float]] = {}

    def __call__(self, prompts: list, completions: list, completion_ids: list, columns: dict[str, list],
                 step: int, *, state=None) -> torch.Tensor:
        """[N, F] float32 on the host: each function's reward for each completion (NaN for None).
        `columns`: the data set's other columns, one value per completion (per_completion_columns)."""
        n = len(prompts)
        for key, values in columns.items():
            if len(values) != n:
                raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
        keywords = {key: values for key, values in columns.items() if key not in FIXED_KEYS}
        # What TRL passes besides the columns: the state for reward shaping, and two loggers.
        keywords |= dict(trainer_state=state if state is not None else RewardState(step),
                         log_extra=self._log_extra, log_metric=self._log_metric)
        rewards = torch.full((n, len(self.functions)), math.nan, dtype=torch.float32)
        if n == 0:
            return rewards
        for i, function in enumerate(self.functions):
            if isinstance(function, nn.Module):
                rewards[:, i] = self._score(function, self.tokenizers[i], prompts, completions)
            else:
                chosen = self._arguments(i, dict(keywords, prompts=prompts, completions=completions,
                                                 completion_ids=completion_ids))
                rewards[:, i] = self._call(i, chosen, n, step)
        return rewards

    def take_logs(self) -> tuple[dict[str, list], dict[str, list[float]]]:
        """What the functions logged through `log_extra` (columns) and `log_metric` (scalars)
        since the last call, handed over and forgotten."""
        extra, metrics = self.extra, self.metrics
        self.extra, self.metrics = {}, {}
        return extra, metrics

    def _log_extra(self, column: str, values: list) -> None:
        self.extra.setdefault(column, []).extend(values)

    def _log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(value)

    def _arguments(self, i: int, keywords: dict) -> dict:
        """The keywords function i accepts (all of them when it takes **kwargs, as under TRL)."""
        taken = self._taken[i]
        if taken is None:
            return keywords
        missing = [name for name in self._required[i] if name not in keywords]
        if missing:
            columns = [k for k in keywords if k not in TRL_KEYWORDS]
            raise InputError(f"reward function {self.names[i]} needs {missing[0]!r}, which is not a "
                             f"column of the data set (its columns: {', '.join(columns) or 'none'})")
        return {key: value for key, value in keywords.items() if key in taken}

    def _call(self, i: int, keywords: dict, n: int, step: int) -> torch.Tensor:
        """Function i's answer as n float32 rewards; any fault is one line naming it and the step."""
        name = self.names[i]
        try:
            output = self.functions[i](**keywords)
            if inspect.isawaitable(output):  # an async reward function, as TRL allows
                output = asyncio.run(_awaited(output))
        except Exception as error:  # noqa: BLE001 - user code: one line, not a traceback
            raise InputError(f"reward function {name} raised {_one_line(error)} at step {step}") from None
        if isinstance(output, (str, bytes, dict)) or not hasattr(output, "__iter__"):
            raise InputError(f"reward function {name} returned a {type(output).__name__} at step {step}, "
                             f"not a list of {n} rewards")
        output = list(output)
        if len(output) != n:
            raise InputError(f"reward function {name} returned {len(output)} rewards for {n} completions "
                             f"at step {step} (one per completion)")
        return torch.tensor([_number(value, name, j, step) for j, value in enumerate(output)],
                            dtype=torch.float32)

    def _score(self, model: nn.Module, tokenizer, prompts: list, completions: list) -> torch.Tensor:
        """The model's one logit for each prompt + completion, in batches of `batch_size`."""
        if conversational(prompts[0]):
            if getattr(tokenizer, "chat_template", None) is None:
                raise InputError(f"reward model {_name_of(model)}: the prompts are conversations and its "
                                 f"tokenizer has no chat template")
            texts = [tokenizer.apply_chat_template(p + (c if isinstance(c, list) else completion_for(p, c)),
                                                   tokenize=False, **self.chat_template_kwargs)
                     for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        scores = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                batch = tokenizer(text=texts[start:start + self.batch_size], return_tensors="pt",
                                  padding=True, padding_side="right", add_special_tokens=False)
                scores.append(model(**batch.to(self.device)).logits[:, 0].float().cpu())
        return torch.cat(scores)


def _is_model_pair(entries) -> bool:
    return isinstance(entries, tuple) and len(entries) == 2 and isinstance(entries[0], nn.Module)


async def _awaited(awaitable):
    return await awaitable


def _number(value, name: str, index: int, step: int) -> float:
    """A reward as TRL's torch.tensor(..., float32) takes it: a real number (a bool is 0 or 1), a
    0-d tensor or array, or None (NaN)."""
    if value is None:
        return math.nan
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item") and isinstance(value.item(), numbers.Real):
        return float(value.item())
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    raise InputError(f"reward function {name} returned {shown} ({type(value).__name__}) for completion "
                     f"{index} at step {step}; a reward is a number or None")


def _weights(weights, names: list[str]) -> torch.Tensor:
    if weights is None:
        return torch.ones(len(names), dtype=torch.float32)
    weights = list(weights)
    if len(weights) != len(names):
        raise InputError(f"{len(weights)} reward weights for {len(names)} reward functions "
                         f"({', '.join(names)}): give one weight per function")
    try:
        return torch.tensor([float(w) for w in weights], dtype=torch.float32)
    except (TypeError, ValueError):
        raise InputError(f"reward weights {weights}: each must be a number") from None


# -- the completions log --------------------------------------------------------------------------

class CompletionsLog:
    """output_dir/completions.jsonl: one JSON line per completion (step, prompt, completion, its
    token count, each function's reward, the weighted reward and the advantage), appended and
    flushed at each write, so a resumed run adds to what is there."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def write(self, step: int, prompts: list, completions: list, completion_tokens, rewards_per_func,
              names: list[str], weights, advantages, extra: dict[str, list] | None = None) -> None:
        """Appends one line per completion; NaN is written as null, and so is the reward of a
        completion no function scored (and infinities, which JSON lacks). `extra`: columns from log_extra, one value per completion."""
        rewards = torch.as_tensor(rewards_per_func, dtype=torch.float32).cpu()
        weighted = rewards * torch.as_tensor(weights, dtype=torch.float32).cpu()
        totals = weighted.nansum(dim=1)
        totals[rewards.isnan().all(dim=1)] = math.nan
        advantages = torch.as_tensor(advantages, dtype=torch.float32).cpu().tolist()
        tokens = torch.as_tensor(completion_tokens).tolist()
        extra = extra or {}
        keys = _unique_keys(["step", "prompt", "completion", "completion_tokens", "reward", "advantage"],
                            list(names) + list(extra))
        lines = []
        for j, (prompt, completion) in enumerate(zip(prompts, completions)):
            row = dict(step=int(step), prompt=prompt, completion=completion, completion_tokens=int(tokens[j]))
            row |= {keys[i]: rewards[j, i].item() for i in range(len(names))}
            row |= {keys[len(names) + k]: values[j] for k, values in enumerate(extra.values())}
            row |= dict(reward=totals[j].item(), advantage=advantages[j])
            lines.append(json.dumps(json_safe(row), allow_nan=False, default=str) + "\n")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.writelines(lines)
            handle.flush()


def _unique_keys(taken: list[str], names: list[str]) -> list[str]:
    """A JSON key for each name: the name itself, or NAME_2, NAME_3 ... where a fixed field or an
    earlier name already holds it (two functions may share a name, or be called "reward")."""
    used, keys = set(taken), []
    for name in names:
        key, count = name, 1
        while key in used:
            count += 1
            key = f"{name}_{count}"
        used.add(key)
        keys.append(key)
    return keys
