"""`hputrain config`: a short questionnaire that writes the defaults `hputrain launch` and
`hputrain train` read (config/defaults.py), like `accelerate config`."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config.defaults import (MIXED_PRECISION, LaunchDefaults, defaults_path, load_defaults,
                               write_defaults)
from ..config.names import ACCELERATOR_NAMES, EXECUTION_MODES
from ..errors import InputError

MAX_TRIES = 3

_QUESTIONS = (
    ("accelerator", "Which device should training run on?", "/".join(ACCELERATOR_NAMES)),
    ("nproc_per_node", "How many processes per node?", "auto = one per device, or a number"),
    ("num_nodes", "How many nodes?", "a number"),
    ("mixed_precision", "Mixed precision?", "/".join(MIXED_PRECISION)),
    ("execution_mode", "Which execution mode?", "/".join(EXECUTION_MODES)),
)


def _parse(answer: str):
    """An answer as it goes into the file: a whole number as int, anything else lower-cased."""
    answer = answer.strip().lower()
    try:
        return int(answer)
    except ValueError:
        return answer


def ask(defaults: LaunchDefaults, read=input, write=print) -> LaunchDefaults:
    """Ask the five questions, starting from `defaults`; an empty answer keeps the value shown."""
    for name, question, choices in _QUESTIONS:
        current = getattr(defaults, name)
        for _ in range(MAX_TRIES):
            try:
                answer = read(f"{question} ({choices}) [{current}]: ")
            except EOFError:
                raise InputError(f"no answer to {question!r}: run `hputrain config --default` "
                                 "to write the defaults without questions") from None
            if not answer.strip():
                break
            try:
                defaults = dataclasses.replace(defaults, **{name: _parse(answer)})
                break
            except InputError as exc:
                reason = str(exc)
                write(reason)
        else:
            raise InputError(f"no valid answer to {question!r} after {MAX_TRIES} tries: {reason}")
    return defaults


def cmd_config(args) -> int:
    path = Path(args.file) if args.file else defaults_path()
    if args.default:
        defaults = LaunchDefaults()
    else:
        defaults = ask(load_defaults(path) or LaunchDefaults())
    print(f"wrote {write_defaults(defaults, path)}")
    return 0


def add_config_parser(subparsers) -> None:
    p = subparsers.add_parser("config", help="questionnaire that writes default launch settings")
    p.add_argument("--default", action="store_true",
                   help="write the built-in defaults without asking anything")
    p.add_argument("--file", metavar="PATH",
                   help="the file to write (default: $HPUTRAIN_CONFIG_FILE, else "
                        "$XDG_CONFIG_HOME/hputrain/default_config.json, "
                        "else ~/.config/hputrain/default_config.json)")
    p.set_defaults(func=cmd_config)
