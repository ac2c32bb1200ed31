"""A deterministic, resumable, data-parallel-sharded batch loader over an indexable dataset.

Per epoch the ``N`` sample indices are shuffled with a permutation that depends only on
``(seed, epoch)`` (identical on every rank), trimmed to a multiple of ``dp_size`` (or of
``dp_size * batch_size`` with ``drop_last``) and dealt round-robin: rank ``r`` takes positions
``r, r + dp_size, ...``. So ranks see disjoint samples and all ranks yield the same number of
batches (without ``drop_last`` the last batch may be smaller, equally on all ranks; at most
``dp_size - 1`` samples of an epoch are skipped, different ones each epoch when shuffling).

Iteration continues from the current position; finishing an epoch moves to the next one, so::

    for epoch in range(start_epoch, num_epochs):
        loader.set_epoch(epoch)       # keeps the position when it is already this epoch (resume)
        for batch in loader: ...

``state_dict()`` taken after a batch was consumed resumes with the next batch. Only one iterator
should be live at a time (they share the position).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any


def _default_dp() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def data_parallel_layout(batch_size: int, dp_rank: int | None, dp_size: int | None) -> tuple[int, int]:
    """``(dp_rank, dp_size)``: the given ones, else the process group's (or ``RANK`` / ``WORLD_SIZE``); checked."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    default_rank, default_size = _default_dp()
    size = int(dp_size) if dp_size is not None else default_size
    rank = int(dp_rank) if dp_rank is not None else default_rank
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid data-parallel rank {rank} of size {size}")
    return rank, size


class DataLoader:
    def __init__(self, dataset: Sequence[Any], batch_size: int, collate_fn: Callable[[list[Any]], Any] | None = None,
                 *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 dp_rank: int | None = None, dp_size: int | None = None) -> None:
        self.dp_rank, self.dp_size = data_parallel_layout(batch_size, dp_rank, dp_size)
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.collate_fn = collate_fn if collate_fn is not None else (lambda items: items)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.position = 0  # batches of the current epoch already yielded
        self._order_cache: tuple[int, list[int]] | None = None
        if len(self) == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} samples: not enough for one batch of {self.batch_size} "
                f"on each of {self.dp_size} data-parallel ranks" + (" with drop_last" if drop_last else ""))

    # ------------------------------------------------------------------ sizes
    @property
    def num_samples(self) -> int:
        return len(self.dataset)

    def _samples_per_rank(self) -> int:
        per_rank = self.num_samples // self.dp_size
        if self.drop_last:
            per_rank -= per_rank % self.batch_size
        return per_rank

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        per_rank = self._samples_per_rank()
        return -(-per_rank // self.batch_size)

    # ------------------------------------------------------------------ order
    def _rank_indices(self, epoch: int) -> list[int]:
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        n = self.num_samples
        if self.shuffle:
            import numpy as np

            order = np.random.default_rng([self.seed, epoch]).permutation(n).tolist()
        else:
            order = list(range(n))
        used = self._samples_per_rank() * self.dp_size
        mine = order[:used][self.dp_rank::self.dp_size]
        self._order_cache = (epoch, mine)
        return mine

    def batch_indices(self, epoch: int, index: int) -> list[int]:
        """Dataset indices of batch ``index`` of ``epoch`` on this rank."""
        mine = self._rank_indices(epoch)
        return mine[index * self.batch_size:(index + 1) * self.batch_size]

    # ------------------------------------------------------------------ iteration
    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch`` (no-op when already in it, so a resumed position is kept)."""
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.position = 0

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        total = len(self)
        while self.epoch == epoch and self.position < total:
            indices = self.batch_indices(epoch, self.position)
            batch = self.collate_fn([self.dataset[i] for i in indices])
            self.position += 1
            yield batch
        if self.epoch == epoch and self.position >= total:
            self.epoch, self.position = epoch + 1, 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "batch_size": self.batch_size,
            "dp_size": self.dp_size,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "shuffle", "drop_last", "batch_size", "dp_size", "num_samples"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"cannot resume the data loader: the checkpoint has {key}={state[key]!r} but "
                                 f"this loader has {key}={getattr(self, key)!r}; the batch order would differ")
        position = int(state["position"])
        if not 0 <= position <= len(self):
            raise ValueError(f"cannot resume the data loader: position {position} is outside 0..{len(self)}")
        self.epoch = int(state["epoch"])
        self.position = position


__all__ = ["DataLoader"]
