"""A dedicated two-process group for weight sync: trainer rank 0 (rank 0 here) sends, a sampler actor (rank 1)
receives, in buckets, outside the trainer's own ``torch.distributed`` group.

The tensors of an update are grouped by dtype, in state-dict order, into flat buckets of at most ``bucket_bytes``
(one larger tensor is a bucket of its own); the receiver learns the plan (names, shapes, dtypes) through the Ray
call that starts the transfer, allocates each bucket and receives it with a broadcast from rank 0. The group is
gloo over TCP (``torch.distributed.TCPStore`` + ``ProcessGroupGloo``), so tensors travel from host memory; an
NCCL / HCCL transport for accelerators is not built.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in a bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int


def plan_buckets(state: dict[str, Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[TensorSlot]]:
    """The buckets an update is sent in: same-dtype tensors, in the state dict's order, up to ``bucket_bytes``."""
    buckets: list[list[TensorSlot]] = []
    open_by_dtype: dict[str, tuple[list[TensorSlot], int]] = {}
    for name, tensor in state.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        size = tensor.numel() * tensor.element_size()
        bucket, used = open_by_dtype.get(dtype, (None, 0))
        if bucket is None or used + size > bucket_bytes:
            bucket, used = [], 0
            buckets.append(bucket)
        bucket.append(TensorSlot(name, tuple(tensor.shape), dtype, tensor.numel()))
        open_by_dtype[dtype] = (bucket, used + size)
    return buckets


def pack(state: dict[str, Any], bucket: list[TensorSlot]) -> Any:
    import torch

    return torch.cat([state[slot.name].detach().reshape(-1).cpu() for slot in bucket])


def unpack(flat: Any, bucket: list[TensorSlot]) -> dict[str, Any]:
    out, start = {}, 0
    for slot in bucket:
        out[slot.name] = flat[start:start + slot.numel].view(slot.shape).clone()
        start += slot.numel
    return out


def empty_bucket(bucket: list[TensorSlot]) -> Any:
    import torch

    return torch.empty(sum(slot.numel for slot in bucket), dtype=getattr(torch, bucket[0].dtype))


class WeightChannel:
    """One end of the group. The receiver is created first (:meth:`listen`, which starts the store on a free port
    of its node), then both ends :meth:`connect` (each blocks until the other has joined)."""

    SENDER, RECEIVER = 0, 1

    def __init__(self, host: str, port: int, rank: int, timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        self.host, self.port, self.rank = host, port, rank
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, port, 2, is_master=rank == self.RECEIVER, wait_for_workers=False,
                                   timeout=self.timeout)
        self.group: Any = None

    @classmethod
    def listen(cls, host: str, timeout_s: float = 600.0) -> WeightChannel:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        return cls(host, port, cls.RECEIVER, timeout_s)

    def connect(self) -> None:
        import torch.distributed as dist

        if self.group is None:
            self.group = dist.ProcessGroupGloo(self.store, self.rank, 2, self.timeout)

    def broadcast(self, flat: Any) -> Any:
        """Send (sender) or receive into (receiver) one bucket."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = self.SENDER
        self.group.broadcast([flat], options).wait()
        return flat

    def send(self, state: dict[str, Any], buckets: list[list[TensorSlot]]) -> None:
        for bucket in buckets:
            self.broadcast(pack(state, bucket))

    def receive(self, buckets: list[list[TensorSlot]]) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for bucket in buckets:
            state.update(unpack(self.broadcast(empty_bucket(bucket)), bucket))
        return state
