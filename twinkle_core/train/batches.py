"""The training data as an endless stream of micro-batches: the loader's epochs one after the other."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from twinkle_core.errors import ConfigError

#: epochs in a row without a batch after which the loader is taken to yield nothing at all
MAX_EMPTY_EPOCHS = 2


class BatchStream:
    """Draws the next batch of ``loader``, moving to the next epoch (``loader.set_epoch``) when one ends.

    ``epoch`` is the epoch being read; a resumed run sets it (with :meth:`resume_at`) before the first draw.
    """

    def __init__(self, loader: Any, epoch: int = 0) -> None:
        self.loader = loader
        self.epoch = epoch
        self._batches: Iterator[Any] | None = None
        self._empty_epochs = 0

    def resume_at(self, epoch: int) -> None:
        """Continue in ``epoch`` (the loader's own state says where in it)."""
        self.epoch = epoch
        self.loader.set_epoch(epoch)

    def next_batch(self) -> Any:
        while True:
            if self._batches is None:
                self._batches = iter(self.loader)
            try:
                batch = next(self._batches)
            except StopIteration:
                self._batches = None
                self._empty_epochs += 1
                if self._empty_epochs > MAX_EMPTY_EPOCHS:
                    raise ConfigError("the training data loader yields no batches") from None
                self.epoch += 1
                self.loader.set_epoch(self.epoch)
                continue
            self._empty_epochs = 0
            return batch
