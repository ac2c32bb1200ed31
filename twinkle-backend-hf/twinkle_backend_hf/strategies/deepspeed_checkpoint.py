"""Weights and optimizer state of :class:`~twinkle_backend_hf.strategies.deepspeed.DeepSpeedStrategy`.

:class:`ZeroCheckpoints` moves full (gathered, fp32 master) weights out of and into a wrapped module whose
engine exists, writes ``engine.save_checkpoint`` / reads ``load_checkpoint`` under ``<state dir>/deepspeed``
with a layout file that refuses an incompatible resume, and keeps the other adapters' weights and optimizer
states when one adapter's state is loaded into the shared engine. The strategy builds it from its settings
and hands each call the engine and the wrapped module.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from twinkle_backend_hf.strategies.deepspeed_module import DeepSpeedModule
from twinkle_backend_hf.strategies.model_parts import requiring_grad
from twinkle_core.errors import ConfigError
from twinkle_core.strategy import OptimizerHandle

CHECKPOINT_SUBDIR = "deepspeed"
CHECKPOINT_TAG = "twinkle"
LAYOUT_FILE = "twinkle_layout.json"

#: one module's parameters paired with the full values to write into them
ParameterPairs = list[tuple[torch.nn.Parameter, torch.Tensor]]


class ZeroCheckpoints:
    """Full weights and ZeRO checkpoints of one strategy's engines (``deepspeed``: the imported package)."""

    def __init__(self, *, deepspeed: Any, stage: int, bf16: bool, device: torch.device) -> None:
        self.deepspeed = deepspeed
        self.stage = stage
        self.bf16 = bf16
        self.device = device

    # ------------------------------------------------------------------ full weights
    def gathered(self, params: list[torch.nn.Parameter], modifier_rank: int | None = None) -> Any:
        """Context in which ZeRO-3's partitioned ``params`` are whole (nothing for unpartitioned ones)."""
        partitioned = [p for p in params if hasattr(p, "ds_id")]
        if not partitioned:
            return contextlib.nullcontext()
        return self.deepspeed.zero.GatheredParameters(partitioned, modifier_rank=modifier_rank)

    def full_parameters(self, wrapped: DeepSpeedModule, only: set[int] | None = None) -> dict[int, torch.Tensor]:
        """Complete copies (on CPU) of the engine's parameters, by ``id``: gathered under ZeRO-3, and the fp32
        master weights of the optimized parameters when the engine trains in bf16. ``only`` limits the ids.
        Every rank must call it (ZeRO-3 gathers)."""
        full: dict[int, torch.Tensor] = {}
        if self.stage == 3:
            for submodule in wrapped.module.modules():
                params = [p for p in submodule.parameters(recurse=False) if only is None or id(p) in only]
                if not params:
                    continue
                with self.gathered(params):
                    for p in params:
                        full[id(p)] = p.detach().to("cpu", copy=True)
        if self.bf16:
            from deepspeed.utils import safe_get_full_fp32_param

            owned = [p for p in wrapped.owned_parameters() if only is None or id(p) in only]
            with requiring_grad(owned):
                for p in owned:
                    master = safe_get_full_fp32_param(p)
                    if master is not None:
                        shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
                        full[id(p)] = master.detach().to("cpu", copy=True).view(shape)
        return full

    def full_state_dict(self, wrapped: DeepSpeedModule) -> dict[str, torch.Tensor]:
        """The complete weights, on every rank (ZeRO-3 gathers one submodule at a time)."""
        full = self.full_parameters(wrapped)
        return {key: full.get(id(value), value.detach())
                for key, value in wrapped.module.state_dict(keep_vars=True).items()}

    def load_full_weights(self, wrapped: DeepSpeedModule, state_dict: dict[str, torch.Tensor],
                          strict: bool = True) -> None:
        """Write complete weights into the module (ZeRO-3: into its partitions) and into the fp32 master
        weights the optimizer keeps, so the next step continues from them."""
        raw = wrapped.module
        expected = set(raw.state_dict(keep_vars=True))
        _check_keys(expected, state_dict, strict)
        pairs_by_module, parameter_keys = _parameter_pairs(raw, state_dict)
        buffers = {k: v for k, v in state_dict.items() if k in expected and k not in parameter_keys}
        if buffers:
            raw.load_state_dict(buffers, strict=False)
        with torch.no_grad():
            for pairs in pairs_by_module:
                with self.gathered([p for p, _ in pairs], modifier_rank=0):
                    for p, value in pairs:
                        p.data.copy_(value.to(p.device, p.dtype).view_as(p.data))
        # The fp32 master weights are a separate copy: update them too, or the next step would write the
        # old weights back.
        self._set_master_weights(wrapped, [pair for pairs in pairs_by_module for pair in pairs])

    def _set_master_weights(self, wrapped: DeepSpeedModule, pairs: ParameterPairs) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        owned = {id(p) for p in wrapped.owned_parameters()}
        targets = [(p, value) for p, value in pairs if id(p) in owned]
        with requiring_grad([p for p, _ in targets]):
            for p, value in targets:
                safe_set_full_fp32_param(p, value.to(self.device, torch.float32))

    # ------------------------------------------------------------------ optimizer state
    def layout(self, wrapped: DeepSpeedModule, dp_size: int) -> dict[str, Any]:
        """What a saved optimizer state must match to be resumed."""
        return {"stage": self.stage, "dp_size": dp_size, "bf16": self.bf16,
                "optimizers": len(wrapped.handles), "parameters": [len(h.parameters) for h in wrapped.handles]}

    def save(self, engine: Any, directory: str, layout: dict[str, Any], *, write_layout: bool) -> None:
        """``engine.save_checkpoint`` into ``directory/deepspeed`` (each rank writes its partitions); the rank with
        ``write_layout`` writes the layout file next to it."""
        path = os.path.join(directory, CHECKPOINT_SUBDIR)
        # Twinkle exports the weights itself, so DeepSpeed's module copy holds only what trains.
        engine.save_checkpoint(path, tag=CHECKPOINT_TAG, client_state={}, save_latest=False,
                               exclude_frozen_parameters=True)
        if write_layout:
            with open(os.path.join(path, LAYOUT_FILE), "w") as fh:
                json.dump(layout, fh, indent=2)

    @staticmethod
    def check_saved(directory: str, layout: dict[str, Any]) -> None:
        """Refuse a directory without DeepSpeed state, or one saved with another layout."""
        path = os.path.join(directory, CHECKPOINT_SUBDIR)
        if not os.path.isdir(os.path.join(path, CHECKPOINT_TAG)):
            raise FileNotFoundError(f"{directory} holds no DeepSpeed optimizer state ({path}/{CHECKPOINT_TAG}); "
                                    f"was it saved with strategy 'deepspeed'?")
        if not os.path.isfile(os.path.join(path, LAYOUT_FILE)):
            return
        with open(os.path.join(path, LAYOUT_FILE)) as fh:
            saved = json.load(fh)
        if saved != layout:
            raise ConfigError(f"the DeepSpeed optimizer state in {path} was saved with {saved}, but this model has "
                              f"{layout}; resume with the same ZeRO stage, precision, number of ranks and optimizers "
                              f"(set_optimizer for the same adapters, in the same order)")

    def load(self, engine: Any, wrapped: DeepSpeedModule, directory: str, handle: OptimizerHandle) -> None:
        """``engine.load_checkpoint``: the optimizer state and fp32 master weights of this optimizer's partitions.

        The weights themselves were loaded already. When several optimizers (adapters) share the engine, only
        ``handle``'s is restored: the others' weights and optimizer states are kept as they are.
        """
        path = os.path.join(directory, CHECKPOINT_SUBDIR)
        kept = self._snapshot_others(engine, wrapped, handle) if wrapped.optimizer_group is not None else None
        loaded, _ = engine.load_checkpoint(path, tag=CHECKPOINT_TAG, load_module_strict=False,
                                           load_optimizer_states=True, load_lr_scheduler_states=False,
                                           custom_load_fn=_keep_module_weights)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the optimizer state from {path}")
        if kept is not None:
            self._restore_others(engine, wrapped, kept)

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
                wrapped.optimizer_group.refresh_groups()
            zero._clear_fp32_optimizer_param_groups()

    def _snapshot_others(self, engine: Any, wrapped: DeepSpeedModule, handle: OptimizerHandle) -> Any:
        others = [other for other in wrapped.handles if other is not handle]
        params = [p for other in others for p in other.parameters]
        names = {id(p): name for name, p in wrapped.module.named_parameters()}
        full = self.full_parameters(wrapped, only={id(p) for p in params})
        weights = {names[id(p)]: full[id(p)] if id(p) in full else p.detach().to("cpu", copy=True)
                   for p in params if id(p) in names}
        with self._groups_populated(engine, wrapped):
            states = [(o.optimizer, copy.deepcopy(o.optimizer.state_dict())) for o in others]
        return weights, states

    def _restore_others(self, engine: Any, wrapped: DeepSpeedModule, kept: Any) -> None:
        weights, states = kept
        with self._groups_populated(engine, wrapped):
            for o, state in states:
                o.load_state_dict(state)
            wrapped.optimizer_group.refresh_groups()
        self.load_full_weights(wrapped, weights, strict=False)


def _check_keys(expected: set[str], state_dict: dict[str, torch.Tensor], strict: bool) -> None:
    missing = sorted(expected - set(state_dict))
    unexpected = sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise KeyError(f"state dict does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _parameter_pairs(raw: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> tuple[list[ParameterPairs], set[str]]:
    """Each submodule's own parameters paired with their values in ``state_dict`` (a shared parameter once), and
    every parameter key of ``raw``."""
    pairs_by_module: list[ParameterPairs] = []
    parameter_keys: set[str] = set()
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
    return pairs_by_module, parameter_keys


def _keep_module_weights(src: Any = None, dst: Any = None) -> None:
    """``custom_load_fn`` for ``engine.load_checkpoint``: Twinkle has loaded the weights already."""
