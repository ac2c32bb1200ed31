"""Precomputed reference log-probabilities (``task_options.reference: precomputed``).

Before the first step, one pass over the data set computes every pair's reference log-probabilities with
the model as it is then: its initial weights, or its base when it carries a LoRA adapter. No second copy
of the model is kept, and no reference forward runs during training. The values are cached under the
run's output directory (``reference_logps/<split>.pt``, plain tensors) and reused by a resumed run, as
long as the data set's tokens are unchanged (the cache is keyed by their sha256).

In a multi-process run each data-parallel rank computes an equal share (the last batch padded with
repeats, so collective forwards stay in step), and every rank receives all values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from twinkle_core import distributed
from twinkle_core.checkpoint import load_state_file
from twinkle_rl.pairs import PreferenceFeature

logger = logging.getLogger("twinkle.rl")

CACHE_DIR = "reference_logps"
#: pairs per forward pass of the precomputation
BATCH_PAIRS = 16


def fingerprint(features: Sequence[PreferenceFeature]) -> str:
    """sha256 of every pair's tokens and labels, in order: what the cached values were computed for."""
    digest = hashlib.sha256()
    for f in features:
        for part in (f.prompt_ids, f.chosen_ids, f.chosen_labels, f.rejected_ids, f.rejected_labels):
            digest.update(len(part).to_bytes(4, "little"))
            digest.update(torch.tensor(part, dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()


def cache_path(output_dir: str, split: str) -> str:
    return os.path.join(output_dir, CACHE_DIR, f"{split}.pt")


def _read_cache(path: str, key: str, count: int) -> torch.Tensor | None:
    if not os.path.isfile(path):
        return None
    cached = load_state_file(path)
    if cached.get("fingerprint") != key or tuple(cached["ref_logps"].shape) != (count, 2):
        logger.warning("%s was computed for other data; computing the reference log-probabilities again", path)
        return None
    logger.info("reference log-probabilities: reusing %s (%d pairs)", path, count)
    return cached["ref_logps"]


def _write_cache(path: str, key: str, values: torch.Tensor) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    staging = f"{path}.incomplete"
    torch.save({"fingerprint": key, "ref_logps": values}, staging)
    os.replace(staging, path)


def _data_parallel(model: Any) -> tuple[int, int]:
    configs = model.get_train_configs()
    return int(configs.get("dp_rank") or 0), int(configs.get("dp_size") or 1)


def _compute(features: Sequence[PreferenceFeature], collate: Callable[[list[Any]], dict[str, Any]],
             reference: Callable[[dict[str, Any]], torch.Tensor], dp_rank: int, dp_size: int) -> torch.Tensor:
    """``[len(features), 2]``: (chosen, rejected) reference log-probs, computed shard-wise and gathered."""
    share = -(-len(features) // dp_size)
    mine = list(range(dp_rank * share, min((dp_rank + 1) * share, len(features))))
    batches = -(-share // BATCH_PAIRS)
    values: dict[int, tuple[float, float]] = {}
    for b in range(batches):
        indices = mine[b * BATCH_PAIRS:(b + 1) * BATCH_PAIRS]
        # every rank runs the same number of forwards (collectives under FSDP / ZeRO-3 / TP), so a rank
        # with a short or empty share repeats a pair and drops its values
        padded = indices or [0]
        sequences = reference(collate([features[i] for i in padded])).reshape(-1, 2)
        for i, pair in zip(indices, sequences.tolist(), strict=False):
            values[i] = (pair[0], pair[1])
    if distributed.world_size() > 1:
        import torch.distributed as dist

        gathered: list[Any] = [None] * distributed.world_size()
        dist.all_gather_object(gathered, values)
        for part in gathered:
            values.update(part)
    missing = [i for i in range(len(features)) if i not in values]
    if missing:
        raise RuntimeError(f"reference log-probabilities missing for {len(missing)} pairs after gathering")
    return torch.tensor([values[i] for i in range(len(features))], dtype=torch.float32)


def precompute_reference(features: Sequence[PreferenceFeature], *, model: Any,
                         collate: Callable[[list[Any]], dict[str, Any]],
                         reference: Callable[[dict[str, Any]], torch.Tensor], split: str,
                         output_dir: str) -> list[PreferenceFeature]:
    """``features`` with their ``ref_logps`` set: from the cache when it matches, else computed and cached."""
    key = fingerprint(features)
    path = cache_path(output_dir, split)
    # the main process reads the cache once; every rank gets its values (or its absence) from it
    values = _read_cache(path, key, len(features)) if distributed.is_main_process() else None
    values = distributed.broadcast_object(values)
    if values is None:
        logger.info("reference log-probabilities: one pass over %d %s pairs", len(features), split)
        values = _compute(features, collate, reference, *_data_parallel(model))
        if distributed.is_main_process():
            _write_cache(path, key, values)
        distributed.barrier()
    return [dataclasses.replace(f, ref_logps=(float(c), float(r))) for f, (c, r) in zip(features, values.tolist(),
                                                                                         strict=True)]
