"""Resuming a checkpoint at another world size or micro-batch layout, and what is refused.

A checkpoint remembers the layout it was trained with (:func:`layout`): world size, data-parallel size,
``data.batch_size`` (per rank), ``gradient_accumulation_steps`` and the strategy. ``--resume`` compares it with
the run's own (:func:`check_layout`):

* **The global batch** (``batch_size x data-parallel ranks x gradient_accumulation_steps`` samples per optimizer
  step) must be the same: with another one the optimizer and learning-rate schedule would continue a different
  run. Refused with a ConfigError naming both values.
* **Another world size / data-parallel size** is allowed only when the strategy's checkpoints reshard
  (``Strategy.reshards_checkpoints``: ``native_fsdp`` / ``accelerate`` with their DCP optimizer state, and
  ``megatron``'s ``dist_checkpointing``) and the checkpoint was written by that same strategy. DDP, ``single``
  and DeepSpeed (ZeRO partitions saved per rank) are refused with a ConfigError that says what changed.
* **Another split of the same global batch** at the same world size (``batch_size`` 4 with no accumulation
  -> 2 with ``gradient_accumulation_steps: 2``) works with every strategy.

The data order after such a resume continues exactly: each epoch's permutation depends only on
``(seed, epoch)``, a rank takes every ``dp_size``-th sample of it, so the samples consumed so far are
``position x batch_size x dp_size`` of the permutation whatever the layout, and :func:`remap_loader_state`
turns that count into the new layout's position. Each optimizer step then trains on the same samples as the
uninterrupted run would have (only the end of an epoch may differ: it drops ``N mod dp_size`` samples, which
depends on ``dp_size``). The per-rank RNG streams (dropout) cannot carry over to another number of ranks: after a
resume at another world size every rank is reseeded from ``train.seed`` and the step (:func:`reseed`), so such a
run is deterministic but its dropout masks differ from the uninterrupted run's.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.train.seeding import seed_everything

logger = logging.getLogger("twinkle.train")

WEIGHTS_ONLY_HINT = ("or start a new run from its weights with --resume-weights-only {path} (fresh optimizer, "
                     "learning-rate schedule and data order, at step 0)")
RESHARDING = "native_fsdp, accelerate (DCP optimizer state) and megatron (dist_checkpointing)"


def layout(*, world_size: int, dp_size: int, batch_size: int, gradient_accumulation_steps: int,
           strategy: str) -> dict[str, Any]:
    """What a checkpoint records about the layout it was trained with (``extra_state["layout"]``)."""
    return {"world_size": int(world_size), "dp_size": int(dp_size), "batch_size": int(batch_size),
            "gradient_accumulation_steps": int(gradient_accumulation_steps), "strategy": strategy}


def _trainer_state(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A checkpoint's ``trainer_state.pt``; ``None`` when there is none or it cannot be read."""
    from twinkle_core import checkpoint
    from twinkle_core.checkpoint_layout import CheckpointLayout

    file = CheckpointLayout(os.fspath(path)).trainer_state
    if not os.path.isfile(file):
        return None
    try:
        return checkpoint.load_state_file(file)
    except checkpoint.CheckpointError:
        return None


