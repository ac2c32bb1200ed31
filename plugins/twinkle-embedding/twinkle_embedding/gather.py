"""All-gather of rows of different counts per rank, with the gradient flowing back to the local shard.

Rank ``r`` computes a loss ``L_r`` over the gathered rows of every rank. The backward of the
gather sums the gradients of all ranks (one all-reduce) and returns this rank's slice, so the local
rows receive ``d(sum_r L_r) / d(local rows)``: the gradient of the *global* loss. DDP then averages
the parameter gradients over ranks and the model's global token normalisation undoes that average,
which is what makes two ranks give exactly the single-process gradient of the concatenated batch.

Only ``all_gather`` and ``all_reduce`` are used, so it runs on gloo (CPU) as well as nccl.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _gather_padded(tensor: torch.Tensor, sizes: list[int], group: Any) -> torch.Tensor:
    width = max(sizes)
    padded = tensor.new_zeros((width, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    buffers = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(buffers, padded.contiguous(), group=group)
    return torch.cat([b[:n] for b, n in zip(buffers, sizes)], dim=0)


def gather_sizes(count: int, device: torch.device, group: Any = None) -> list[int]:
    """Every rank's ``count`` (rank order of ``group``)."""
    world = dist.get_world_size(group)
    mine = torch.tensor([int(count)], dtype=torch.long, device=device)
    buffers = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(buffers, mine, group=group)
    return [int(b.item()) for b in buffers]


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, sizes: list[int], rank: int, group: Any) -> torch.Tensor:
        ctx.sizes, ctx.rank, ctx.group = sizes, rank, group
        return _gather_padded(tensor.detach(), sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start:start + ctx.sizes[ctx.rank]], None, None, None


def all_gather_rows(tensor: torch.Tensor, sizes: list[int], group: Any = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` (``sizes[r]`` rows on rank ``r``) along dim 0.

    Differentiable when ``tensor`` requires grad (see the module docstring); integer tensors are
    gathered as they are.
    """
    rank = dist.get_rank(group)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _GatherWithGrad.apply(tensor, sizes, rank, group)
    return _gather_padded(tensor, sizes, group)


__all__ = ["all_gather_rows", "gather_sizes"]
