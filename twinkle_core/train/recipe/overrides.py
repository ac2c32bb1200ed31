"""Recipe paths and command-line overrides, applied to the raw mapping before it is validated.

Paths in a recipe file are relative to that file; overrides (``optimizer.lr=3e-4``) are parsed as YAML.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.train.recipe.convert import describe_value, unwrap_optional
from twinkle_core.train.recipe.schema import Recipe


def resolve_paths(raw: dict[str, Any], base_dir: Path, cls: type = Recipe) -> None:
    """Make the recipe file's relative paths relative to the file (in place, before validation)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = raw.get(f.name)
        tp = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            resolve_paths(value, base_dir, tp)
        elif f.metadata.get("path") and isinstance(value, str):
            raw[f.name] = _resolve_path(value, base_dir, f.metadata["path"] == "always")
        elif f.metadata.get("path") and isinstance(value, list):  # data sources: strings or {path: ...}
            for i, item in enumerate(value):
                if isinstance(item, str):
                    value[i] = _resolve_path(item, base_dir, False)
                elif isinstance(item, dict) and isinstance(item.get("path"), str):
                    item["path"] = _resolve_path(item["path"], base_dir, False)


def _resolve_path(value: str, base_dir: Path, always: bool) -> str:
    if not value or "://" in value:
        return value
    expanded = Path(value).expanduser()
    if expanded.is_absolute():
        return str(expanded)
    candidate = base_dir / expanded
    explicit = value.startswith(("./", "../", ".\\", "..\\"))
    if always or explicit or candidate.exists():
        return os.path.normpath(str(candidate))
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optimizer.lr=3e-4"`` -> ``(["optimizer", "lr"], "3e-4")``; the value is parsed as YAML."""
    import yaml

    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like key.path=value (e.g. train.max_steps=10)")
    parts = key.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"override {text!r}: malformed key path {key!r}")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    return parts, parsed


def apply_overrides(raw: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    for text in overrides or ():
        parts, value = parse_override(text)
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise ConfigError(f"override {text!r}: {where} is {describe_value(child)}, not a mapping")
            node = child
        node[parts[-1]] = value
    return raw
