"""``from twinkle_core.model import TransformersModel`` resolves to the installed backend's class.

Names are looked up in the plugin registry on first access, so importing this package imports
no backend.
"""

from __future__ import annotations

from typing import Any

from twinkle_core.model.base import TwinkleModel

__all__ = ["TwinkleModel", "get_model_class"]


def get_model_class(name: str) -> type[TwinkleModel]:
    from twinkle_core.plugins import get_plugins

    return get_plugins().load("model", name)


def __getattr__(name: str) -> Any:
    if name.startswith("_") or not name[:1].isupper():
        raise AttributeError(name)
    return get_model_class(name)
