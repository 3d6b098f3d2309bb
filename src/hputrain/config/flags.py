"""Command-line flags derived from a configuration dataclass: one flag per field, so files,
flags and the dataclass never drift (see arguments.py)."""
from __future__ import annotations

import argparse
import dataclasses

from . import vocabulary
from .fields import base_type, field_docs


def add_dataclass_flags(parser: argparse.ArgumentParser, cls,
                        groups: str | tuple[tuple[str, frozenset[str] | None], ...] | None = None
                        ) -> None:
    """One flag per field, spelled --max-steps (and --max_steps, left out of --help); booleans get
    --no-X. --help lists the flags under `groups`, in its order: a title for them all, or
    (title, field names) pairs, a field going under the first that names it and under the one
    whose names are None if none does (no groups: the parser's own list). Defaults are SUPPRESSed so that only the flags a user
    typed reach `parse_args`."""
    if not isinstance(groups, tuple):
        groups = ((groups, None),)
    titled = [(parser.add_argument_group(title) if title else parser, names) for title, names in groups]
    rest = next(group for group, names in titled if names is None)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        group = next((g for g, names in titled if names is not None and f.name in names), rest)
        text = f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%")
        _add_field_flag(group, f, [f"--{f.name.replace('_', '-')}"], text)
        if "_" in f.name:  # the Hugging Face spelling works, without a second line in --help
            _add_field_flag(group, f, [f"--{f.name}"], argparse.SUPPRESS)
    _add_refused_flags(rest, vocabulary.FOREIGN_NAMES.get(cls.__name__, {}))


def _add_field_flag(group, f, flags: list[str], text: str) -> None:
    kind, optional = base_type(f.type)
    options = {"dest": f.name, "default": argparse.SUPPRESS, "help": text}
    if kind is bool and f.name.startswith("no_"):  # argparse would read --no-cuda as cuda=False
        group.add_argument(*flags, action="store_const", const=True, **options)
    elif kind is bool:
        group.add_argument(*flags, action=argparse.BooleanOptionalAction, **options)
    elif kind is list:
        group.add_argument(*flags, nargs="*", metavar="NAME", **options)
    else:
        group.add_argument(*flags, type=_flag_type(kind, optional), metavar=f.name.upper(),
                           **options)


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
