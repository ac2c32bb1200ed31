"""Precomputed reference log-probabilities (``task_options.reference: precomputed``).

Before the first step, one pass over the data set computes every pair's reference log-probabilities with
the model as it is then: its initial weights, or its base when it carries a LoRA adapter. No second copy
of the model is kept, and no reference forward runs during training. The values are cached under the
run's output directory (``reference_logps/<split>.pt``, plain tensors) and reused by a resumed run (or a new
run in the same directory) only when both of these hold:

* the data set's tokens are unchanged: the cache is keyed by the sha256 of every pair's token ids and labels,
  which are those after ``max_length`` truncation (``data.max_length``, ``over_length``); nothing else of the
  recipe changes these values (they are plain sums of log-probabilities at temperature 1: ``beta``,
  ``loss_type``, IPO's length normalisation and the sampling temperature of online RL apply later);
* the reference is unchanged: the reference is run again on a sample of :data:`PROBE_PAIRS` pairs spread over
  the data set (one forward pass) and must give their cached values (within ``PROBE_RTOL`` / ``PROBE_ATOL``,
  the spread of float32 sums run in another batch shape or process layout). This checks the reference's
  outputs themselves, so it notices everything that changes them: other start weights (a retrained SFT
  model under the same path), another precision, attention implementation or kernel. A hash of the weights
  could not do that through the model API: ``get_state_dict()`` of a model with a LoRA adapter holds the
  adapter's tensors, not the base that is the reference, and ZeRO-3 or Megatron hold shards.

When either fails, the values are computed again (with a warning naming the cause) and the cache replaced.

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
#: pairs the reference is run on again before a cache is reused (one forward pass)
PROBE_PAIRS = 16
#: how close the probe's values must come to the cached ones: float32 sums of up to a few hundred token
#: log-probs differ by ~1e-6 relative between batch shapes or process layouts; other weights move them by far more
PROBE_RTOL, PROBE_ATOL = 1e-5, 1e-4
#: the cache file's layout; a file of another version is computed again
CACHE_VERSION = 2


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


def probe_indices(count: int) -> list[int]:
    """The pairs the reference is run on again before a cache is reused: up to :data:`PROBE_PAIRS`, spread
    evenly over the data set (first and last included)."""
    if count <= PROBE_PAIRS:
        return list(range(count))
    return sorted({round(i * (count - 1) / (PROBE_PAIRS - 1)) for i in range(PROBE_PAIRS)})


def _read_cache(path: str, key: str, count: int) -> torch.Tensor | None:
    if not os.path.isfile(path):
        return None
    cached = load_state_file(path)
    if cached.get("version") != CACHE_VERSION:
        logger.warning("%s was written by another version of the preference task; computing the reference "
                       "log-probabilities again", path)
        return None
    if cached.get("fingerprint") != key or tuple(cached["ref_logps"].shape) != (count, 2):
        logger.warning("%s was computed for other data; computing the reference log-probabilities again", path)
        return None
    return cached["ref_logps"]


def _write_cache(path: str, key: str, values: torch.Tensor) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    staging = f"{path}.incomplete"
    torch.save({"version": CACHE_VERSION, "fingerprint": key, "ref_logps": values}, staging)
    os.replace(staging, path)


def _same_reference(features: Sequence[PreferenceFeature], cached: torch.Tensor | None,
                    collate: Callable[[list[Any]], dict[str, Any]], reference: Callable[[dict[str, Any]], torch.Tensor],
                    path: str) -> bool:
    """Whether the reference, run again on the probe pairs, gives ``cached`` (on the main process, which read it).
    Every rank runs the probe's forward pass (collective forwards stay in step); the verdict is the main's."""
    indices = probe_indices(len(features))
    with torch.no_grad():
        probe = reference(collate([features[i] for i in indices])).reshape(-1, 2).float().cpu()
    verdict = None
    if cached is not None:
        expected = cached[indices]
        verdict = bool(torch.allclose(probe, expected, rtol=PROBE_RTOL, atol=PROBE_ATOL))
        if verdict:
            logger.info("reference log-probabilities: reusing %s (%d pairs; the reference gives the cached values "
                        "on %d of them)", path, len(features), len(indices))
        else:
            logger.warning("%s was computed with another reference model (other start weights, precision or "
                           "kernels: its log-probs of %d sampled pairs differ by up to %.4g); computing them again",
                           path, len(indices), float((probe - expected).abs().max()))
    return bool(distributed.broadcast_object(verdict))


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
    # the main process reads the cache once; every rank learns whether there is one, checks it with the
    # probe's forward pass, and gets the values from the main process
    cached = _read_cache(path, key, len(features)) if distributed.is_main_process() else None
    if distributed.broadcast_object(cached is not None) and _same_reference(features, cached, collate, reference,
                                                                             path):
        values = distributed.broadcast_object(cached)
    else:
        logger.info("reference log-probabilities: one pass over %d %s pairs", len(features), split)
        values = _compute(features, collate, reference, *_data_parallel(model))
        if distributed.is_main_process():
            _write_cache(path, key, values)
        distributed.barrier()
    return [dataclasses.replace(f, ref_logps=(float(c), float(r))) for f, (c, r) in zip(features, values.tolist(),
                                                                                         strict=True)]
