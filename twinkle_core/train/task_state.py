"""A task's state in checkpoints: every rank's own (a rank's share of an RL rollout queue), given back to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twinkle_core import distributed
from twinkle_core.errors import ConfigError


def same_state(a: Any, b: Any) -> bool:
    """Equality of nested task states holding tensors."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape") and hasattr(b, "shape"):
        import torch

        return bool(a.shape == b.shape and torch.equal(a, b))
    return bool(a == b)


def local_task_state(path: Path, saved: dict[str, Any]) -> dict[str, Any]:
    """This rank's task state from a checkpoint: its own at the same world size; at another, only a state every
    rank shared (a rollout boundary) carries over."""
    if "per_rank" not in saved:
        return saved
    states, world = saved["per_rank"], distributed.world_size()
    if len(states) == world:
        return states[distributed.rank()]
    if all(same_state(states[0], other) for other in states[1:]):
        return states[0]
    raise ConfigError(
        f"train.resume: {path} holds the task's per-rank state of {len(states)} ranks (e.g. the rest of an RL "
        f"rollout each rank was training on); resume it with {len(states)} ranks, or from a checkpoint written "
        f"between two rollouts")
