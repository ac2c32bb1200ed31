"""Environment switches, parsed the same way everywhere ("0", "false", "off", "" mean off)."""

from __future__ import annotations

import os

from twinkle_core.errors import ConfigError

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}


def env_flag(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={raw!r} is not a boolean; set {name} to one of "
                      f"1, true, yes, on (on) or 0, false, no, off, or leave it empty (off)")


def env_list(name: str) -> list[str]:
    raw = os.environ.get(name, "")
    return [item.strip() for item in raw.split(",") if item.strip()]
