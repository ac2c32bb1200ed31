"""``import twinkle``: the spec's import path, as aliases over the core and the installed plugins.

``from twinkle.model import TransformersModel`` resolves the name through the plugin registry (the ``twinkle``
entry-point group), so it works for any installed backend and, for one that is not installed, fails with the
``pip install`` that provides it. ``twinkle.train(recipe)`` is :func:`twinkle_core.train.loop.train`;
``from twinkle.data import build_loader`` builds a data loader from data files the way ``twinkle train`` does.
Everything else lives in :mod:`twinkle_core`.
"""

from __future__ import annotations

from typing import Any

from twinkle_core import __version__  # noqa: F401


def __getattr__(name: str) -> Any:
    if name == "train":  # imported on first use: ``import twinkle`` stays as light as the core
        from twinkle_core.train.loop import train

        return train
    raise AttributeError(f"module 'twinkle' has no attribute {name!r}")
