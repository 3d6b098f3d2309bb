"""The defaults `hputrain launch` and `hputrain train` read, written by `hputrain config`'s
questionnaire (cli/config.py, like `accelerate config`).

The file is JSON holding the fields of `LaunchDefaults`. It lives at $HPUTRAIN_CONFIG_FILE, else
$XDG_CONFIG_HOME/hputrain/default_config.json, else ~/.config/hputrain/default_config.json.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .fields import check_choice, unknown_key
from .names import ACCELERATOR_NAMES, EXECUTION_MODES

MIXED_PRECISION = ("no", "bf16")


def defaults_path() -> Path:
    """Where the defaults file is read from and written to."""
    if os.environ.get("HPUTRAIN_CONFIG_FILE"):
        return Path(os.environ["HPUTRAIN_CONFIG_FILE"])
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "hputrain" / "default_config.json"


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(kw_only=True)
class LaunchDefaults:
    accelerator: str = "auto"
    """Device kind: auto, hpu, cuda, mps or cpu."""
    nproc_per_node: int | str = "auto"
    """Processes per node: "auto" (one per device found) or a positive number."""
    num_nodes: int = 1
    """Number of nodes taking part in a run."""
    mixed_precision: str = "no"
    """Either "no" (float32 throughout) or "bf16" (bfloat16 mixed precision)."""
    execution_mode: str = "auto"
    """auto (lazy on Gaudi, eager elsewhere), eager, lazy or compile."""

    def __post_init__(self) -> None:
        check_choice("accelerator", self.accelerator, ACCELERATOR_NAMES)
        if self.nproc_per_node != "auto" and not _positive_int(self.nproc_per_node):
            raise InputError(f"nproc_per_node must be 'auto' or a positive whole number; "
                             f"got {self.nproc_per_node!r}")
        if not _positive_int(self.num_nodes):
            raise InputError(f"num_nodes must be a positive whole number; got {self.num_nodes!r}")
        check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        check_choice("execution_mode", self.execution_mode, EXECUTION_MODES)


def load_defaults(path: str | Path | None = None) -> LaunchDefaults | None:
    """The defaults saved in `path` (default: defaults_path()), or None when there is no file."""
    path = Path(path) if path is not None else defaults_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read defaults file {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"defaults file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"defaults file {path} must hold a JSON object, "
                         f"got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(LaunchDefaults)]
    for key in data:
        if key not in names:
            raise unknown_key(key, names, f"defaults file {path}")
    try:
        return LaunchDefaults(**data)
    except InputError as exc:
        raise InputError(f"defaults file {path}: {exc}") from None


def write_defaults(defaults: LaunchDefaults, path: str | Path | None = None) -> Path:
    """Save `defaults` as JSON; the file is replaced whole, so a crash never leaves half of it."""
    path = Path(path) if path is not None else defaults_path()
    text = json.dumps(dataclasses.asdict(defaults), indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        raise InputError(f"cannot write defaults file {path}: {exc.strerror or exc}") from None
    return path


def training_defaults(defaults: LaunchDefaults) -> dict:
    """The TrainingArguments fields these defaults set (devices only when a number was chosen)."""
    values = {"accelerator": defaults.accelerator, "num_nodes": defaults.num_nodes,
              "bf16": defaults.mixed_precision == "bf16", "execution_mode": defaults.execution_mode}
    if isinstance(defaults.nproc_per_node, int):
        values["devices"] = defaults.nproc_per_node
    return values


# -- the questionnaire -----------------------------------------------------------------------------

# (field, question, choices shown), asked in this order.
