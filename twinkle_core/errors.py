"""Exceptions raised by Twinkle. Each message says what is wrong and how to fix it."""

from __future__ import annotations


class TwinkleError(Exception):
    """Base class of every error Twinkle raises on purpose."""


class PluginNotFoundError(TwinkleError, LookupError):
    """A plugin kind/name was asked for that no installed distribution provides."""

    def __init__(self, kind: str, name: str, available: list[str], install_hint: str | None):
        from twinkle_core.catalog import did_you_mean, plural

        self.kind, self.name, self.available, self.install_hint = kind, name, available, install_hint
        self.suggestion = did_you_mean(kind, name, available)
        listed = ", ".join(sorted(available)) or "(none)"
        msg = f"no {kind} named {name!r} is installed"
        msg += f"; did you mean {self.suggestion!r}?" if self.suggestion else "."
        msg += f" Available {plural(kind)}: {listed}."
        if install_hint:
            msg += f" Install it with: {install_hint}" if install_hint.startswith("pip ") else f" {install_hint[0].upper()}{install_hint[1:]}."
        super().__init__(msg)


class DuplicatePluginError(TwinkleError):
    """Two distributions registered the same kind/name."""


class ConfigError(TwinkleError, ValueError):
    """A recipe, mesh or argument is invalid. The message names the key."""


class UnsupportedHardwareError(TwinkleError, RuntimeError):
    """The requested mode cannot run on this machine (e.g. fp8 without a Hopper-class GPU)."""


class DataFormatError(TwinkleError, ValueError):
    """A data row is malformed. The message names the file and line."""

    def __init__(self, path: str, line: int | None, reason: str):
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")


class SourceError(TwinkleError, OSError):
    """A model could not be resolved from its source (offline, unknown id, missing path)."""
