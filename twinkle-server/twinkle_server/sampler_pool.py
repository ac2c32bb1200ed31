"""``SamplerPool``: the samplers of one hosted base model, as adapters of the model that samples for it.

A sampler is an exported PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``) loaded into the
sampling model as an extra, never trained adapter, or the base model itself (an adapter ``r=1, B=0`` on one linear
layer: exactly the base, always present, since PEFT breaks when its last adapter is deleted). The sampling model is a
multi-tenant model that lends its network to an in-process sampler (``TwinkleModel.generation_module``): the host's
own model, or a Hugging Face twin of a base that cannot lend its network (see :mod:`twinkle_server.base_model`).

Samplers are loaded when they are registered, so a bad directory fails there; at most ``max_loaded`` stay in memory,
the least recently used is reloaded from its directory when it is next used. Adapter names inside the model are the
pool's own (``sampler3``); any sampler id works.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from twinkle_server.errors import BadRequest, NotFound

__all__ = ["BASE_ADAPTER", "SamplerPool", "peft_config", "remove_adapter"]

#: the base model's adapter inside the sampling model
BASE_ADAPTER = "hostbase"


class SamplerPool:
    def __init__(self, model: Any, *, name: str, max_lora_rank: int, max_loaded: int = 8) -> None:
        self.model, self.name, self.max_lora_rank, self.max_loaded = model, name, max_lora_rank, max(1, max_loaded)
        self._directories: dict[str, Path | None] = {}  # sampler id -> exported adapter directory (None: the base)
        self._loaded: OrderedDict[str, str] = OrderedDict()  # sampler id -> model adapter name, least recent first
        self._count = 0
        first = next(n for n, m in model.network.named_modules() if isinstance(m, torch.nn.Linear))
        model.add_adapter_to_model(BASE_ADAPTER, {"r": 1, "lora_alpha": 1, "target_modules": [first]})

    def load(self, sampler_id: str, directory: Path | None) -> None:
        """``sampler_id`` samples from the adapter exported at ``directory`` (``None``: the base model) from now on."""
        self.unload(sampler_id)
        self._directories[sampler_id] = Path(directory) if directory is not None else None
        try:
            self.adapter(sampler_id)
        except BaseException:
            del self._directories[sampler_id]
            raise

    def unload(self, sampler_id: str) -> None:
        name = self._loaded.pop(sampler_id, None)
        if name is not None:
            remove_adapter(self.model, name)
        self._directories.pop(sampler_id, None)

    @contextlib.contextmanager
    def generation(self, sampler_id: str | None) -> Iterator[Any]:
        """The sampling model's ``GenerationModule`` with ``sampler_id``'s adapter (``None``: the base) active."""
        with self.model.generation_module(adapter_name=self.adapter(sampler_id)) as gen:
            yield gen

    def adapter(self, sampler_id: str | None) -> str:
        """The model adapter that samples for ``sampler_id`` (``None``: the base), loaded if it is not."""
        if sampler_id is None:
            return BASE_ADAPTER
        if sampler_id not in self._directories:
            raise NotFound(f"sampler {sampler_id!r} is not loaded on {self.name}; load its weights first")
        directory = self._directories[sampler_id]
        if directory is None:
            return BASE_ADAPTER
        if sampler_id in self._loaded:
            self._loaded.move_to_end(sampler_id)
            return self._loaded[sampler_id]
        while len(self._loaded) >= self.max_loaded:
            remove_adapter(self.model, self._loaded.popitem(last=False)[1])
        self._count += 1
        name = f"sampler{self._count}"
        config = peft_config(directory, self.max_lora_rank)
        try:
            self.model.add_adapter_to_model(name, config)
            self.model.load(str(directory), adapter_name=name)
        except (OSError, KeyError, RuntimeError, ValueError) as exc:  # ConfigError is a ValueError
            if name in self.model.tenants():
                remove_adapter(self.model, name)
            raise BadRequest(f"the adapter at {directory} does not fit base model {self.name}: {exc}") from exc
        self._loaded[sampler_id] = name
        return name


def remove_adapter(model: Any, name: str) -> None:
    """``model.remove_adapter(name)`` without PEFT's warning about the active adapter (the next forward picks its
    own)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Adapter .* was active which is now deleted")
        model.remove_adapter(name)


def peft_config(directory: Path, max_lora_rank: int) -> Any:
    """The ``peft.LoraConfig`` of the adapter exported at ``directory`` (inference mode); NotFound / BadRequest
    naming what is missing or wrong."""
    import peft

    if not (directory / "adapter_config.json").is_file() or not (directory / "adapter_model.safetensors").is_file():
        raise NotFound(f"{directory} holds no exported adapter (adapter_config.json + adapter_model.safetensors)")
    try:
        config = peft.LoraConfig.from_pretrained(str(directory))
    except (OSError, ValueError, TypeError) as exc:
        raise BadRequest(f"{directory}/adapter_config.json is not a LoRA config: {exc}") from exc
    rank = max([config.r, *(config.rank_pattern or {}).values()])
    if rank > max_lora_rank:
        raise BadRequest(f"the adapter at {directory} has LoRA rank {rank}, above max_lora_rank={max_lora_rank}")
    config.inference_mode = True
    return config
