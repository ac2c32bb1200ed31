"""Resolve ``"package.module:Attribute"`` references only when they are used."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(reference: str) -> Any:
    """Import ``"pkg.mod:Attr"`` (or ``"pkg.mod:Outer.Inner"``) and return the attribute."""
    module_name, sep, attr_path = reference.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"invalid object reference {reference!r}; expected 'package.module:Attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj
