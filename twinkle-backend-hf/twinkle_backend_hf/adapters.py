"""PEFT adapters by name: config translation, activation, parameter selection and plain-PEFT files."""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

import torch

from twinkle_core.errors import ConfigError

# PEFT layer attributes that hold per-adapter weights
_ADAPTER_LAYERS = {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                   "modules_to_save"}
#: other frameworks' names for PEFT's LoRA options
_LORA_ALIASES = {"alpha": "lora_alpha", "rank": "r", "dropout": "lora_dropout", "target": "target_modules"}
_LORA_KEYS = {"r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "use_dora",
              "modules_to_save", "init_lora_weights", "rank_pattern", "alpha_pattern", "layers_to_transform"}


def to_peft_config(config: Any) -> Any:
    """A ``peft.PeftConfig`` as is, or a dict ``{"type": "lora", "r": 8, ...}``."""
    import peft

    if isinstance(config, peft.PeftConfig):
        return config
    if not isinstance(config, dict):
        raise ConfigError(f"adapter config must be a dict or a peft config, got {type(config).__name__}")
    config = dict(config)
    kind = config.pop("type", "lora")
    if kind != "lora":
        raise ConfigError(f"adapter type {kind!r} is not supported by dict configs; pass a peft config object")
    unknown = set(config) - _LORA_KEYS
    if unknown:
        meant = {key: _LORA_ALIASES.get(key) or next(iter(difflib.get_close_matches(key, _LORA_KEYS, n=1)), None)
                 for key in sorted(unknown)}
        hints = "; ".join(f"did you mean {m!r} for {k!r}?" for k, m in meant.items() if m)
        raise ConfigError(f"unknown LoRA option(s) {sorted(unknown)}" + (f"; {hints}" if hints else "")
                          + f" Known: {sorted(_LORA_KEYS)}")
    return peft.LoraConfig(task_type=None, **config)


def add_adapter(module: torch.nn.Module, name: str, config: Any) -> torch.nn.Module:
    import peft

    if isinstance(module, peft.PeftModel):
        module.add_adapter(name, config)
        return module
    return peft.get_peft_model(module, config, adapter_name=name)


def activate(module: torch.nn.Module, name: str) -> None:
    """Route the forward through adapter ``name`` without touching other adapters' weights."""
    # PeftModel.set_adapter also makes only ``name`` trainable, so no other tenant receives gradients.
    if module.base_model.active_adapter != name or module.active_adapter != name:
        module.set_adapter(name)


def parameter_names(module: torch.nn.Module, name: str) -> list[str]:
    found = []
    for full_name, _ in module.named_parameters():
        parts = full_name.split(".")
        for i in range(1, len(parts)):
            if parts[i] == name and parts[i - 1] in _ADAPTER_LAYERS:
                found.append(full_name)
                break
    if not found:
        raise ConfigError(f"adapter {name!r} has no parameters in the model")
    return found


def _file_key(full_name: str, name: str) -> str:
    """``...q_proj.lora_A.tenant.weight`` -> ``...q_proj.lora_A.weight`` (PEFT's on-disk naming)."""
    return full_name.replace(f".{name}.", ".", 1)


def save_adapter(module: torch.nn.Module, name: str, state_dict: dict[str, torch.Tensor], directory: str) -> None:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` that ``PeftModel.from_pretrained`` loads."""
    from safetensors.torch import save_file

    tensors = {_file_key(k, name): v.detach().cpu().contiguous() for k, v in state_dict.items()}
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = module.peft_config[name]
    config.save_pretrained(directory)
    with open(os.path.join(directory, "adapter_config.json")) as fh:
        saved = json.load(fh)
    base = getattr(module.get_base_model().config, "_name_or_path", None)
    if base and not saved.get("base_model_name_or_path"):
        saved["base_model_name_or_path"] = base
        with open(os.path.join(directory, "adapter_config.json"), "w") as fh:
            json.dump(saved, fh, indent=2)


def load_adapter_state(module: torch.nn.Module, name: str, directory: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = os.path.join(directory, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory} holds no adapter_model.safetensors")
    on_disk = load_file(path)
    result = {}
    for full_name in parameter_names(module, name):
        key = _file_key(full_name, name)
        if key not in on_disk:
            raise KeyError(f"adapter file {path} lacks {key}; was it saved from a different LoRA config?")
        result[full_name] = on_disk[key]
    return result
