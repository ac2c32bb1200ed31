"""A native call's arguments, checked in the handler before the call is queued (a refused call never reaches the
shared model), and the :class:`Call` a method's preparer receives.

A preparer (``prepare(call) -> run``) checks ``call.args`` and returns ``run``, the closure the lane's worker runs
later; only ``run`` touches the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from twinkle_server.errors import BadRequest
from twinkle_server.native_http import user_errors
from twinkle_server.native_table import NativeAdapter, NativeAdapters

#: the default of an argument that must be given (see :func:`take`)
REQUIRED = object()


@dataclass
class Call:
    """One native call, as the lane's worker runs it. ``entry``: the tenant's adapter, or on a full-parameter base
    the model itself (:class:`twinkle_server.native_full.FullModel`, ``adapter_id`` ``None``); ``checkpoints``: the
    directory holding its checkpoints by name."""

    service: Any
    host: Any
    entry: NativeAdapter
    table: NativeAdapters
    args: dict[str, Any]
    checkpoints: Path

    @property
    def model(self) -> Any:
        return self.host.model

    @property
    def aid(self) -> str | None:
        """The ``adapter_name`` of the model's calls (``None``: the whole model)."""
        return self.entry.adapter_id

    def guard(self, what: str, fn: Callable[[], Any]) -> Any:
        return user_errors(what, fn, self.entry.rename)


@dataclass
class CallRequest:
    """A ``.../call`` body, checked: the method's preparer, its (still encoded) ``args`` and ``wait_s``."""

    method: str
    prepare: Callable[[Any], Any]
    args: dict[str, Any]
    wait_s: Any


def call_request(body: dict[str, Any], methods: dict[str, Callable[[Any], Any]],
                 fields: tuple[str, ...] = ()) -> CallRequest:
    """The checked body of a native call: ``method`` (one of ``methods``), ``args`` (a JSON object), ``wait_s`` and
    the route's own ``fields``; BadRequest naming an unknown field or method."""
    known = (*fields, "method", "args", "wait_s")
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; known: {', '.join(known)}")
    method = body.get("method")
    prepare = methods.get(method) if isinstance(method, str) else None
    if prepare is None:
        raise BadRequest(f"unknown method {method!r}; the native API's methods: {', '.join(sorted(methods))}")
    args = body.get("args") or {}
    if not isinstance(args, dict):
        raise BadRequest(f"{method}: args must be a JSON object of keyword arguments")
    return CallRequest(method=method, prepare=prepare, args=args, wait_s=body.get("wait_s"))


def take(args: dict[str, Any], method: str, **defaults: Any) -> dict[str, Any]:
    """``args`` with ``defaults`` filled in; unknown arguments are refused, naming the known ones. A default of
    :data:`REQUIRED` must be given."""
    unknown = sorted(set(args) - set(defaults))
    if unknown:
        raise BadRequest(f"{method}: unknown argument(s) {unknown}; known: {sorted(defaults)}")
    out = {}
    for key, default in defaults.items():
        if key not in args and default is REQUIRED:
            raise BadRequest(f"{method}: argument {key!r} is required")
        out[key] = args.get(key, default)
    return out


def registered(kind: str, name: Any, method: str) -> str:
    """``name`` if it is a registered plugin of ``kind``: only names cross the wire, never code."""
    from twinkle_core.plugins import get_plugins

    known = get_plugins().names(kind)
    if not isinstance(name, str) or name not in known:
        shown = name if isinstance(name, str) else type(name).__name__
        raise BadRequest(f"{method}: unknown {kind} {shown!r}; registered {kind}s: {', '.join(known)} (only "
                         f"registered names cross the wire, never code)")
    return name


def plain_options(value: Any, method: str) -> dict[str, Any]:
    """A plugin's keyword options: plain values, as a recipe would write them."""
    if value is None:
        return {}
    if not isinstance(value, dict) or any(isinstance(v, torch.Tensor) for v in value.values()):
        raise BadRequest(f"{method}: options must be a mapping of plain values (numbers, strings, lists)")
    return value


def number(value: Any, what: str, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{what} must be a number, got {value!r}")
    return float(value)


def integer(value: Any, what: str, *, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise BadRequest(f"{what} must be an integer{f' >= {low}' if low is not None else ''}, got {value!r}")
    return value
