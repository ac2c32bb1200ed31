"""Data loading from Python: ``from twinkle.data import build_loader``.

:func:`build_loader` (:func:`twinkle_core.train.data_loader.build_loader`) builds a training data loader from data
files the way ``twinkle train`` builds it from a recipe's ``data:`` section. The data layer itself (templates,
collation, packing, the loader class) is :mod:`twinkle_core.data`.
"""

from __future__ import annotations

from twinkle_core.train.data_loader import build_loader

__all__ = ["build_loader"]
