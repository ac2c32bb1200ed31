"""Registrations of the embedding plugin (entry point ``twinkle: embedding``)."""

from __future__ import annotations

from twinkle_core import hookimpl
from twinkle_core.records import LossRecord, SourceRecord, TaskRecord

_PKG = "twinkle_embedding"


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("embedding", f"{_PKG}.task:EmbeddingTask",
                     "contrastive embedding training (mean / cls / last_token pooling), sentence-transformers output")


@hookimpl
def twinkle_register_losses():
    yield LossRecord("infonce", f"{_PKG}.loss:InfoNCELoss",
                     "in-batch + hard negatives, temperature, false-negative masking, gathered over DP ranks")


@hookimpl
def twinkle_register_sources():
    yield SourceRecord("pkg", f"{_PKG}.sources:PackageSource", "pkg://module: a model shipped in a Python package")
