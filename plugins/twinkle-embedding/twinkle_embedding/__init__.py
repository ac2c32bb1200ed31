"""Twinkle embedding plugin: the ``embedding`` task, the ``infonce`` loss and the ``pkg://`` model source.

Registered through the ``twinkle`` entry-point group (``twinkle_embedding.plugin``); the core does
not import this package.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["EmbeddingTask", "InfoNCELoss", "__version__"]


def __getattr__(name: str):  # lazy, so listing plugins never imports torch
    if name == "EmbeddingTask":
        from twinkle_embedding.task import EmbeddingTask

        return EmbeddingTask
    if name == "InfoNCELoss":
        from twinkle_embedding.loss import InfoNCELoss

        return InfoNCELoss
    raise AttributeError(name)
