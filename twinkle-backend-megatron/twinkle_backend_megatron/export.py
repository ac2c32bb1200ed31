"""Writing and reading a ``MegatronModel``'s checkpoints in Hugging Face formats.

The full model is a safetensors directory ``transformers.AutoModelForCausalLM.from_pretrained`` loads as is;
an adapter is PEFT's files (``adapter_model.safetensors`` + ``adapter_config.json``).
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_backend_megatron import convert


class MegatronExportMixin:
    """``save()`` / ``load()`` of a ``MegatronModel`` in the Hugging Face / PEFT file layouts."""

    def export_config(self) -> Any:
        return self.hf_config

    def write_weights(self, directory: str, state_dict: dict[str, torch.Tensor], adapter_name: str | None) -> None:
        import os

        from safetensors.torch import save_file
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if adapter_name is not None:
            self._export_adapter(directory, state_dict, adapter_name)
            return
        tensors = {}
        for key, value in state_dict.items():
            if self.spec.tied and key == "lm_head.weight":
                continue
            tensors.update(convert.hub_layout(key, value.detach().cpu()))
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        config = self.hf_config
        if not getattr(config, "architectures", None):
            config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        config.save_pretrained(directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)

    def read_weights(self, directory: str, adapter_name: str | None) -> dict[str, torch.Tensor]:
        if adapter_name is not None:
            return self._import_adapter(directory, adapter_name)
        reader = convert.HFCheckpoint(directory)
        return self._local_state(reader.get, fused_experts=reader.has_fused_experts())

    def _export_adapter(self, directory: str, state_dict: dict[str, torch.Tensor], adapter_name: str) -> None:
        """PEFT's files: ``adapter_model.safetensors`` + ``adapter_config.json`` (``PeftModel.from_pretrained``)."""
        import json
        import os

        from safetensors.torch import save_file

        from twinkle_backend_megatron.lora import file_key

        tensors = {file_key(k, adapter_name): v.detach().cpu().contiguous() for k, v in state_dict.items()}
        save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
        self._adapters_config[adapter_name].save_pretrained(directory)
        if self.model_id:
            path = os.path.join(directory, "adapter_config.json")
            with open(path) as fh:
                saved = json.load(fh)
            saved["base_model_name_or_path"] = saved.get("base_model_name_or_path") or self.model_id
            with open(path, "w") as fh:
                json.dump(saved, fh, indent=2)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)

    def _import_adapter(self, directory: str, adapter_name: str) -> dict[str, torch.Tensor]:
        import os

        from safetensors.torch import load_file

        path = os.path.join(directory, "adapter_model.safetensors")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{directory} holds no adapter_model.safetensors")
        full = {}
        for key, value in load_file(path).items():
            for which in ("lora_A", "lora_B"):
                key = key.replace(f".{which}.weight", f".{which}.{adapter_name}.weight")
            full[key] = value
        return self._lora.local_state(adapter_name, full)
