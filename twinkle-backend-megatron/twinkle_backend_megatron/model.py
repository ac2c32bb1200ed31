"""``MegatronModel``: Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE on megatron-core under the ``TwinkleModel`` API.

Built from ``model_id`` (a Hugging Face checkpoint from any source the core resolves) or from a
``transformers`` config (random init: the weights a ``TransformersModel`` with the same ``seed``
starts from). The network is megatron-core's ``GPTModel`` with the local (Transformer-Engine-free)
layer spec, sharded by the ``megatron`` strategy's mesh (TP / PP / VPP / EP / DP).

Everything the core's generic :class:`TorchTwinkleModel` does — per-adapter training state,
losses by name / class / instance / callable, optimizers and schedulers by name, exact gradient
normalisation by the global token count, checkpoints, metrics — applies unchanged; this class adds
how the network is built, run, converted and written:

* the logits a loss sees are the full vocabulary (gathered over TP ranks);
* ``get_state_dict()`` returns full Hugging Face tensors (``model.layers.0.self_attn.q_proj.weight`` ...)
  on every rank, and ``save()`` writes a safetensors directory that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads as is;
* with ``pp > 1`` ``forward_backward`` / ``forward_only`` run megatron-core's pipeline schedules on
  micro-batches of the batch (1F1B, interleaved with ``vpp > 1``); ``forward`` / ``backward`` on their
  own cannot (the graph spans ranks) and raise one error that says to call ``forward_backward``.

Inputs: ``input_ids``, optional ``attention_mask`` (padding) and ``position_ids`` (packed rows:
positions restart at every sequence, which then attends only to itself, as in Hugging Face).

The class is put together from single-purpose mixins: ``build.py`` (the network from the HF config),
``weights.py`` (Megatron shards <-> full HF tensors), ``export.py`` (HF / PEFT files), ``adapters.py`` (LoRA),
``forward.py`` (running the chunks) and ``pipeline.py`` (megatron-core's pipeline schedules).
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_backend_megatron.adapters import MegatronAdaptersMixin
from twinkle_backend_megatron.build import _RECOMPUTE, MegatronBuildMixin
from twinkle_backend_megatron.export import MegatronExportMixin
from twinkle_backend_megatron.forward import MegatronForwardMixin
from twinkle_backend_megatron.pipeline import MegatronPipelineMixin
from twinkle_backend_megatron.weights import MegatronWeightsMixin
from twinkle_core.errors import ConfigError, UnsupportedHardwareError
from twinkle_core.model.base import TwinkleModel
from twinkle_core.model.torch_model import TorchTwinkleModel
from twinkle_core.sources import resolve


class MegatronModel(MegatronForwardMixin, MegatronPipelineMixin, MegatronAdaptersMixin, MegatronExportMixin,
                    MegatronWeightsMixin, MegatronBuildMixin, TorchTwinkleModel):
    model_input_keys = ("input_ids", "attention_mask", "position_ids")
    supported_strategies = ("megatron",)
    strategy_note = ("It builds megatron-core's GPTModel, sharded by that strategy's mesh (TP / PP / VPP / EP / DP): "
                     "drop strategy= or pass strategy='megatron'.")

    def __init__(self, *, model_id: str | None = None, config: Any = None, revision: str | None = None,
                 trust_remote_code: bool | None = None, recompute: str | None = None,
                 transformer_config: dict[str, Any] | None = None, strategy: Any = "megatron",
                 attn_implementation: str | None = None, gradient_checkpointing: bool = False,
                 **kwargs: Any) -> None:
        if model_id is None and config is None:
            raise ConfigError("MegatronModel needs model_id= (a path, hf:// or ms:// id) or config= "
                              "(a transformers config or a dict with model_type)")
        if getattr(kwargs.get("task"), "model_kind", None) == "image_text_to_text":
            raise ConfigError("MegatronModel builds text-only GPT models and cannot train a vision-language model "
                              "(the vlm task); use the HF backend: model.class_name: TransformersModel (strategies "
                              "ddp, native_fsdp, deepspeed) or MultiLoraTransformersModel")
        # the two options every model class takes from the trainer (see twinkle_core.train.loop)
        if attn_implementation is not None:
            raise ConfigError(f"model.attn_implementation={attn_implementation!r}: MegatronModel builds megatron-core's "
                              f"own attention; remove the option")
        if gradient_checkpointing and recompute is None:
            recompute = "full"  # activation checkpointing, in megatron-core's terms
        if recompute not in _RECOMPUTE:
            raise ConfigError(f"recompute must be one of {[k for k in _RECOMPUTE if k]} or None, got {recompute!r}")
        precision = kwargs.get("precision", "no")
        if getattr(precision, "name", precision) == "fp8":
            raise UnsupportedHardwareError("precision 'fp8' on the Megatron backend needs Transformer Engine layers, "
                                           "which this release does not build (local layer spec); use 'bf16'")
        self.model_id, self.config_spec, self.revision = model_id, config, revision
        self.trust_remote_code = resolve.trust_remote_code(trust_remote_code)
        self.recompute = recompute
        self.transformer_config_overrides = dict(transformer_config or {})
        self.model_path: str | None = None
        self._lora: Any = None
        self._adapters_config: dict[str, Any] = {}
        super().__init__(strategy=strategy, **kwargs)

    @classmethod
    def load_tokenizer(cls, path: str, *, trust_remote_code: bool = False) -> Any:
        from transformers import AutoTokenizer

        with resolve.explain_remote_code_refusal(f"the tokenizer at {path}"):
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)

    @property
    def mesh(self) -> Any:
        return self.strategy.mesh

    @property
    def pp_size(self) -> int:
        return self.mesh.pp

    @property
    def chunks(self) -> list[Any]:
        """The model chunks this rank holds (one, or ``vpp`` with virtual pipelining)."""
        return list(self.module) if isinstance(self.module, torch.nn.ModuleList) else [self.module]

    def describe(self) -> dict[str, Any]:
        from twinkle_backend_megatron.compat import megatron_version

        return {"class": type(self).__name__, "model_type": self.spec.model_type, "model_id": self.model_id,
                "vocab_size": self.spec.vocab_size, "megatron_core": megatron_version(),
                "recompute": self.recompute, "tp": self.mesh.tp, "pp": self.mesh.pp, "vpp": self.mesh.vpp,
                "ep": self.mesh.ep}

    def generation_module(self, *, adapter_name: str | None = None) -> Any:
        # a Megatron network takes no KV cache and is cut over tensor / pipeline ranks: a sampler needs its own
        # Hugging Face copy, refreshed from get_state_dict() (gathered, Hugging Face names) after every step
        return TwinkleModel.generation_module(self, adapter_name=adapter_name)
