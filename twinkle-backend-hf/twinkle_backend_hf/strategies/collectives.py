"""What the Hugging Face backend's strategies do across ranks: join the process group, build the torch device
meshes FSDP2 shards over (cached), and measure a gradient norm over every shard."""

from __future__ import annotations

import os
from typing import Any

import torch

from twinkle_core import distributed

_MESHES: dict[tuple[Any, ...], Any] = {}


def ensure_process_group(backend: str) -> None:
    """Join the torchrun job, or start a one-rank group so DDP/FSDP2 also run in a plain ``python`` process."""
    import torch.distributed as dist

    if distributed.init_process_group(backend):
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """A cached ``torch.distributed.device_mesh.DeviceMesh`` (a new 2-D mesh would create new groups each time)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    default_group = dist.distributed_c10d._get_default_group()
    key = (device_type, shape, names, id(default_group))
    mesh = _MESHES.get(key)
    if mesh is None:
        _MESHES.clear()  # a new default group (re-initialised job) invalidates every cached mesh
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        _MESHES[key] = mesh
    return mesh


def grad_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of all ``grads`` as one vector, over every shard (DTensor gradients are reduced).

    Returns a plain (non-DTensor) scalar tensor.
    """
    from torch.distributed.tensor import DTensor

    norm_type = float(norm_type)
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    parts = []
    if sharded:
        # group by mesh: gradients on different meshes cannot be stacked into one DTensor
        by_mesh: dict[Any, list[torch.Tensor]] = {}
        for g in sharded:
            by_mesh.setdefault(g.device_mesh, []).append(g)
        for group in by_mesh.values():
            norm = torch.nn.utils.get_total_norm(group, norm_type)
            parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if plain:
        parts.append(torch.nn.utils.get_total_norm(plain, norm_type))
    if not parts:
        return torch.tensor(0.0)
    device = parts[0].device
    # at least float32 (bf16 / fp16 parts would lose the sum), and float64 stays float64: a float64 run's clipping
    # factor must not be rounded to float32 (its FSDP2 run then drifts from one process at 1e-8, not 1e-16)
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in parts) else torch.float32
    return torch.linalg.vector_norm(torch.stack([p.to(device=device, dtype=dtype) for p in parts]), norm_type)
