"""Ulysses sequence parallelism for the Hugging Face backend.

* :mod:`.ulysses` — the attention function registered in ``transformers.AttentionInterface`` and the
  differentiable all-to-all;
* :mod:`.batch_sharding` — each rank's share of every row of a batch (:func:`shard_batch`);
* :mod:`.strategy` — :class:`SequenceParallelStrategy` (strategy name ``ulysses``), which shards
  batches in ``prepare_inputs``, switches the model's attention implementation and synchronises
  gradients through DDP or FSDP2 (:mod:`.data_parallel`).

Importing this package imports nothing heavy; the names below load on first access.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SequenceParallelStrategy", "register_ulysses_attention", "shard_batch", "ulysses_attention_forward"]


def __getattr__(name: str) -> Any:
    if name == "SequenceParallelStrategy":
        from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy

        return SequenceParallelStrategy
    if name == "shard_batch":
        from twinkle_backend_hf.sequence_parallel.batch_sharding import shard_batch

        return shard_batch
    if name in ("register_ulysses_attention", "ulysses_attention_forward"):
        from twinkle_backend_hf.sequence_parallel import ulysses

        return getattr(ulysses, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
