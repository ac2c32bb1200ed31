"""``MegatronModel``: Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE (and Qwen2.5-VL for the ``vlm`` task) on megatron-core
under the ``TwinkleModel`` API.

Built from ``model_id`` (a Hugging Face checkpoint from any source the core resolves) or from a
``transformers`` config (random init: the weights a ``TransformersModel`` with the same ``seed``
starts from). The network is megatron-core's ``GPTModel`` with the local (Transformer-Engine-free)
layer spec, sharded by the ``megatron`` strategy's mesh (TP / PP / VPP / EP / DP).

Everything the core's generic :class:`TorchTwinkleModel` does — per-adapter training state,
losses by name / class / instance / callable, optimizers and schedulers by name, exact gradient
normalisation by the global token count, checkpoints, metrics — applies unchanged; this class adds
how the network is built, run, converted and written:

* with ``tp > 1`` the logits a loss (and a metric) sees are this rank's slice of the vocabulary, with
  ``LossContext.vocab_shard`` saying which (the strategy option ``vocab_parallel_loss``, on by default; see
  :mod:`twinkle_core.loss.vocab_parallel`): no rank holds ``[tokens, vocab]``. ``forward_backward`` computes
  its loss that way (the ``logits`` it returns are that slice); ``forward`` and ``forward_only`` return the full
  vocabulary, gathered over the TP ranks (a loss on them, ``calculate_loss``, then gets no shard), as does
  everything with ``vocab_parallel_loss=False`` or ``tp == 1``;
* ``get_state_dict()`` returns full Hugging Face tensors (``model.layers.0.self_attn.q_proj.weight`` ...)
  on every rank, and ``save()`` writes a safetensors directory that
  ``transformers.AutoModelForCausalLM.from_pretrained`` loads as is;
* with ``pp > 1`` ``forward_backward`` / ``forward_only`` run megatron-core's pipeline schedules on
  micro-batches of the batch (1F1B, interleaved with ``vpp > 1``); ``forward`` / ``backward`` on their
  own cannot (the graph spans ranks) and raise one error that says to call ``forward_backward``.

Inputs: ``input_ids``, optional ``attention_mask`` (padding) and ``position_ids`` (packed rows:
positions restart at every sequence, which then attends only to itself, as in Hugging Face).

A task of ``model_kind = "image_text_to_text"`` (the ``vlm`` task) gets the Hugging Face vision tower in front of
the ``GPTModel``, which then runs Qwen-VL's multimodal RoPE (:mod:`.vision`; TP, PP and DP, full fine-tuning or
freezing of the vision / projector / language parts, no LoRA yet); :mod:`.kinds` holds what differs per kind.

The class holds single-purpose pieces and hands each what it needs: ``build.py`` (the network from the HF
config), ``weights.py`` (Megatron shards <-> full HF tensors), ``export.py`` (HF / PEFT files), ``adapters.py``
(LoRA), ``forward.py`` (running a chunk) and ``pipeline.py`` (megatron-core's pipeline schedules, which run on
the core's public :class:`~twinkle_core.model.step_context.StepContext`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch

from twinkle_backend_megatron import convert
from twinkle_backend_megatron.adapters import MegatronAdapters
from twinkle_backend_megatron.build import NETWORKS, NetworkOptions, build_network
from twinkle_backend_megatron.export import MegatronExporter, read_adapter
from twinkle_backend_megatron.forward import pipeline_error
from twinkle_backend_megatron.lora import target_modules
from twinkle_backend_megatron.pipeline import MegatronPipeline, metrics_from_last_stage
from twinkle_backend_megatron.sequence_padding import padded_length, trim_sequences
from twinkle_backend_megatron.weights import chunks_of
from twinkle_core.capabilities import task_model_kind
from twinkle_core.loss.base import LossOutput
from twinkle_core.model.base import TwinkleModel
from twinkle_core.model.frozen import trains
from twinkle_core.model.torch_model import TorchTwinkleModel
from twinkle_core.sources import resolve


class MegatronModel(TorchTwinkleModel):
    model_input_keys = ("input_ids", "attention_mask", "position_ids")
    supported_strategies = ("megatron",)
    strategy_note = ("It builds megatron-core's GPTModel, sharded by that strategy's mesh (TP / PP / VPP / EP / DP): "
                     "drop strategy= or pass strategy='megatron'.")
    #: a GPT with its vocabulary head, alone or behind a Hugging Face vision tower (:mod:`.kinds`): no value /
    #: score head, no encoder. The core refuses other tasks' kinds (the PPO critic, embeddings) before building,
    #: naming the classes that can.
    supported_model_kinds = tuple(NETWORKS)

    def __init__(self, *, model_id: str | None = None, config: Any = None, revision: str | None = None,
                 trust_remote_code: bool | None = None, recompute: str | None = None,
                 transformer_config: dict[str, Any] | None = None, strategy: Any = "megatron",
                 attn_implementation: str | None = None, gradient_checkpointing: bool = False,
                 core_attention: str = "sdpa", **kwargs: Any) -> None:
        self.network_options = NetworkOptions.checked(
            model_id=model_id, config=config, revision=revision, trust_remote_code=trust_remote_code,
            recompute=recompute, transformer_config=transformer_config, attn_implementation=attn_implementation,
            gradient_checkpointing=gradient_checkpointing, precision=kwargs.get("precision", "no"),
            core_attention=core_attention)
        self.model_id, self.recompute = model_id, self.network_options.recompute
        self.vocab_shard = None  # this rank's vocabulary slice of the logits under the vocabulary-parallel loss
        self._gather_logits = False  # forward / forward_only hand their callers the full vocabulary
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
        """The ``GPTModel`` chunks this rank holds (one, or ``vpp`` with virtual pipelining)."""
        return chunks_of(self.network_kind.language(self.module))

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

    # ------------------------------------------------------------------ the network: build.py, weights.py
    def build_network(self) -> torch.nn.Module:
        network = build_network(self.network_options, strategy=self.strategy,
                                device_type=self.accelerator.device_type, seed=self.seed,
                                model_kind=task_model_kind(self.task))
        self.hf_config, self.spec, self.model_path = network.hf_config, network.spec, network.model_path
        self.network_kind = network.kind
        self.transformer_config = network.transformer_config
        self.vocab_shard = self.strategy.vocab_shard(network.spec.vocab_size, network.spec.padded_vocab_size)
        self.whole_vocabulary_context = self.loss_context
        self.vocab_parallel_context = dataclasses.replace(self.loss_context, vocab_shard=self.vocab_shard)
        self.lora_adapters = MegatronAdapters(network.kind.language(network.module), network.spec, seed=self.seed, pp=self.mesh.pp,
                                              sequence_parallel=bool(self.strategy.options["sequence_parallel"]))
        return network.module

    def _weights(self) -> Any:
        return self.network_kind.weights(self.module, self.spec, self.mesh)

    def get_state_dict(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        name = self.train_state(adapter_name).name  # "" is the full model
        return self.lora_adapters.state_dict(name) if name else self._weights().hf_state_dict()

    def local_weights(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # get_state_dict() is full Hugging Face tensors; the strategy loads this rank's Megatron shards
        return self._weights().local_state(state_dict.__getitem__, fused_experts=True)

    # ------------------------------------------------------------------ files: export.py
    def export_config(self) -> Any:
        return self.hf_config

    def write_weights(self, directory: str, state_dict: dict[str, torch.Tensor], adapter_name: str | None) -> None:
        exporter = MegatronExporter(self.hf_config, self.spec, model_id=self.model_id, tokenizer=self.tokenizer,
                                    kind=self.network_kind)
        if adapter_name is None:
            exporter.write_model(directory, state_dict)
        else:
            exporter.write_adapter(directory, state_dict, adapter_name, self.lora_adapters.config(adapter_name))

    def read_weights(self, directory: str, adapter_name: str | None) -> dict[str, torch.Tensor]:
        if adapter_name is not None:
            return self.lora_adapters.local_state(adapter_name, read_adapter(directory, adapter_name))
        reader = convert.HFCheckpoint(directory)
        return self._weights().local_state(reader.get, fused_experts=reader.has_fused_experts())

    # ------------------------------------------------------------------ LoRA: adapters.py
    def adapter_config_for(self, config: Any) -> Any:
        self.network_kind.check_adapter()
        return config

    def attach_adapter(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        self.lora_adapters.attach(adapter_name, config, self.device)

    def detach_adapter(self, adapter_name: str) -> None:
        self.lora_adapters.detach(adapter_name)

    def activate_adapter(self, adapter_name: str | None) -> Any:
        return self.lora_adapters.activate(adapter_name)

    def deactivate_adapters(self) -> Any:
        # the LoRA hooks (lora.py) add nothing while no adapter is active; the previous one is restored after
        return self.lora_adapters.activate(None)

    def adapter_parameter_names(self, adapter_name: str) -> list[str]:
        return self.lora_adapters.parameter_names(adapter_name)

    def lora_target_modules(self) -> dict[str, list[str]]:
        return target_modules(self.spec)

    # ------------------------------------------------------------------ running: forward.py, pipeline.py
    def run_network(self, module: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        if self.pp_size > 1:
            raise pipeline_error("forward", self.pp_size)
        logits = self.network_kind.run(module, inputs, self.strategy.unwrap_module)
        if self.vocab_shard is not None:
            if not self._gather_logits:
                return {"logits": logits}  # this rank's vocabulary slice, for the vocabulary-parallel losses
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
        return {"logits": logits[..., : self.spec.vocab_size]}

    def forward(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kwargs: Any) -> dict[str, Any]:
        if self.pp_size > 1:
            raise pipeline_error("forward", self.pp_size)
        with self._whole_logits():
            return super().forward(inputs=inputs, adapter_name=adapter_name, **kwargs)

    @contextlib.contextmanager
    def _whole_logits(self) -> Iterator[None]:
        """Hand the caller the full vocabulary (gathered over the TP ranks) from the forwards inside."""
        self._gather_logits = True
        try:
            yield
        finally:
            self._gather_logits = False

    def backward(self, *, loss: Any = None, adapter_name: str | None = None, **kwargs: Any) -> None:
        if self.pp_size > 1:
            raise pipeline_error("backward", self.pp_size)
        super().backward(loss=loss, adapter_name=adapter_name, **kwargs)

    def calculate_loss(self, *, inputs: dict[str, Any] | None = None, outputs: dict[str, Any] | None = None,
                       adapter_name: str | None = None, **kwargs: Any) -> LossOutput:
        if self.pp_size > 1 and (inputs is None or outputs is None):
            raise pipeline_error("calculate_loss", self.pp_size)
        self.loss_context = self._loss_context_for(self.train_state(adapter_name).last_outputs if outputs is None
                                                   else outputs)
        return super().calculate_loss(inputs=inputs, outputs=outputs, adapter_name=adapter_name, **kwargs)

    def _loss_context_for(self, outputs: dict[str, Any] | None) -> Any:
        """The context with the vocabulary shard for logits that are this rank's slice (``forward_backward``'s),
        without it for the whole vocabulary (``forward`` / ``forward_only`` gather theirs): a slice is
        ``padded / tp`` wide, never ``vocab_size``."""
        logits = (outputs or {}).get("logits")
        sliced = self.vocab_shard is not None and logits is not None and logits.shape[-1] == self.vocab_shard.width
        return self.vocab_parallel_context if sliced else self.whole_vocabulary_context

    @trains  # the pipeline path below trains without going through the core's forward_backward
    def forward_backward(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                         **kwargs: Any) -> dict[str, Any]:
        if self.pp_size == 1:
            return super().forward_backward(inputs=inputs, adapter_name=adapter_name, **kwargs)
        self.check_inputs(inputs, call="forward_backward")
        return self._pipeline().run(self.step_context(adapter_name), inputs, forward_only=False)

    def forward_only(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                     disable_adapters: bool = False, **kwargs: Any) -> dict[str, Any]:
        """As the core's; under sequence parallelism the outputs are cut back to the caller's sequence length."""
        length = inputs["input_ids"].shape[1]
        if self.pp_size == 1:
            with self._whole_logits():
                outputs = super().forward_only(inputs=inputs, adapter_name=adapter_name,
                                               disable_adapters=disable_adapters, **kwargs)
        else:
            self.check_inputs(inputs, call="forward_only")
            step = self.step_context(adapter_name, disable_adapters=disable_adapters)
            outputs = self._pipeline().run(step, inputs, forward_only=True)
        return trim_sequences(outputs, padded_length(length, self.strategy.sequence_multiple), length)

    def _pipeline(self) -> MegatronPipeline:
        return MegatronPipeline(self.chunks, strategy=self.strategy, vocab_size=self.spec.vocab_size, task=self.task,
                                loss_context=self.vocab_parallel_context, unwrap=self.strategy.unwrap_module,
                                run_chunk=self.network_kind.stage_runner(self.module),
                                split=self.network_kind.splitter(self.module))

    def calculate_metric(self, *, adapter_name: str | None = None, reset: bool = True) -> dict[str, float]:
        compute = functools.partial(super().calculate_metric, adapter_name=adapter_name, reset=reset)
        if self.pp_size == 1:
            return compute()
        return metrics_from_last_stage(compute, self.train_state(adapter_name), reset=reset)
