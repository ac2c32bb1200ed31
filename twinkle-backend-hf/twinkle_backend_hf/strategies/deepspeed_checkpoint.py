"""Weights and optimizer state of :class:`~twinkle_backend_hf.strategies.deepspeed.DeepSpeedStrategy`.

Full (gathered, fp32 master) weights out and in, ``engine.save_checkpoint`` / ``load_checkpoint`` into
``<state dir>/deepspeed`` with a layout file that refuses an incompatible resume, and keeping the other
adapters' weights and optimizer states when one adapter's state is loaded into the shared engine. The
methods live in a mixin so the strategy class stays readable; they rely on the strategy's ``stage``,
``bf16``, ``deepspeed``, ``accelerator``, ``_engine``, ``_wrapper`` and ``_create_engine``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from twinkle_backend_hf.strategies import _dist
from twinkle_backend_hf.strategies.deepspeed_module import DeepSpeedModule
from twinkle_core.errors import ConfigError
from twinkle_core.strategy import OptimizerHandle

_CHECKPOINT_SUBDIR = "deepspeed"
_CHECKPOINT_TAG = "twinkle"
_LAYOUT_FILE = "twinkle_layout.json"


class _DeepSpeedCheckpoints:
    """Mixed into :class:`~twinkle_backend_hf.strategies.deepspeed.DeepSpeedStrategy` (before ``Strategy``,
    so ``super()`` reaches the plain-torch behaviour used before the engine exists)."""

    def _gathered(self, params: list[torch.nn.Parameter], modifier_rank: int | None = None) -> Any:
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        if not partitioned:
            return contextlib.nullcontext()
        return self.deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)

    def _full_parameters(self, module: torch.nn.Module,
                         only: set[int] | None = None) -> dict[int, torch.Tensor]:
        """Complete copies (on CPU) of the engine's parameters, by ``id``: gathered under ZeRO-3, and the fp32
        master weights of the optimized parameters when the engine trains in bf16. ``only`` limits the ids.
        Every rank must call it (ZeRO-3 gathers)."""
        raw = self.unwrap_module(module)
        full: dict[int, torch.Tensor] = {}
        if self.stage == 3:
            for submodule in raw.modules():
                params = [p for p in submodule.parameters(recurse=False) if only is None or id(p) in only]
                if not params:
                    continue
                with self._gathered(params):
                    for p in params:
                        full[id(p)] = p.detach().to("cpu", copy=True)
        if self.bf16:
            from deepspeed.utils import safe_get_full_fp32_param

            owned = [p for p in self._wrapper(module).owned_parameters() if only is None or id(p) in only]
            with _dist.requiring_grad(owned):
                for p in owned:
                    master = safe_get_full_fp32_param(p)
                    if master is not None:
                        shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
                        full[id(p)] = master.detach().to("cpu", copy=True).view(shape)
        return full

    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The complete weights, on every rank (ZeRO-3 gathers one submodule at a time)."""
        raw = self.unwrap_module(module)
        if self._engine(module) is None:
            return raw.state_dict()
        full = self._full_parameters(module)
        return {key: full.get(id(value), value.detach()) for key, value in raw.state_dict(keep_vars=True).items()}

    def load_state_dict(self, module: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                        strict: bool = True) -> None:
        """Write complete weights into the module (ZeRO-3: into its partitions) and into the fp32 master
        weights the optimizer keeps, so the next step continues from them."""
        raw = self.unwrap_module(module)
        engine = self._engine(module)
        if engine is None:
            return super().load_state_dict(module, state_dict, strict)
        expected = set(raw.state_dict(keep_vars=True))
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise KeyError(f"state dict does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
        pairs_by_module: list[list[tuple[torch.nn.Parameter, torch.Tensor]]] = []
        parameter_keys = set()
        seen: set[int] = set()
        for prefix, submodule in raw.named_modules(remove_duplicate=False):
            pairs = []
            for name, p in submodule.named_parameters(recurse=False):
                key = f"{prefix}.{name}" if prefix else name
                parameter_keys.add(key)
                if key in state_dict and id(p) not in seen:
                    seen.add(id(p))
                    pairs.append((p, state_dict[key]))
            if pairs:
                pairs_by_module.append(pairs)
        buffers = {k: v for k, v in state_dict.items() if k in expected and k not in parameter_keys}
        if buffers:
            raw.load_state_dict(buffers, strict=False)
        with torch.no_grad():
            for pairs in pairs_by_module:
                with self._gathered([p for p, _ in pairs], modifier_rank=0):
                    for p, value in pairs:
                        p.data.copy_(value.to(p.device, p.dtype).view_as(p.data))
        # The fp32 master weights are a separate copy: update them too, or the next step would write the
        # old weights back.
        from deepspeed.utils import safe_set_full_fp32_param

        owned = {id(p) for p in self._wrapper(module).owned_parameters()}
        device = self.accelerator.device() if self.accelerator is not None else torch.device("cpu")
        targets = [(p, value) for pairs in pairs_by_module for p, value in pairs if id(p) in owned]
        with _dist.requiring_grad([p for p, _ in targets]):
            for p, value in targets:
                safe_set_full_fp32_param(p, value.to(device, torch.float32))

    def _checkpoint_layout(self, module: torch.nn.Module) -> dict[str, Any]:
        wrapped = self._wrapper(module)
        return {"stage": self.stage, "dp_size": self.dp_size, "bf16": self.bf16,
                "optimizers": len(wrapped.handles), "parameters": [len(h.parameters) for h in wrapped.handles]}

    def save_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        """``engine.save_checkpoint`` into ``directory/deepspeed`` (each rank writes its partitions)."""
        engine = self._engine(module, create=True)
        if engine is None:
            return super().save_optimizer_state(directory, module, handle)
        path = os.path.join(directory, _CHECKPOINT_SUBDIR)
        # Twinkle exports the weights itself, so DeepSpeed's module copy holds only what trains.
        engine.save_checkpoint(path, tag=_CHECKPOINT_TAG, client_state={}, save_latest=False,
                               exclude_frozen_parameters=True)
        if self.is_main_process:
            with open(os.path.join(path, _LAYOUT_FILE), "w") as fh:
                json.dump(self._checkpoint_layout(module), fh, indent=2)
        self.barrier()

    def load_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        """``engine.load_checkpoint``: the optimizer state and fp32 master weights of this optimizer's partitions.

        The weights themselves were loaded already (``load``). When several optimizers (adapters) share the
        engine, only ``handle``'s is restored: the others' weights and optimizer states are kept as they are.
        """
        if not isinstance(module, DeepSpeedModule):
            return super().load_optimizer_state(directory, module, handle)
        path = os.path.join(directory, _CHECKPOINT_SUBDIR)
        if not os.path.isdir(os.path.join(path, _CHECKPOINT_TAG)):
            raise FileNotFoundError(f"{directory} holds no DeepSpeed optimizer state ({path}/{_CHECKPOINT_TAG}); "
                                    f"was it saved with strategy 'deepspeed'?")
        layout = None
        if os.path.isfile(os.path.join(path, _LAYOUT_FILE)):
            with open(os.path.join(path, _LAYOUT_FILE)) as fh:
                layout = json.load(fh)
        if layout is not None and layout != self._checkpoint_layout(module):
            raise ConfigError(f"the DeepSpeed optimizer state in {path} was saved with {layout}, but this model has "
                              f"{self._checkpoint_layout(module)}; resume with the same ZeRO stage, precision, "
                              f"number of ranks and optimizers (set_optimizer for the same adapters, in the same "
                              f"order)")
        engine = self._create_engine(module)
        kept = self._snapshot_others(module, engine, handle) if module.optimizer_group is not None else None
        loaded, _ = engine.load_checkpoint(path, tag=_CHECKPOINT_TAG, load_module_strict=False,
                                           load_optimizer_states=True, load_lr_scheduler_states=False,
                                           custom_load_fn=_keep_module_weights)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the optimizer state from {path}")
        if kept is not None:
            self._restore_others(module, engine, kept)

    @contextlib.contextmanager
    def _groups_populated(self, engine: Any, wrapped: DeepSpeedModule) -> Iterator[None]:
        """ZeRO-3 empties the torch optimizer's groups between steps; fill them with the fp32 partitions
        (as ZeRO-3 does around its own state_dict / load_state_dict) while a member's state is read or set."""
        zero = engine.optimizer
        if self.stage != 3:
            yield
            return
        zero._set_fp32_optimizer_param_groups()
        try:
            yield
        finally:
            if wrapped.optimizer_group is not None:
                wrapped.optimizer_group._refresh_groups()
            zero._clear_fp32_optimizer_param_groups()

    def _snapshot_others(self, module: torch.nn.Module, engine: Any, handle: OptimizerHandle) -> Any:
        import copy

        wrapped = self._wrapper(module)
        others = [other for other in wrapped.handles if other is not handle]
        params = [p for other in others for p in other.parameters]
        names = {id(p): name for name, p in self.unwrap_module(module).named_parameters()}
        full = self._full_parameters(module, only={id(p) for p in params})
        weights = {names[id(p)]: full[id(p)] if id(p) in full else p.detach().to("cpu", copy=True)
                   for p in params if id(p) in names}
        with self._groups_populated(engine, wrapped):
            states = [(o.optimizer, copy.deepcopy(o.optimizer.state_dict())) for o in others]
        return weights, states

    def _restore_others(self, module: torch.nn.Module, engine: Any, kept: Any) -> None:
        weights, states = kept
        wrapped = self._wrapper(module)
        with self._groups_populated(engine, wrapped):
            for o, state in states:
                o.load_state_dict(state)
            wrapped.optimizer_group._refresh_groups()
        self.load_state_dict(module, weights, strict=False)


def _keep_module_weights(src: Any = None, dst: Any = None) -> None:
    """``custom_load_fn`` for ``engine.load_checkpoint``: Twinkle has loaded the weights already."""
