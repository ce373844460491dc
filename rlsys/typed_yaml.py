"""Strict conversion between YAML and a tree of dataclasses.

Schema-agnostic: ``rlsys.config`` holds the schema and calls these. Every key
is checked against the dataclass fields (unknown keys get a difflib
suggestion, or the new key when the schema's table of moved keys has it) and
every leaf against its type hint (``int | None``, ``list[str]``, ``dict | None``,
``Literal[...]``, nested dataclasses). Errors are ``ConfigError`` with the
dotted key path.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from rlsys.errors import ConfigError, UserError


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 booleans and floats.

    PyYAML implements YAML 1.1, where ``yes``/``on`` are booleans and ``1e-6``
    is a string; both surprise people writing configs.
    """


_REPLACED = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float")
_Yaml12Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in _REPLACED]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
# Added after the int resolver, so plain integers still resolve to int first.
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    """Parse YAML text with YAML 1.2 booleans and floats (see ``_Yaml12Loader``)."""
    return yaml.load(text, Loader=_Yaml12Loader)


def read_yaml_file(path: str) -> dict:
    """The top-level mapping of a YAML file; an empty file is ``{}``."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise UserError(f"cannot read config file '{path}': {e.strerror}") from None
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as e:
        raise UserError(f"config file '{path}' is not valid YAML: {_yaml_problem(e)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("", f"'{path}' must hold a mapping of sections, got {type(raw).__name__}")
    return raw


# ----------------------------------------------------- dict <-> dataclass tree


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp) or tp is dict or get_origin(tp) is dict:
        return "a mapping"
    if get_origin(tp) is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    return tp.__name__


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# Old dotted key -> new dotted key. A moved section also covers every key below it.
MovedKeys = Mapping[str, str]


def _new_path(path: str, moved: MovedKeys) -> str | None:
    """Where ``path`` lives now, if it or a section above it is in ``moved``."""
    head, tail = path, ""
    while head:
        if head in moved:
            return moved[head] + tail
        head, _, last = head.rpartition(".")
        tail = f".{last}{tail}"
    return None


def _moved_error(paths: list[str], moved: MovedKeys) -> ConfigError | None:
    renames = [(p, _new_path(p, moved)) for p in paths]
    renames = [(old, new) for old, new in renames if new is not None]
    if not renames:
        return None
    what = ", ".join(f"{old} moved to {new}" for old, new in renames)
    return ConfigError(renames[0][0], f"{what}; rename {'it' if len(renames) == 1 else 'them'} in your config")


def _bad_key(path: str, key: str, cls: type) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    section = path.rpartition(".")[0] or "the top level"
    return ConfigError(path, f"unknown key '{key}' in {section}{hint} (valid keys: {', '.join(names)})")


def merge(default: Any, raw: Any, tp: Any, path: str, moved: MovedKeys | None = None) -> Any:
    """Return ``raw`` checked against type ``tp``; mappings merge into ``default``.

    Merging into the parent's default instance (rather than the class defaults)
    keeps per-section defaults such as the critic's larger learning rate. An
    unknown key found in ``moved`` is reported with its new path.
    """
    if dataclasses.is_dataclass(tp):
        if not isinstance(raw, dict):
            raise ConfigError(path, f"expected a mapping of {tp.__name__} keys, got {raw!r}")
        hints = _hints(tp)
        known = {f.name for f in dataclasses.fields(tp)}
        unknown = [key for key in raw if key not in known]
        if unknown:
            subs = [f"{path}.{key}" if path else str(key) for key in unknown]
            # every moved key of the mapping at once: an old config usually has several
            raise _moved_error(subs, moved or {}) or _bad_key(subs[0], unknown[0], tp)
        updates = {}
        for key, value in raw.items():
            sub = f"{path}.{key}" if path else str(key)
            updates[key] = merge(getattr(default, key), value, hints[key], sub, moved)
        return dataclasses.replace(default, **updates)
    if get_origin(tp) is dict and dataclasses.is_dataclass(get_args(tp)[1]):  # named sections (cluster.pools)
        cls = get_args(tp)[1]
        if not isinstance(raw, dict):
            raise ConfigError(path, f"expected a mapping of names to {cls.__name__} mappings, got {raw!r}")
        have = default or {}
        return {str(k): merge(have.get(k, cls()), v, cls, f"{path}.{k}", moved) for k, v in raw.items()}
    return _check_value(raw, tp, path)


def _check_value(value: Any, tp: Any, path: str) -> Any:
    """Type-check a leaf value; returns it (ints widened to float where a float is expected)."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        for arg in get_args(tp):
            if arg is not type(None) and _matches(value, arg):
                return _check_value(value, arg, path)
    elif origin is list and isinstance(value, list):
        return [_check_value(v, get_args(tp)[0], f"{path}[{i}]") for i, v in enumerate(value)]
    elif _matches(value, tp):
        return float(value) if tp is float else copy.deepcopy(value)
    if origin is Literal:
        raise ConfigError(path, f"{value!r} is not allowed; expected {_type_name(tp)}")
    raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _matches(value: Any, tp: Any) -> bool:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_matches(value, arg) for arg in get_args(tp))
    if origin is Literal:
        return value in get_args(tp) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, list)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    if tp is bool:
        return isinstance(value, bool)
    if tp is float:  # an int is a fine float (lr: 0), a bool is not
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def apply_override(raw: dict, override: str, root: type, moved: MovedKeys | None = None) -> None:
    """Set ``key.path=value`` in the raw dict, after checking the path against ``root``'s schema.

    The value is parsed as YAML, so ``a.b=2`` is an int and ``a.c=[x, y]`` a list. A path
    found in ``moved`` is reported with its new path.
    """
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError("", f"override '{override}' must look like key.path=value")
    try:
        value = parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(key, f"override value '{text}' is not valid YAML: {_yaml_problem(e)}") from None
    parts = key.split(".")
    tp: Any = root
    node = raw
    for i, part in enumerate(parts):
        path = ".".join(parts[: i + 1])
        if dataclasses.is_dataclass(tp):
            if part not in _hints(tp):
                raise _moved_error([key], moved or {}) or _bad_key(path, part, tp)
            tp = _hints(tp)[part]
        elif not _matches({}, tp):  # below a free-form dict (model.hf_config) any key goes
            raise ConfigError(path, f"'{'.'.join(parts[:i])}' is a value, not a section")
        if i == len(parts) - 1:
            node[part] = value
            return
        if node.get(part) is None:
            node[part] = {}
        elif not isinstance(node[part], dict):
            raise ConfigError(path, f"expected a mapping, got {node[part]!r}")
        node = node[part]


def to_dict(obj: Any) -> dict:
    """The plain-dict form of a dataclass tree, in field order."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, dict) and any(dataclasses.is_dataclass(v) for v in value.values()):
            out[f.name] = {k: to_dict(v) for k, v in value.items()}
        else:
            out[f.name] = copy.deepcopy(value)
    return out


def _yaml_problem(e: Exception) -> str:
    """A YAML error on one line: what went wrong and where (PyYAML's own message spans several)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{context + ': ' if context else ''}{problem}{where}".split())
