"""Checks of the numeric options of the RL tasks, losses and rewards.

Every bound is checked with ``math.isfinite`` first: ``nan`` fails no comparison (``nan <= 0`` is false), so
``beta: .nan`` in a recipe would pass a plain ``beta <= 0`` test and poison every step. Each check raises a
:class:`~twinkle_core.errors.ConfigError` naming the option, the rule and the value it got.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from twinkle_core.errors import ConfigError


def _describe(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high:g}"
    return ""


def finite_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                  low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float, or a ``ConfigError`` naming ``name`` when it is not a finite real number in range
    (``low`` / ``high`` inclusive unless ``low_open`` / ``high_open``). Booleans are refused: ``beta: true`` is a
    slip, not the number 1."""
    rule = f"{name} must be a finite number{_describe(low, high, low_open, high_open)}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(rule)
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(rule)
    too_low = low is not None and (number <= low if low_open else number < low)
    too_high = high is not None and (number >= high if high_open else number > high)
    if too_low or too_high:
        raise ConfigError(rule)
    return number


def optional_finite_number(name: str, value: Any, **bounds: Any) -> float | None:
    """:func:`finite_number`, with ``None`` passed through (an option whose ``None`` means "off")."""
    return None if value is None else finite_number(name, value, **bounds)


def integer(name: str, value: Any, *, low: int | None = None) -> int:
    """``value`` as an int, or a ``ConfigError`` naming ``name`` when it is not an integer ``>= low``. An integral
    float (``8.0`` from a YAML file) is accepted; ``nan``, ``inf``, ``2.5`` and booleans are not."""
    rule = f"{name} must be an integer{'' if low is None else f' >= {low}'}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(rule)
    if isinstance(value, numbers.Integral):
        number = int(value)
    elif math.isfinite(float(value)) and float(value).is_integer():
        number = int(float(value))
    else:
        raise ConfigError(rule)
    if low is not None and number < low:
        raise ConfigError(rule)
    return number


def optional_integer(name: str, value: Any, *, low: int | None = None) -> int | None:
    """:func:`integer`, with ``None`` passed through."""
    return None if value is None else integer(name, value, low=low)


__all__ = ["finite_number", "integer", "optional_finite_number", "optional_integer"]
