"""Names that become directory or module names: adapters, tenants, checkpoints.

``validate_name("adapter name", name)`` returns ``name`` or raises :class:`ConfigError` saying what
is wrong with it. Such names end up in paths (``<output_dir>/<name>``) and, for adapters, in PEFT
module names, so they must be a single, non-empty path component without control characters;
adapter names cannot contain ``.`` either (PEFT splits module paths on dots). Checkpoint names such
as ``step_3.5`` pass ``allow_dots=True`` (``.`` and ``..`` themselves are still refused).
"""

from __future__ import annotations

import os

from twinkle_core.errors import ConfigError

__all__ = ["validate_name"]


def _problem(name: object, allow_dots: bool) -> str | None:
    if not isinstance(name, str):
        return f"must be a string, got {type(name).__name__}"
    if not name or not name.strip():
        return "must not be empty"
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return "must not contain control characters (newlines, tabs ...)"
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return "must not be an absolute path"
    if "/" in name or "\\" in name:
        return "must not contain path separators ('/' or '\\\\')"
    if name in (".", "..") or ".." in name:
        return "must not contain '..'"
    if "." in name and not allow_dots:
        return "must not contain '.' (PEFT module names are split on dots); use '_' or '-'"
    return None


def validate_name(what: str, name: str, *, allow_dots: bool = False) -> str:
    """Return ``name`` when it is usable as ``what`` (e.g. "adapter name"); else raise :class:`ConfigError`."""
    problem = _problem(name, allow_dots)
    if problem:
        raise ConfigError(f"{what} {name!r} {problem}")
    return name
