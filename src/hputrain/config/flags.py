"""Command-line flags derived from a configuration dataclass: one flag per field, so files,
flags and the dataclass never drift (see arguments.py)."""
from __future__ import annotations

import argparse
import dataclasses

from . import vocabulary
from .fields import base_type, field_docs


def add_dataclass_flags(parser: argparse.ArgumentParser, cls, group_title: str | None = None) -> None:
    """One flag per field, spelled both --max-steps and --max_steps; booleans get --no-X.
    Defaults are SUPPRESSed so that only the flags a user typed reach `parse_args`."""
    group = parser.add_argument_group(group_title) if group_title else parser
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        kind, optional = base_type(f.type)
        flags = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
        options = {"dest": f.name, "default": argparse.SUPPRESS,
                   "help": f"{docs.get(f.name, '')} (default: {f.default})"}
        if kind is bool and f.name.startswith("no_"):  # argparse would read --no-cuda as cuda=False
            group.add_argument(*flags, action="store_const", const=True, **options)
        elif kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, **options)
        elif kind is list:
            group.add_argument(*flags, nargs="*", metavar="NAME", **options)
        else:
            group.add_argument(*flags, type=_flag_type(kind, optional), metavar=f.name.upper(),
                               **options)
    _add_refused_flags(group, vocabulary.FOREIGN_NAMES.get(cls.__name__, {}))


class _Refused(argparse.Action):
    """A flag from another project's vocabulary (--fp16): one line saying what to use instead."""

    def __init__(self, option_strings, dest, message: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.message = message

    def __call__(self, parser, namespace, values, option_string=None):
        raise argparse.ArgumentError(None, f"{option_string}: {self.message}")


def _add_refused_flags(group, foreign: dict[str, str]) -> None:
    """Hidden flags for `foreign` names, leaving alone those the parser already has."""
    for name, tail in foreign.items():
        flags = [flag for flag in dict.fromkeys((f"--{name.replace('_', '-')}", f"--{name}"))
                 if flag not in group._option_string_actions]
        if flags:
            group.add_argument(*flags, action=_Refused, message=f"{name} {tail}", nargs="?",
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def _flag_type(kind: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse
