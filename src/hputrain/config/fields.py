"""What every settings dataclass of hputrain shares: the error type, reading YAML, JSON and TOML files,
checking values read from files against a field's type, the docstring under each field (for flags
and help), and one-line checks."""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import math
import re
import sys
import textwrap
import types
import typing
from pathlib import Path

from ..errors import InputError, did_you_mean
from .vocabulary import FOREIGN_NAMES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(InputError):
    """A configuration value, key or file is wrong; the message says which and why."""


# -- helpers shared by both dataclasses ------------------------------------------------------------

def unknown_key(key: str, valid: typing.Iterable[str], where: str,
                foreign: dict[str, str] | None = None, kind: str = "key") -> ConfigError:
    """The error for a key that is not a field; `foreign` maps another project's names to what
    to use instead (see vocabulary.py)."""
    if foreign and key in foreign:
        return ConfigError(f"{where}: {key} {foreign[key]}")
    return ConfigError(f"unknown {kind} {key!r} in {where}{did_you_mean(key, valid)}")


def _hint(annotation):
    """A field's annotation as a type (dataclass annotations are strings here)."""
    return eval(annotation, vars(sys.modules[__name__])) if isinstance(annotation, str) else annotation


def base_type(annotation) -> tuple[type, bool]:
    """(the plain type, whether None is allowed) of a field's annotation."""
    hint = _hint(annotation)
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return (typing.get_origin(rest[0]) or rest[0]), len(rest) < len(args)
    return (typing.get_origin(hint) or hint), False


def _coerce(cls, name: str, value, where: str):
    """Check one value read from a file against the field's type."""
    kind, optional = base_type(cls.__dataclass_fields__[name].type)
    if value is None and optional:
        return None
    if isinstance(value, YamlWord):  # YAML 1.1's yes/no/on/off: true/false for a bool field only
        value = value.truth if kind is bool else str(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is list and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return [str(v) for v in value]
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if isinstance(value, str) and str in typing.get_args(_hint(cls.__dataclass_fields__[name].type)):
        return value  # a field such as report_to takes one name or a list of them
    expected = "bool (true or false)" if kind is bool else kind.__name__
    raise ConfigError(f"{name} in {where} must be {expected}"
                      f"{' or null' if optional else ''}, got {value!r}")


def read_mapping(path: str | Path) -> dict:
    """A YAML, JSON or TOML file's top-level table, or a ConfigError naming the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start}: "
                          f"{exc.object[exc.start:exc.start + 1]!r})") from None
    kind = {".toml": "TOML", ".yaml": "YAML", ".yml": "YAML"}.get(path.suffix.lower(), "JSON")
    try:
        data = {"TOML": tomllib.loads, "YAML": _load_yaml, "JSON": json.loads}[kind](text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, ValueError) as exc:
        raise ConfigError(f"config file {path} is not valid {kind}: "
                          f"{' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold an object of settings")
    return data


class YamlWord(str):
    """A YAML scalar that YAML 1.1 reads as a boolean and YAML 1.2 as text (yes, no, on, off, in
    PyYAML's spellings): a string field keeps the word written (`save_strategy: no`), a bool field
    takes its truth (`bf16: yes`), as TRL's YAML 1.1 configs mean it."""

    @property
    def truth(self) -> bool:
        return self.lower() in ("yes", "on")


def _load_yaml(text: str):
    """A YAML document's value, as TRL's and most fine-tuning tools' config files are written.
    PyYAML follows YAML 1.1, where `1e-5` (no dot) is a string and `no`, `on`, `off`, `yes` are
    booleans; YAML 1.2 reads the first as the number it is, and only true and false as booleans.
    This loader does both as YAML 1.2 does; the four words load as YamlWord."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {  # PyYAML's, less YAML 1.1's booleans
        first: [(tag, pattern) for tag, pattern in resolvers if tag != _YAML_BOOL]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(_YAML_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                 list("tTfF"))
    Loader.add_implicit_resolver(_YAML11_WORD, _YAML11_WORDS, list("yYnNoO"))
    Loader.add_constructor(_YAML11_WORD, lambda loader, node: YamlWord(loader.construct_scalar(node)))
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML_FLOAT, list("-+0123456789."))
    try:
        return yaml.load(text, Loader=Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{getattr(exc, 'problem', None) or exc}{where}") from None


_YAML_BOOL, _YAML11_WORD = "tag:yaml.org,2002:bool", "tag:hputrain,2025:yaml11-bool-word"
_YAML11_WORDS = re.compile(r"^(?:yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF)$")
"""The words PyYAML's YAML 1.1 bool resolver takes beside true and false."""
_YAML_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)(?:[eE][-+]?[0-9]+)$")
"""A number with an exponent and no dot (1e-5, 3E+2), which YAML 1.1's float pattern misses."""


def checked_values(cls, data: dict, where: str, ignore=()) -> dict:
    """`data` with every key a field of `cls` and every value of the field's type."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        if key in ignore:
            continue
        if key not in names:
            raise unknown_key(key, names, where, FOREIGN_NAMES.get(cls.__name__))
        values[key] = _coerce(cls, key, value, where)
    return values


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of a dataclass (read from its source, and from its
    dataclass bases' for the fields it inherits; a class made by make_dataclass, which has no
    source, names its own in `__field_docs__`)."""
    docs = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    docs.update(cls.__dict__.get("__field_docs__", {}))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return docs
    body = tree.body[0].body
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_finite(config) -> None:
    """Every float field of a dataclass holds a finite number (inf and nan parse as floats)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        check(not isinstance(value, float) or math.isfinite(value),
              f"{f.name} must be a finite number, got {value}")


def check_choice(name: str, value, choices, foreign: dict[str, str] | None = None) -> None:
    """`value` is one of `choices`; `foreign` maps other projects' values to what to use instead."""
    if foreign and value in foreign:
        raise ConfigError(f"{name}={value!r} {foreign[value]}")
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}"
                          f"{did_you_mean(value, choices, cutoff=0.6)}")


def values_of(cls, options) -> dict:
    """The fields of the dataclass `cls` as `options` (any object that has them) holds them: a
    method's settings read from the recipe's options or a config."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(cls)}


def fields_given(cls, options, none_is_unset: bool = False) -> list[str]:
    """The fields of `cls` that `options` sets away from their defaults (`none_is_unset`: a None
    is not set, where a field shared with another method defaults by method)."""
    defaults = cls()
    return [name for name, value in values_of(cls, options).items()
            if not (none_is_unset and value is None) and value != getattr(defaults, name)]

