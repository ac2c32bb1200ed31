"""Writing and reading a ``MegatronModel``'s checkpoints in Hugging Face formats.

The full model is a safetensors directory ``transformers.AutoModelForCausalLM.from_pretrained`` (a vision-language
model: ``AutoModelForImageTextToText``) loads as is;
an adapter is PEFT's files (``adapter_model.safetensors`` + ``adapter_config.json``).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from twinkle_backend_megatron import convert
from twinkle_backend_megatron.kinds import TextNetwork
from twinkle_backend_megatron.lora import file_key


class MegatronExporter:
    """Hugging Face / PEFT files of a model built from ``hf_config`` (``model_id``: its source, for PEFT's
    ``base_model_name_or_path``; ``tokenizer``: saved next to the weights when given)."""

    def __init__(self, hf_config: Any, spec: convert.ModelSpec, *, model_id: str | None, tokenizer: Any,
                 kind: Any = None) -> None:
        self.hf_config, self.spec, self.model_id, self.tokenizer = hf_config, spec, model_id, tokenizer
        #: the network's kind (kinds.py): the transformers auto class that loads the files (it names the config's
        #: ``architectures``) and the names tensors have in the files
        self.kind = kind if kind is not None else TextNetwork()

    def write_model(self, directory: str, state_dict: dict[str, torch.Tensor]) -> None:
        """``model.safetensors`` + ``config.json`` from full HF tensors."""
        from safetensors.torch import save_file
        from transformers.models.auto import modeling_auto

        tensors = {}
        for key, value in state_dict.items():
            if self.spec.tied and key == "lm_head.weight":
                continue
            tensors.update(convert.hub_layout(self.kind.file_key(key), value.detach().cpu()))
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        config = self.hf_config
        if not getattr(config, "architectures", None):
            names = {"AutoModelForCausalLM": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                     "AutoModelForImageTextToText": modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}
            config.architectures = [names[self.kind.auto_class()][config.model_type]]
        config.save_pretrained(directory)
        self._write_tokenizer(directory)

    def write_adapter(self, directory: str, state_dict: dict[str, torch.Tensor], adapter_name: str,
                      lora_config: Any) -> None:
        """PEFT's files: ``adapter_model.safetensors`` + ``adapter_config.json`` (``PeftModel.from_pretrained``)."""
        from safetensors.torch import save_file

        tensors = {file_key(k, adapter_name): v.detach().cpu().contiguous() for k, v in state_dict.items()}
        save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
        lora_config.save_pretrained(directory)
        if self.model_id:
            path = os.path.join(directory, "adapter_config.json")
            with open(path) as fh:
                saved = json.load(fh)
            saved["base_model_name_or_path"] = saved.get("base_model_name_or_path") or self.model_id
            with open(path, "w") as fh:
                json.dump(saved, fh, indent=2)
        self._write_tokenizer(directory)

    def _write_tokenizer(self, directory: str) -> None:
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)


def read_adapter(directory: str, adapter_name: str) -> dict[str, torch.Tensor]:
    """The full PEFT-named weights (``...lora_A.<adapter_name>.weight``) of the adapter files in ``directory``."""
    from safetensors.torch import load_file

    path = os.path.join(directory, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory} holds no adapter_model.safetensors")
    full = {}
    for key, value in load_file(path).items():
        for which in ("lora_A", "lora_B"):
            key = key.replace(f".{which}.weight", f".{which}.{adapter_name}.weight")
        full[key] = value
    return full
