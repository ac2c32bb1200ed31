"""Helpers shared by the Hugging Face backend's parallel strategies (DDP, FSDP2, Accelerate)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from twinkle_core import capabilities, distributed
from twinkle_core.mesh import DeviceMesh

logger = logging.getLogger("twinkle.strategies")

_MESHES: dict[tuple[Any, ...], Any] = {}


def ensure_process_group(backend: str) -> None:
    """Join the torchrun job, or start a one-rank group so DDP/FSDP2 also run in a plain ``python`` process."""
    import torch.distributed as dist

    if distributed.init_process_group(backend):
        return
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def check_mesh(strategy: str, mesh: DeviceMesh, allowed: Iterable[str]) -> None:
    """Refuse mesh dimensions that ``strategy`` does not implement (the core's check, kept under its old name)."""
    capabilities.check_mesh(strategy, mesh, allowed)


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


def base_model(module: torch.nn.Module) -> torch.nn.Module:
    """The ``transformers`` model inside PEFT / DDP wrappers."""
    while True:
        if hasattr(module, "get_base_model") and callable(module.get_base_model):
            inner = module.get_base_model()
        elif isinstance(getattr(module, "module", None), torch.nn.Module):
            inner = module.module
        else:
            return module
        if inner is module:
            return module
        module = inner


def transformer_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder/encoder layers to shard one by one.

    The ``transformers`` model's ``_no_split_modules`` names them; without it, the children of the
    first ``nn.ModuleList`` (``model.layers``, ``transformer.h`` ...) are taken.
    """
    names = set(getattr(base_model(module), "_no_split_modules", None) or ())
    if names:
        blocks = [m for m in module.modules() if type(m).__name__ in names]
        # keep the outermost ones: a block class may (rarely) nest inside another
        inner = {id(c) for b in blocks for c in b.modules() if c is not b}
        blocks = [b for b in blocks if id(b) not in inner]
        if blocks:
            return blocks
    for child in module.modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) > 0:
            return list(child)
    return []


def peft_adapter_names(module: torch.nn.Module) -> list[str]:
    """Names of the PEFT adapters of ``module`` (a ``PeftModel``; empty for a plain model)."""
    config = getattr(module, "peft_config", None)
    return sorted(config) if isinstance(config, dict) else []


@contextlib.contextmanager
def requiring_grad(params: Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """Mark ``params`` trainable for the duration of the block, then restore their flags.

    PEFT freezes every adapter but the active one, while wrappers and engines that collect their
    parameters once (DDP's reducer, DeepSpeed's engine and its per-parameter fp32 APIs) skip frozen ones.
    """
    frozen = [p for p in params if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def all_adapters_trainable(module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """Every PEFT adapter's weights trainable for the block, when ``module`` holds several.

    A wrapper that registers parameters when it is built (DDP) must see every tenant's weights, or the
    adapters trained later would never be synced. One adapter (or none) is left as it is: a frozen
    reference model stays frozen.
    """
    from twinkle_backend_hf import adapters

    names = peft_adapter_names(module)
    if len(names) <= 1:
        return contextlib.nullcontext()
    wanted = {n for name in names for n in adapters.parameter_names(module, name)}
    return requiring_grad(p for n, p in module.named_parameters() if n in wanted)


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
    return torch.linalg.vector_norm(torch.stack([p.to(device).float() for p in parts]), norm_type)
