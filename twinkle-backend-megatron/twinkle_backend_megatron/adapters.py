"""LoRA adapters on a ``MegatronModel``: adding, removing, activating and gathering them.

The adapter layers themselves (sharded like the base layers they hang under) are ``lora.py``'s ``MegatronLora``;
:class:`MegatronAdapters` is what the model's adapter hooks call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from twinkle_backend_megatron import convert
from twinkle_backend_megatron.weights import chunks_of, gather_over_pipeline
from twinkle_core.errors import ConfigError


class MegatronAdapters:
    """The LoRA adapters of one Megatron network (``module``: one chunk or a ``ModuleList`` of chunks)."""

    def __init__(self, module: torch.nn.Module, spec: convert.ModelSpec, *, seed: int, pp: int,
                 sequence_parallel: bool) -> None:
        self.module, self.spec, self.seed, self.pp = module, spec, seed, pp
        self.sequence_parallel = sequence_parallel
        self.lora: Any = None  # lora.MegatronLora, made with the first adapter

    def attach(self, adapter_name: str, config: Any, device: torch.device) -> None:
        from twinkle_backend_megatron.lora import MegatronLora

        if self.sequence_parallel:
            raise ConfigError("LoRA adapters with sequence_parallel=True are not supported yet")
        if self.lora is None:
            for p in self.module.parameters():  # the base is frozen once it carries adapters (as PEFT does)
                p.requires_grad_(False)
            self.lora = MegatronLora(chunks_of(self.module), self.spec, self.seed)
        self.lora.add(adapter_name, config)
        self.module.to(device)

    def detach(self, adapter_name: str) -> None:
        self.lora.remove(adapter_name)

    def config(self, adapter_name: str) -> Any:
        """The adapter's ``peft.LoraConfig``."""
        return self.lora.configs[adapter_name]

    @contextlib.contextmanager
    def activate(self, adapter_name: str | None) -> Iterator[None]:
        """``adapter_name`` (``None``: none) is the adapter the LoRA hooks apply; the previous one after."""
        if self.lora is None:
            yield
            return
        previous = self.lora.active.name
        self.lora.active.name = adapter_name
        try:
            yield
        finally:
            self.lora.active.name = previous

    def parameter_names(self, adapter_name: str) -> list[str]:
        return self.lora.parameter_names(adapter_name)

    def state_dict(self, adapter_name: str) -> dict[str, torch.Tensor]:
        """Full PEFT-named weights of the adapter, on every rank (collective over TP and PP)."""
        return gather_over_pipeline(self.lora.full_state_dict(adapter_name), self.pp)

    def local_state(self, adapter_name: str, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shards (keyed like the model's parameters) from full PEFT-named weights."""
        return self.lora.local_state(adapter_name, full)
