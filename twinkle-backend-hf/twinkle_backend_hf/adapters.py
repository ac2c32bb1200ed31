"""PEFT adapters by name: config translation, activation, parameter selection and plain-PEFT files."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from twinkle_backend_hf.adapter_base import recorded_base
from twinkle_core.errors import ConfigError
from twinkle_core.lora import LoraSettings

# PEFT layer attributes that hold per-adapter weights
_ADAPTER_LAYERS = {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector",
                   "modules_to_save"}
#: the PEFT LoRA options a dict config may give on this backend
LORA_OPTIONS = frozenset({"r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "use_dora",
                          "modules_to_save", "init_lora_weights", "rank_pattern", "alpha_pattern",
                          "layers_to_transform"})


def to_peft_config(config: Any) -> Any:
    """A ``peft.PeftConfig`` as is (any PEFT method), or a dict ``{"type": "lora", "r": 8, ...}`` read through the
    core's :class:`~twinkle_core.lora.LoraSettings` (the same checks and errors as every backend)."""
    import peft

    if isinstance(config, peft.PeftConfig):
        return config
    if not isinstance(config, dict):
        raise ConfigError(f"adapter config must be a dict or a peft config, got {type(config).__name__}")
    return LoraSettings.from_config(config, backend="the HF backend", supported=LORA_OPTIONS).to_peft()


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


class AdapterSwitch:
    """:func:`activate` for a model whose adapters change often (one tenant per step), in well under 1 ms.

    PEFT's ``set_adapter`` walks every module and, on every LoRA layer, every adapter's weights (12 ms with
    8 tenants on an 8-layer model). This switch keeps the LoRA layers in a list and per adapter the weights
    PEFT made trainable when it last activated it; a switch then sets the layers' active adapter and flips
    ``requires_grad`` on the old and the new adapter's weights only: the state ``set_adapter`` leaves.
    The first activation of each adapter, and any state the switch did not make itself (another adapter
    set through PEFT, merged layers, auxiliary ``modules_to_save`` wrappers), take PEFT's own path.

    Build a new switch whenever adapters are added or removed or the parameters are replaced (wrapping).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        self.module = module
        self.tuner = module.base_model  # read once: nn.Module.__getattr__ is slow on a cold cache
        self.adapters = frozenset(module.peft_config)
        modules = list(module.modules())
        self.layers = [m for m in modules if isinstance(m, BaseTunerLayer)]
        self.auxiliary = any(isinstance(m, AuxiliaryTrainingWrapper) for m in modules)
        self.trainable: dict[str, list[torch.nn.Parameter]] = {}
        self.active: str | None = None  # the adapter whose requires_grad state this switch knows

    def is_current(self, module: torch.nn.Module) -> bool:
        return module is self.module and self.module.peft_config.keys() == self.adapters

    def activate(self, name: str) -> None:
        active = self.active
        known = active is not None and self.module.active_adapter == active == self.tuner.active_adapter
        if known and name == active:
            return
        # PEFT merges (merge_adapter) every LoRA layer at once, so the first layer tells whether any is merged
        if (not known or name not in self.trainable or self.auxiliary
                or (self.layers and self.layers[0].merged_adapters)):
            self._activate_with_peft(name)
            return
        for p in self.trainable[active]:
            p.requires_grad_(False)
        # what PEFT's set_adapter stores, minus its walks over every module and every adapter's weights; these
        # are plain attributes, and nn.Module.__setattr__ costs microseconds each
        for layer in self.layers:
            object.__setattr__(layer, "_active_adapter", [name])
        for p in self.trainable[name]:
            p.requires_grad_(True)
        object.__setattr__(self.module, "active_adapter", name)
        object.__setattr__(self.tuner, "active_adapter", name)
        self.active = name

    def _activate_with_peft(self, name: str) -> None:
        self.module.set_adapter(name)
        self.active = name
        if self.auxiliary or any(getattr(layer, "_active_adapter", None) != [name] for layer in self.layers):
            return  # a layer type (or PEFT version) that keeps its active adapter elsewhere: PEFT's path only
        self.trainable[name] = [p for layer in self.layers for attr in layer.adapter_layer_names
                                if name in getattr(layer, attr)
                                for p in _weights(getattr(layer, attr)[name]) if p.requires_grad]


def _weights(entry: Any) -> list[torch.nn.Parameter]:
    """An adapter's entry in a LoRA layer's ``ModuleDict`` (a module) or ``ParameterDict`` (a parameter)."""
    return [entry] if isinstance(entry, torch.nn.Parameter) else list(entry.parameters())


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
    """``...q_proj.lora_A.tenant.weight`` -> ``...q_proj.lora_A.weight`` (PEFT's on-disk naming); a trained copy of
    a whole module (``modules_to_save``) is stored under the module's own name, as PEFT writes and reads it:
    ``...merger.modules_to_save.tenant.mlp.0.weight`` -> ``...merger.mlp.0.weight``."""
    if f".modules_to_save.{name}." in full_name:
        return full_name.replace(f".modules_to_save.{name}.", ".", 1)
    return full_name.replace(f".{name}.", ".", 1)


def save_adapter(module: torch.nn.Module, name: str, state_dict: dict[str, torch.Tensor], directory: str,
                 task_type: str | None = None, base: str | None = None) -> None:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` that ``PeftModel.from_pretrained`` loads (and,
    with ``task_type`` such as ``CAUSAL_LM``, ``peft.AutoPeftModelForCausalLM``, which infers its class from it).
    ``base``: the base model (a local directory or ``hf://`` id), recorded as
    :func:`~twinkle_backend_hf.adapter_base.recorded_base` says; default the network's ``_name_or_path``."""
    from safetensors.torch import save_file

    tensors = {_file_key(k, name): v.detach().cpu().contiguous() for k, v in state_dict.items()}
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = module.peft_config[name]
    config.save_pretrained(directory)
    with open(os.path.join(directory, "adapter_config.json")) as fh:
        saved = json.load(fh)
    base = base or getattr(module.get_base_model().config, "_name_or_path", None)
    if base:  # peft writes the network's _name_or_path, an absolute path that breaks when the run folder moves
        saved["base_model_name_or_path"] = recorded_base(base, directory)
    if task_type and not saved.get("task_type"):
        saved["task_type"] = task_type
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
        legacy = full_name.replace(f".{name}.", ".", 1)  # how modules_to_save copies were written before
        if key not in on_disk and legacy in on_disk:
            key = legacy
        if key not in on_disk:
            raise KeyError(f"adapter file {path} lacks {key}; was it saved from a different LoRA config?")
        result[full_name] = on_disk[key]
    return result