def saved_extra_state(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``extra_state`` a checkpoint was saved with (what the trainer reads back on resume); ``None`` when it
    cannot be told (see :func:`saved_layout`)."""
    from twinkle_core.checkpoint_layout import TrainerStateKeys as Keys

    trainer = _trainer_state(path)
    return None if trainer is None else dict(trainer.get(Keys.EXTRA_STATE) or {})


def saved_layout(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The layout a checkpoint was trained with, from its ``trainer_state.pt``; ``None`` when it cannot be told
    (another model implementation's checkpoint, or a damaged file: resuming reports that one itself).
    Checkpoints written before the layout was recorded give what their data-loader state and RNG files say."""
    from twinkle_core.checkpoint_layout import TrainerStateKeys as Keys

    trainer = _trainer_state(path)
    if trainer is None:
        return None
    extra = trainer.get(Keys.EXTRA_STATE) or {}
    if isinstance(extra.get("layout"), dict):
        return dict(extra["layout"])
    loader = extra.get("loader") or {}
    configs = trainer.get(Keys.CONFIGS) or {}
    strategy = (configs.get("strategy") or {}).get("name") if isinstance(configs.get("strategy"), dict) else None
    return {"world_size": trainer.get(Keys.RNG_RANKS), "dp_size": loader.get("dp_size"),
            "batch_size": loader.get("batch_size"), "gradient_accumulation_steps": None, "strategy": strategy}


def _global_batch(lay: dict[str, Any], fallback: dict[str, Any]) -> int:
    value = 1
    for key in ("batch_size", "dp_size", "gradient_accumulation_steps"):
        value *= int(lay.get(key) if lay.get(key) is not None else fallback[key])
    return value


def check_layout(path: Path | str, saved: dict[str, Any] | None, now: dict[str, Any], *, reshards: bool) -> bool:
    """Refuse a resume the checkpoint cannot continue exactly; return whether the world size changes (then the
    RNG streams do not carry over)."""
    if not saved:
        return False
    hint = WEIGHTS_ONLY_HINT.format(path=path)
    saved_global, now_global = _global_batch(saved, now), _global_batch(now, now)
    if saved_global != now_global:
        raise ConfigError(
            f"train.resume: {path} was trained with a global batch of {saved_global} samples per optimizer step "
            f"(data.batch_size={saved.get('batch_size', now['batch_size'])} x "
            f"{saved.get('dp_size') or now['dp_size']} data-parallel ranks x gradient_accumulation_steps="
            f"{saved.get('gradient_accumulation_steps') or now['gradient_accumulation_steps']}), but this run has "
            f"{now_global} (data.batch_size={now['batch_size']} x {now['dp_size']} x gradient_accumulation_steps="
            f"{now['gradient_accumulation_steps']}). An exact resume keeps the global batch: change data.batch_size "
            f"or gradient_accumulation_steps so that the product is {saved_global}, {hint}")
    world_changed = saved.get("world_size") is not None and saved["world_size"] != now["world_size"]
    dp_changed = saved.get("dp_size") is not None and saved["dp_size"] != now["dp_size"]
    if not (world_changed or dp_changed):
        return False
    what = (f"{saved.get('world_size')} processes ({saved.get('dp_size')} data-parallel) with strategy "
            f"{saved.get('strategy')!r}; this run has {now['world_size']} ({now['dp_size']} data-parallel) with "
            f"{now['strategy']!r}")
    if saved.get("strategy") not in (None, now["strategy"]):
        raise ConfigError(f"train.resume: {path} was saved with {what}. Resuming at another world size needs the "
                          f"same strategy; resume with {saved['strategy']!r}, {hint}")
    if not reshards:
        raise ConfigError(
            f"train.resume: {path} was saved with {what}. Strategy {now['strategy']!r} resumes only at the world "
            f"size it saved at (run with {saved.get('world_size')} processes); the strategies whose checkpoints "
            f"reshard to another world size are {RESHARDING}. Otherwise {hint}")
    logger.warning("resuming %s at another world size (%s): weights, optimizer, schedule and data position carry "
                   "over; the per-rank RNG streams do not (every rank is reseeded from train.seed and the step)",
                   path, what)
    return bool(world_changed)


def remap_loader_state(path: Path | str, saved: dict[str, Any], loader: Any) -> dict[str, Any]:
    """The saved data-loader state for this loader's ``batch_size`` / ``dp_size``: the same number of samples
    consumed from the epoch's permutation."""
    if getattr(loader, "is_streaming", False):  # a stream has no permutation to find the position in
        return saved
    batch_size, dp_size = getattr(loader, "batch_size", None), getattr(loader, "dp_size", None)
    old_b, old_dp = saved.get("batch_size"), saved.get("dp_size")
    if None in (batch_size, dp_size, old_b, old_dp) or (old_b, old_dp) == (batch_size, dp_size):
        return saved
    num_samples = int(saved.get("num_samples", len(loader.dataset)))
    per_rank = num_samples // old_dp
    if saved.get("drop_last"):
        per_rank -= per_rank % old_b
    old_len = -(-per_rank // old_b)
    position = int(saved["position"])
    if position >= old_len:  # the epoch was over
        new_position = len(loader)
    else:
        consumed, per_batch = position * old_b * old_dp, batch_size * dp_size
        if consumed % per_batch:
            raise ConfigError(
                f"train.resume: {path} stopped after {consumed} samples of epoch {saved.get('epoch')}, which is not "
                f"a whole number of this run's batches of {per_batch} (data.batch_size={batch_size} x {dp_size} "
                f"data-parallel ranks); {WEIGHTS_ONLY_HINT.format(path=path)}")
        new_position = min(consumed // per_batch, len(loader))
    logger.info("data position: %d batches of %d x %d -> %d batches of %d x %d", position, old_b, old_dp,
                new_position, batch_size, dp_size)
    return {**saved, "batch_size": batch_size, "dp_size": dp_size, "position": new_position}


def reseed(seed: int, step: int) -> None:
    """The RNG streams after a resume at another world size: the same on every rank, like a fresh run's."""
    seed_everything(int(seed) + 1_000_003 * int(step))
