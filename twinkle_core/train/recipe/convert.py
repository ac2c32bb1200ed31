"""Typed conversion of a raw recipe mapping into the schema dataclasses.

Every mismatch is collected (with its full key path) instead of raised, so one run of ``twinkle train``
reports every mistake in a recipe at once; unknown keys get a "did you mean" suggestion.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any

from twinkle_core.train.recipe.schema import ALIASES, Recipe

_UNIONS = (typing.Union, types.UnionType)


class ErrorList(list):
    """The problems found in a recipe, each ``"key.path: message"``; everything is reported at once."""

    def add(self, path: str, message: str) -> None:
        self.append(f"{path}: {message}" if path else message)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _all_paths(cls: type, prefix: str = "") -> list[str]:
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = _join(prefix, f.name)
        out.append(path)
        tp = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp):
            out.extend(_all_paths(tp, path))
    return out


def _suggest(prefix: str, key: str, siblings: list[str]) -> str:
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return _join(prefix, close[0])
    alias = ALIASES.get(key) or next(iter(
        ALIASES[k] for k in difflib.get_close_matches(key, list(ALIASES), n=1, cutoff=0.8)), None)
    if alias:
        return alias
    everything = _all_paths(Recipe)
    leaves = {p.rsplit(".", 1)[-1]: p for p in everything}
    close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)
    return leaves[close[0]] if close else ""


def unwrap_optional(tp: Any) -> Any:
    """``X`` for ``X | None``; any other type unchanged."""
    if typing.get_origin(tp) in _UNIONS:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in _UNIONS:
        args = typing.get_args(tp)
        parts = [_describe(a) for a in args if a is not type(None)]
        text = " or ".join(parts)
        return f"{text} or null" if type(None) in args else text
    if dataclasses.is_dataclass(tp) or tp is dict or origin is dict:
        return "a mapping"
    if tp is list or origin is list:
        return "a list"
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(tp, str(tp))


def describe_value(value: Any) -> str:
    """``value`` for an error message: its YAML type and a shortened repr (``"mapping {'a': 1}"``)."""
    name = {str: "string", int: "integer", float: "number", bool: "boolean", list: "list", dict: "mapping",
            type(None): "null"}.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{name} {text if len(text) <= 60 else text[:57] + '...'}"


_MISMATCH = object()  # what a scalar converter returns for a value of the wrong type


def _to_bool(value: Any) -> Any:
    return value if isinstance(value, bool) else _MISMATCH


def _to_int(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return int(value) if isinstance(value, float) and value.is_integer() else _MISMATCH


def _to_float(value: Any) -> Any:
    if isinstance(value, bool):
        return _MISMATCH
    try:  # strings too: YAML 1.1 reads 1e-4 (no dot) as a string
        return float(value) if isinstance(value, (int, float, str)) else _MISMATCH
    except ValueError:
        return _MISMATCH


def _to_str(value: Any) -> Any:
    return value if isinstance(value, str) else _MISMATCH


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _convert_scalar(value: Any, tp: type, path: str, errors: ErrorList) -> Any:
    converted = _SCALARS[tp](value)
    if converted is _MISMATCH:
        quote = " (quote it in YAML)" if tp is str else ""
        errors.add(path, f"expected {_describe(tp)}, got {describe_value(value)}{quote}")
        return value
    if tp is float and not math.isfinite(converted):  # .nan / .inf train a model into NaN
        errors.add(path, f"must be a finite number, got {converted!r}")
        return value
    return converted


def _convert_union(value: Any, tp: Any, path: str, errors: ErrorList) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    choices = [a for a in args if a is not type(None)]
    for choice in choices:
        trial = ErrorList()
        result = _convert(value, choice, path, trial)
        if not trial:
            return result
    if len(choices) == 1 and not (len(trial) == 1 and trial[0].startswith(f"{path}: expected ")):
        errors.extend(trial)  # the value has the right type; its own items are wrong
    else:
        errors.add(path, f"expected {_describe(tp)}, got {describe_value(value)}")
    return value


def _convert_mapping(value: Any, tp: Any, path: str, errors: ErrorList) -> Any:
    if not isinstance(value, dict):
        errors.add(path, f"expected a mapping, got {describe_value(value)}")
        return value
    key_tp, value_tp = typing.get_args(tp) or (str, Any)
    out = {}
    for key, item in value.items():
        if key_tp is str and not isinstance(key, str):
            errors.add(_join(path, str(key)), f"keys must be strings, got {describe_value(key)}")
            continue
        out[key] = _convert(item, value_tp, _join(path, str(key)), errors)
    return out


def _convert_list(value: Any, tp: Any, path: str, errors: ErrorList) -> Any:
    if not isinstance(value, (list, tuple)):
        errors.add(path, f"expected a list, got {describe_value(value)}")
        return value
    (item_tp,) = typing.get_args(tp) or (Any,)
    return [_convert(item, item_tp, f"{path}[{i}]", errors) for i, item in enumerate(value)]


_CONTAINERS = {dict: _convert_mapping, list: _convert_list}


def _convert(value: Any, tp: Any, path: str, errors: ErrorList) -> Any:
    """``value`` as the schema type ``tp``; a mismatch is added to ``errors`` (the value is then returned as is)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in _UNIONS:
        return _convert_union(value, tp, path, errors)
    if dataclasses.is_dataclass(tp):
        return build_section(tp, value, path, errors)
    if tp in _SCALARS:
        return _convert_scalar(value, tp, path, errors)
    if (origin or tp) in _CONTAINERS:
        return _CONTAINERS[origin or tp](value, tp, path, errors)
    raise TypeError(f"recipe schema uses an unsupported type {tp!r} at {path}")


def build_section(cls: type, raw: Any, path: str, errors: ErrorList) -> Any:
    """The schema dataclass ``cls`` (a recipe or one of its sections at ``path``) from ``raw``; every mismatch is
    added to ``errors`` (the section then keeps its defaults where the value was wrong)."""
    if raw is None:
        raw = {}
    if isinstance(raw, str) and "name" in {f.name for f in dataclasses.fields(cls)}:
        raw = {"name": raw}  # the shorthand ``strategy: ddp`` (or ``strategy=accelerate`` on the command line)
    if not isinstance(raw, dict):
        errors.add(path, f"expected a mapping, got {describe_value(raw)}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in hints:
            key_text = str(key)
            suggestion = _suggest(path, key_text, names)
            hint = f"did you mean {suggestion}?" if suggestion else f"known keys: {', '.join(names)}"
            errors.add(_join(path, key_text), f"unknown key; {hint}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in raw:
            kwargs[f.name] = _convert(raw[f.name], hints[f.name], _join(path, f.name), errors)
    try:
        return cls(**kwargs)
    except TypeError as exc:  # only reachable through a schema bug
        errors.add(path, str(exc))
        return cls()
