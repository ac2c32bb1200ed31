"""``accelerate``: FSDP2 through 🤗 Accelerate (``FullyShardedDataParallelPlugin(fsdp_version=2)``), for GPU/NPU.

Accelerate only shards the model; once prepared it is a torch ``FSDPModule`` like the one
``native_fsdp`` builds, so gradient scaling, clipping, accumulation (``no_sync``), full state
dicts and DCP optimizer checkpoints are :class:`NativeFSDPStrategy`'s. The optimizer is built
from the sharded parameters and is not wrapped by Accelerate (Twinkle steps it itself).

Never silently unsharded: Accelerate honours its FSDP plugin only for multi-device GPU/NPU/XPU
jobs; on CPU (and in a one-process job) it quietly ignores the plugin and wraps the model in DDP
or nothing (accelerate 1.16 on CPU under torchrun: ``DistributedType.NO``, the model unwrapped). There this strategy delegates to ``native_fsdp`` (torch ``fully_shard``, which does
shard on CPU too) and logs a warning saying so, or raises with ``strict=True``.

Options: ``strict`` (default ``False``), ``plugin_options`` (extra keyword arguments of
``FullyShardedDataParallelPlugin``, e.g. ``{"activation_checkpointing": True}``) and the
``native_fsdp`` options ``reshard_after_forward``, ``mixed_precision``, ``full_state_dict_on_all_ranks``.

The GPU path (``_build_accelerator`` / ``wrap_module``) needs several GPUs and is not exercised
by the CPU test suite; the CPU delegation is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from twinkle_backend_hf.strategies.fsdp import NativeFSDPStrategy
from twinkle_backend_hf.strategies.model_parts import transformer_blocks
from twinkle_core.errors import ConfigError, UnsupportedHardwareError
from twinkle_core.mesh import DeviceMesh

if TYPE_CHECKING:
    from twinkle_core.accelerator import Accelerator

logger = logging.getLogger("twinkle.strategies")

_CPU_REASON = ("on CPU, Accelerate does not apply its FullyShardedDataParallelPlugin (it wraps the model in DDP, or, "
               "as accelerate 1.16 under torchrun does, not at all): every rank would hold the whole model")
_CACHE: dict[str, Any] = {}  # one accelerate.Accelerator per process: its state is a process-wide singleton


class AccelerateStrategy(NativeFSDPStrategy):
    name = "accelerate"

    def __init__(self, mesh: DeviceMesh | None = None, *, strict: bool = False,
                 plugin_options: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(mesh, **options)
        self.options.update(strict=bool(strict), plugin_options=dict(plugin_options or {}))
        self.delegated_to: str | None = None
        self._accelerate: Any = None

    def setup(self, accelerator: Accelerator) -> None:
        cpu = accelerator.device_type == "cpu"
        if cpu and self.options["strict"]:  # refuse before joining the process group
            self._delegate(_CPU_REASON)
        super().setup(accelerator)
        if cpu:
            self._delegate(_CPU_REASON)
            return
        self._accelerate = self._build_accelerator()
        from accelerate.utils import DistributedType

        state = self._accelerate.state
        if state.distributed_type != DistributedType.FSDP or not self._accelerate.is_fsdp2:
            self._accelerate = None
            self._delegate(f"Accelerate chose distributed type {state.distributed_type} for this job (it uses FSDP "
                           f"only for multi-device GPU/NPU/XPU runs), so its FSDP plugin would not shard")

    def _delegate(self, reason: str) -> None:
        """Run as ``native_fsdp`` and say so (or raise with ``strict=True``)."""
        if self.options["strict"]:
            raise UnsupportedHardwareError(f"strategy 'accelerate' (strict=True) cannot shard here: {reason}. Use "
                                           f"strategy 'native_fsdp', or drop strict to let Twinkle delegate to it")
        self.delegated_to = NativeFSDPStrategy.name
        if self.is_main_process:
            logger.warning("strategy 'accelerate': %s; Twinkle delegates to 'native_fsdp' (torch fully_shard, "
                           "parameters sharded over %d ranks) instead. Pass strategy_options={'strict': True} "
                           "to make this an error.", reason, self.mesh.data_parallel_size)

    # ------------------------------------------------------------------ GPU path (Accelerate)
    def _build_accelerator(self) -> Any:
        from accelerate import Accelerator as HFAccelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin_kwargs = {"fsdp_version": 2, "auto_wrap_policy": "transformer_based_wrap",
                         "reshard_after_forward": self.options["reshard_after_forward"]}
        if self.options["mixed_precision"] not in (None, "no"):
            plugin_kwargs["mixed_precision_policy"] = self.mixed_precision_policy()
        plugin_kwargs.update(self.options["plugin_options"])
        kwargs: dict[str, Any] = {"mixed_precision": "no"}  # the strategy applies the precision (autocast, scaling)
        if self.mesh.dp > 1 and self.mesh.fsdp > 1:
            from accelerate.parallelism_config import ParallelismConfig

            kwargs["parallelism_config"] = ParallelismConfig(dp_replicate_size=self.mesh.dp,
                                                             dp_shard_size=self.mesh.fsdp)
        key = repr((sorted(plugin_kwargs.items(), key=str), sorted(kwargs.items(), key=str)))
        if _CACHE.get("key") != key:
            AcceleratorState._reset_state()  # a new plugin would otherwise be ignored by the shared state
            _CACHE.update(key=key, accelerator=HFAccelerator(
                fsdp_plugin=FullyShardedDataParallelPlugin(**plugin_kwargs), **kwargs))
        return _CACHE["accelerator"]

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if self._accelerate is None:
            return super().wrap_module(module)
        from torch.distributed.fsdp import FSDPModule

        if isinstance(module, FSDPModule):
            return module
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        # The plugin is shared by every model of the process and accelerate binds its wrap policy to the first
        # model's classes: point it at this model's transformer blocks before each prepare.
        plugin = self._accelerate.state.fsdp_plugin
        plugin.auto_wrap_policy = transformer_auto_wrap_policy
        plugin.transformer_cls_names_to_wrap = (self.options["plugin_options"].get("transformer_cls_names_to_wrap")
                                                or sorted({type(b).__name__ for b in transformer_blocks(module)}))
        prepared = self._accelerate.prepare(module)  # model only: the optimizer is built from the shards next
        if prepared is not module or not isinstance(prepared, FSDPModule):
            raise ConfigError(f"Accelerate returned {type(prepared).__name__} instead of sharding the model in place; "
                              f"use strategy 'native_fsdp'")
        return prepared

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "delegated_to": self.delegated_to}

