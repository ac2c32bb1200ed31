"""The registered model classes by name: ``from twinkle.model import TransformersModel``.

A name is looked up in the plugin registry when it is imported, so this module never imports a backend by
itself; an unknown name raises the registry's error (what is available, and what to ``pip install``).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    from twinkle_core.plugins import get_plugins

    return get_plugins().load("model", name)


def __dir__() -> list[str]:
    from twinkle_core.plugins import get_plugins

    return sorted(get_plugins().names("model"))
