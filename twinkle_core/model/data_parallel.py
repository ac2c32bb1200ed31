"""The data-parallel view of a model: which data-parallel rank this process is, how many there are, and the
process group their reductions run over.

It is part of the model contract (:attr:`twinkle_core.model.base.TwinkleModel.data_parallel`), so the trainer
(which shards the data by it) and a rollout (which reduces its statistics over it) read one value instead of
probing a strategy's attributes. Tensor- or pipeline-parallel ranks that hold the same data share a ``rank``::

    view = model.data_parallel
    loader = DataLoader(dataset, batch_size, collate, dp_rank=view.rank, dp_size=view.size)
    total = view.sum(torch.tensor([local_count]))   # over the data-parallel ranks only
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twinkle_core import distributed

if TYPE_CHECKING:  # importing the model contract imports no torch (recipe checking runs without it)
    import torch


@dataclass(frozen=True)
class DataParallelView:
    rank: int = 0
    size: int = 1
    #: the process group over which data-parallel ranks reduce (``None``: the whole world)
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"data-parallel rank {self.rank} is not in range(size={self.size})")

    @classmethod
    def of_world(cls) -> DataParallelView:
        """Every process a data-parallel rank (no model parallelism); one rank without a process group."""
        return cls(distributed.rank(), distributed.world_size())

    @property
    def active(self) -> bool:
        """Whether reductions communicate (several data-parallel ranks in a started process group)."""
        return self.size > 1 and distributed.world_size() > 1

    def sum(self, value: torch.Tensor, device: Any = None) -> torch.Tensor:
        """``value`` summed over the data-parallel ranks, returned on ``value``'s device (unchanged when not
        :attr:`active`). ``device`` is where the reduction runs (the accelerator's; gloo reduces CPU tensors)."""
        if not self.active:
            return value
        reduced = distributed.all_reduce_sum(value.to(device) if device is not None else value.clone(),
                                             group=self.group)
        return reduced.to(value.device)

    def max(self, value: torch.Tensor, device: Any = None) -> torch.Tensor:
        """``value`` maximised element-wise over the data-parallel ranks (unchanged when not :attr:`active`)."""
        if not self.active:
            return value
        import torch.distributed as dist

        local = value.to(device) if device is not None else value.clone()
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
        return local.to(value.device)
