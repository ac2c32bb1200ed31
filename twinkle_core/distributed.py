"""Small helpers over ``torch.distributed`` that also work in a single process."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any


def world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main_process() -> bool:
    return rank() == 0


def has_process_group() -> bool:
    """Whether this process joined its job's process group (collectives reach the other ranks). Under torchrun
    ``WORLD_SIZE`` is set from the start, but the group exists only once the model's strategy joined it."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())


#: the collective timeout every process group gets; vendor accelerators derive their own timeouts from it
DEFAULT_TIMEOUT_S = 600.0


def init_process_group(backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the job started by torchrun (no-op for one process or when already joined).

    A ``"gloo"`` job joins :data:`twinkle_core.shm_collectives.BACKEND` where the machine allows it: gloo, with
    all-reduces through shared memory between the ranks of one host (``TWINKLE_SHM_COLLECTIVES=0``: plain gloo).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    dist.init_process_group(backend=process_group_backend(backend), timeout=timedelta(seconds=timeout_s))
    return True


def process_group_backend(backend: str) -> str:
    """The ``torch.distributed`` backend a job of accelerator backend ``backend`` joins."""
    from twinkle_core import shm_collectives

    if backend != "gloo" or not shm_collectives.supported()[0]:
        return backend
    shm_collectives.register()
    return shm_collectives.BACKEND


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(value: Any, group: Any = None) -> Any:
    """Sum a tensor (in place) over ``group``; returns the tensor. Identity without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def broadcast_object(obj: Any, src: int = 0) -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
