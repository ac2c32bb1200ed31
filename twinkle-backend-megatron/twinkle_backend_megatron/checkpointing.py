"""Optimizer state through megatron-core's ``dist_checkpointing``: resumable at another parallel layout.

Each optimizer state tensor (Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's momentum ...) has its
parameter's shape, so it is saved as a ``ShardedTensor`` with that parameter's sharding metadata
(taken from the model's own ``sharded_state_dict``: TP partition, global layer index under PP /
VPP, expert index under EP, tied-embedding replicas). ``dist_checkpointing`` then reassembles any
shard a rank of the new layout asks for, so a checkpoint written at TP=2 resumes at TP=1 or PP=2.

Per-parameter scalars (Adam's ``step``) and the parameter groups' hyper-parameters are small and
identical across ranks; they are gathered and written once as the checkpoint's common state.

LoRA adapters and the distributed optimizer keep the per-rank format (same layout to resume, see
:class:`~twinkle_backend_megatron.strategy.MegatronStrategy`): adapter weights are not part of
megatron-core's sharding metadata, and megatron-core's resharding formats for its
``DistributedOptimizer`` do not run on CPU in 0.16.1 (``fully_reshardable`` allocates CUDA tensors,
``fully_sharded_model_space`` fails with ``flattened_range is not supported``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from twinkle_backend_megatron.weights import chunks_of
from twinkle_core.errors import ConfigError

#: the folder inside a checkpoint's training state that holds the dist_checkpointing files
DIST_DIR = "megatron_optimizer"
_FORMAT = "twinkle-megatron-optimizer-v1"


def model_sharded_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """The model chunks' sharding metadata, one entry per chunk (global keys never collide across chunks)."""
    return {f"chunk{i}": chunk.sharded_state_dict(prefix="") for i, chunk in enumerate(chunks_of(module))}


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _sharded_parameters(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Any]:
    """The model ``ShardedTensor`` of every optimizer parameter, in the optimizer's order."""
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    params = _parameters(optimizer)
    mapping = get_param_id_to_sharded_param_map(model_sharded_state_dict(module), params)
    missing = [i for i in range(len(params)) if i not in mapping]
    if missing:
        raise ConfigError(f"{len(missing)} optimizer parameter(s) have no megatron-core sharding metadata; only the "
                          f"base model's parameters can be checkpointed with dist_checkpointing")
    return [mapping[i] for i in range(len(params))]


def _logical_name(sharded: Any) -> str:
    """A parameter's layout-independent name: its key plus the stacked axes (layer, expert) it sits at.

    Layers share one key (``decoder.layers.self_attention.linear_qkv.weight``) with the layer index as a
    prepended axis; the TP offsets that follow change with the layout and are left out.
    """
    if not hasattr(sharded, "global_offset"):  # a ShardedTensorFactory (e.g. SwiGLU's fused fc1): its first tensor
        from megatron.core.dist_checkpointing.dict_utils import nested_values

        sharded = next(iter(nested_values(sharded.build())))
    stacked = tuple(sharded.global_offset[: sharded.prepend_axis_num])
    return f"{sharded.key}@{','.join(map(str, stacked))}"


def _is_param_shaped(value: Any, param: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == tuple(param.shape)


def _all_gather(value: Any) -> list[Any]:
    import torch.distributed as dist

    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, value)
    return parts


def save_optimizer(directory: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write ``optimizer``'s state under ``directory/megatron_optimizer`` (collective over all ranks)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    params = _parameters(optimizer)
    sharded_params = _sharded_parameters(module, optimizer)
    state = optimizer.state_dict()["state"]
    tensors: dict[str, dict[str, Any]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    names: set[str] = set()
    for index, values in state.items():
        param, sharded = params[index], sharded_params[index]
        for name, value in values.items():
            if _is_param_shaped(value, param):
                names.add(name)
                tensors.setdefault(str(index), {})[name] = make_sharded_optimizer_tensor(
                    sharded, value.detach(), prefix=f"optimizer.state.{name}")
            else:
                scalars.setdefault(_logical_name(sharded), {})[name] = value.cpu() if torch.is_tensor(value) else value
    gathered = _all_gather((sorted(names), scalars))  # one collective for both
    common = {
        "format": _FORMAT,
        "optimizer_class": type(optimizer).__name__,
        "state_names": sorted({name for part_names, _ in gathered for name in part_names}),
        "scalars": {key: value for _, part_scalars in gathered for key, value in part_scalars.items()},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
    }
    path = os.path.join(directory, DIST_DIR)
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    _fork_the_results_queue()
    dist_checkpointing.save({"state": tensors, "common": common}, path)


def _fork_the_results_queue() -> None:
    """megatron-core's checkpoint writer collects its workers' results through a multiprocessing manager that it
    starts with the *spawn* method, which re-imports the user's main script: a training script without an
    ``if __name__ == "__main__":`` guard then trains again in that child, and the save hangs or dies with
    ``EOFError``. Its writer workers are forked anyway; the manager is forked the same way (once per process,
    before megatron-core would create its own)."""
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def load_optimizer(directory: str, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the state :func:`save_optimizer` wrote into ``optimizer``, at whatever layout this job runs."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    path = os.path.join(directory, DIST_DIR)
    common = dist_checkpointing.load_common_state_dict(path)["common"]
    if common.get("format") != _FORMAT:
        raise ConfigError(f"{path} is not a Twinkle Megatron optimizer checkpoint")
    if common["optimizer_class"] != type(optimizer).__name__:
        raise ConfigError(f"the checkpoint in {directory} holds {common['optimizer_class']} state, but this run's "
                          f"optimizer is {type(optimizer).__name__}; resume with the same optimizer")
    if len(common["param_groups"]) != len(optimizer.param_groups):
        raise ConfigError(f"the checkpoint's optimizer has {len(common['param_groups'])} parameter group(s), this "
                          f"run's has {len(optimizer.param_groups)}")
    params = _parameters(optimizer)
    sharded_params = _sharded_parameters(module, optimizer)
    request: dict[str, dict[str, Any]] = {}
    for index, (param, sharded) in enumerate(zip(params, sharded_params)):
        request[str(index)] = {name: make_sharded_optimizer_tensor(sharded, torch.empty_like(param.detach()),
                                                                    prefix=f"optimizer.state.{name}")
                                for name in common["state_names"]}
    loaded = dist_checkpointing.load({"state": request}, path)["state"]
    state = {}
    for index, sharded in enumerate(sharded_params):
        values = dict(common["scalars"].get(_logical_name(sharded), {}))
        values.update({name: tensor.to(params[index].device) for name, tensor in loaded[str(index)].items()})
        state[index] = values
    groups, start = [], 0
    for saved, group in zip(common["param_groups"], optimizer.param_groups):
        groups.append({**saved, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
