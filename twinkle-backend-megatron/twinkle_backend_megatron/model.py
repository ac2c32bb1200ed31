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
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from twinkle_backend_megatron import convert, padding, recompute
from twinkle_core.errors import ConfigError, UnsupportedHardwareError
from twinkle_core.loss.base import LossOutput
from twinkle_core.model.base import TwinkleModel
from twinkle_core.model.frozen import trains
from twinkle_core.model.torch_model import FULL_MODEL, TorchTwinkleModel
from twinkle_core.model.train_state import TrainState
from twinkle_core.sources import resolve

_RECOMPUTE = {
    None: {},
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},
}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _pipeline_error(method: str, pp: int) -> ConfigError:
    return ConfigError(
        f"MegatronModel.{method}() cannot run on its own with pipeline parallelism (mesh.pp={pp}): the forward "
        f"graph spans several ranks and megatron-core runs forward and backward together in its pipeline "
        f"schedule. Call forward_backward(inputs=...) for training (then clip_grad_and_step as usual) and "
        f"forward_only(inputs=...) for evaluation.")


class MegatronModel(TorchTwinkleModel):
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

    # ================================================================== building
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

    def _hf_config(self) -> Any:
        import transformers

        spec = self.config_spec
        if self.model_path is not None and spec is None:
            with resolve.explain_remote_code_refusal(f"the model {self.model_id!r}"):
                return transformers.AutoConfig.from_pretrained(self.model_path,
                                                               trust_remote_code=self.trust_remote_code)
        if isinstance(spec, transformers.PretrainedConfig):
            return spec
        spec = dict(spec)
        model_type = spec.pop("model_type", None)
        if not model_type:
            raise ConfigError("model.config must name its model_type (e.g. qwen2, llama, qwen3)")
        if self.model_path is not None:
            with resolve.explain_remote_code_refusal(f"the model {self.model_id!r}"):
                base = transformers.AutoConfig.from_pretrained(self.model_path,
                                                               trust_remote_code=self.trust_remote_code)
            for key, value in spec.items():
                setattr(base, key, value)
            return base
        return transformers.AutoConfig.for_model(model_type, **spec)

    def _transformer_config(self) -> Any:
        from megatron.core.transformer.transformer_config import TransformerConfig

        mesh, strategy = self.mesh, self.strategy
        if self.spec.num_layers % (mesh.pp * mesh.vpp):
            raise ConfigError(f"{self.spec.num_layers} layers cannot be split evenly over pp={mesh.pp} x vpp={mesh.vpp} "
                              f"pipeline stages")
        if self.spec.num_experts:
            if self.accelerator.device_type == "cpu" and mesh.tp > 1:
                raise UnsupportedHardwareError("MoE with tensor parallelism needs Transformer Engine / Apex on GPUs; "
                                               "on CPU use mesh.ep for the experts and tp=1")
            if self.spec.num_experts % mesh.ep:
                raise ConfigError(f"mesh.ep={mesh.ep} must divide the number of experts ({self.spec.num_experts})")
        elif mesh.ep > 1:
            raise ConfigError(f"mesh.ep={mesh.ep} needs a mixture-of-experts model; {self.spec.model_type} is dense")
        kwargs = convert.transformer_config_kwargs(self.hf_config, self.spec)
        kwargs.update(
            tensor_model_parallel_size=mesh.tp, pipeline_model_parallel_size=mesh.pp,
            virtual_pipeline_model_parallel_size=mesh.vpp if mesh.vpp > 1 else None,
            context_parallel_size=mesh.cp, expert_model_parallel_size=mesh.ep,
            sequence_parallel=bool(strategy.options["sequence_parallel"]),
            # weights come from the HF checkpoint / HF init right after the build
            use_cpu_initialization=True, perform_initialization=False,
            params_dtype=torch.float32, pipeline_dtype=torch.float32,
            calculate_per_token_loss=True, batch_p2p_comm=bool(strategy.options["batch_p2p_comm"]),
            deallocate_pipeline_outputs=False,
            **_RECOMPUTE[self.recompute],
        )
        kwargs.update(self.transformer_config_overrides)
        if self.recompute:
            recompute.install()  # the recomputed forward must see the forward's autocast (bf16 / fp16)
        return TransformerConfig(**kwargs)

    def _build_module(self) -> torch.nn.Module:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel

        if self.model_id is not None:
            from twinkle_core.sources.resolve import resolve_model

            self.model_path = resolve_model(self.model_id, revision=self.revision)
        self.hf_config = self._hf_config()
        if getattr(self.hf_config, "use_cache", None):
            self.hf_config.use_cache = False
        self.spec = convert.model_spec(self.hf_config, self.mesh.tp)
        # The random init (config only) is the HF model's, built first so the global RNG is where a
        # TransformersModel with the same seed would build it: both backends start from the same weights.
        init_state = self._hf_init_state() if self.model_path is None else None
        tensor_parallel.model_parallel_cuda_manual_seed(self.seed)
        self.transformer_config = self._transformer_config()
        layer_spec = get_gpt_layer_local_spec(num_experts=self.spec.num_experts, moe_grouped_gemm=False,
                                              qk_layernorm=self.spec.qk_norm, normalization="RMSNorm")
        vpp = self.mesh.vpp
        chunks = []
        for stage in range(vpp):
            vp_stage = stage if vpp > 1 else None
            chunk = GPTModel(
                self.transformer_config, layer_spec, vocab_size=self.spec.padded_vocab_size,
                max_sequence_length=int(getattr(self.hf_config, "max_position_embeddings", 4096)),
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                parallel_output=False, share_embeddings_and_output_weights=self.spec.tied,
                position_embedding_type="rope", rotary_base=convert._rope_theta(self.hf_config),
                vp_stage=vp_stage)
            _enable_position_ids(chunk)
            _mark_tensor_parallel(chunk)
            chunks.append(chunk)
        module: torch.nn.Module = chunks[0] if vpp == 1 else torch.nn.ModuleList(chunks)
        padding.block_padding_gradient(module, getattr(self.hf_config, "pad_token_id", None))
        self.module = module  # the weight helpers below walk self.module
        if init_state is not None:
            fused = any(k.endswith("mlp.experts.gate_up_proj") for k in init_state)
            local = self._local_state(init_state.__getitem__, fused_experts=fused)
        else:
            reader = convert.HFCheckpoint(self.model_path)
            local = self._local_state(reader.get, fused_experts=reader.has_fused_experts())
        self.strategy.load_state_dict(module, local, strict=True)
        return module

    def _hf_init_state(self) -> dict[str, torch.Tensor]:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32,
                                                           trust_remote_code=self.trust_remote_code)
        return {k: v.detach() for k, v in hf.state_dict().items()}

    # ================================================================== weights
    def _weight_map(self, fused_experts: bool = True) -> convert.WeightMap:
        return convert.WeightMap(self.spec, fused_experts=fused_experts)

    def _named_chunk_parameters(self) -> Any:
        """``(full name in self.module, name inside its chunk, parameter, layer offset, expert offset)`` of the
        base model's parameters."""
        from megatron.core import parallel_state as ps

        several = isinstance(self.module, torch.nn.ModuleList)
        expert_offset = 0
        if self.spec.num_experts:
            expert_offset = ps.get_expert_model_parallel_rank() * (self.spec.num_experts // self.mesh.ep)
        for index, chunk in enumerate(self.chunks):
            layers = getattr(chunk.decoder, "layers", [])
            offset = layers[0].layer_number - 1 if len(layers) else 0
            for name, param in chunk.named_parameters():
                if ".lora." in name:
                    continue  # adapter weights (see lora.py) are not part of the base model
                yield (f"{index}.{name}" if several else name), name, param, offset, expert_offset

    @staticmethod
    def _sharding(param: torch.nn.Parameter) -> tuple[int | None, int, int, Any]:
        """``(partition dim or None, tp rank, tp size, group)`` of a parameter (experts: expert-TP)."""
        from megatron.core import parallel_state as ps

        if not getattr(param, "allreduce", True):
            rank, size = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
            group = ps.get_expert_tensor_parallel_group(check_initialized=False)
        else:
            rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
            group = ps.get_tensor_model_parallel_group()
        dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) and size > 1 else None
        return dim, rank, size, group

    def _local_state(self, get: Any, *, fused_experts: bool) -> dict[str, torch.Tensor]:
        """This rank's Megatron parameters made from HF tensors (``get(key)``)."""
        weights = self._weight_map(fused_experts)
        state = {}
        for full, name, param, offset, expert_offset in self._named_chunk_parameters():
            rule = weights.rule(name, offset, expert_offset)
            dim, rank, size, _ = self._sharding(param)
            try:
                tensor = weights.to_local(rule, get, tp_rank=rank, tp_size=size, partition_dim=dim)
            except KeyError as exc:
                raise KeyError(f"the Hugging Face weights lack {exc} needed for Megatron parameter {full!r}") from None
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"Megatron parameter {full!r} has shape {tuple(param.shape)} but the Hugging Face "
                                 f"weights {list(rule.hf_keys)} give {tuple(tensor.shape)}")
            state[full] = tensor.to(param.dtype)
        return state

    def _hf_state_dict(self, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
        """Full HF tensors of the whole model, on every rank (collective over TP / EP / PP)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        weights = self._weight_map(fused_experts=True)
        out: dict[str, torch.Tensor] = {}
        experts: dict[str, dict[int, torch.Tensor]] = {}
        for full, name, param, offset, expert_offset in self._named_chunk_parameters():
            if wanted is not None and full not in wanted:
                continue
            if name == "output_layer.weight" and self.spec.tied:
                continue  # the tied copy of the embedding (last pipeline stage)
            rule = weights.rule(name, offset, expert_offset)
            dim, _, size, group = self._sharding(param)
            tensor = param.detach().contiguous()
            if dim is not None:
                shards = [torch.empty_like(tensor) for _ in range(size)]
                dist.all_gather(shards, tensor, group=group)
            else:
                shards = [tensor]
            for key, value in weights.to_hf(rule, [s.cpu() for s in shards], dim).items():
                if rule.expert is not None:
                    experts.setdefault(key, {})[rule.expert] = value.clone()
                else:
                    out[key] = value.clone()
        if experts and self.mesh.ep > 1:
            gathered: list[Any] = [None] * self.mesh.ep
            dist.all_gather_object(gathered, experts, group=ps.get_expert_model_parallel_group())
            experts = {}
            for part in gathered:
                for key, per_expert in part.items():
                    experts.setdefault(key, {}).update(per_expert)
        for key, per_expert in experts.items():
            out[key] = torch.stack([per_expert[e] for e in sorted(per_expert)])
        if self.pp_size > 1:
            gathered = [None] * self.pp_size
            dist.all_gather_object(gathered, out, group=ps.get_pipeline_model_parallel_group())
            out = {k: v for part in gathered for k, v in part.items()}
        if self.spec.tied and "model.embed_tokens.weight" in out and wanted is None:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return dict(sorted(out.items()))

    def export_config(self) -> Any:
        return self.hf_config

    def get_state_dict(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        name = self._resolve_name(adapter_name)
        if name == FULL_MODEL:
            return self._hf_state_dict()
        return self._adapter_state_dict(name)

    def _local_weights(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        # get_state_dict() is full Hugging Face tensors; the strategy loads this rank's Megatron shards
        return self._local_state(state_dict.__getitem__, fused_experts=True)

    def _export(self, directory: str, state_dict: dict[str, torch.Tensor], adapter_name: str | None) -> None:
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

    def _import(self, directory: str, adapter_name: str | None) -> dict[str, torch.Tensor]:
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

    def _describe(self) -> dict[str, Any]:
        from twinkle_backend_megatron.compat import megatron_version

        return {"class": type(self).__name__, "model_type": self.spec.model_type, "model_id": self.model_id,
                "vocab_size": self.spec.vocab_size, "megatron_core": megatron_version(),
                "recompute": self.recompute, "tp": self.mesh.tp, "pp": self.mesh.pp, "vpp": self.mesh.vpp,
                "ep": self.mesh.ep}

    # ================================================================== adapters
    def _add_adapter(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        from twinkle_backend_megatron.lora import MegatronLora

        if self.strategy.options["sequence_parallel"]:
            raise ConfigError("LoRA adapters with sequence_parallel=True are not supported yet")
        if self._lora is None:
            for p in self.module.parameters():  # the base is frozen once it carries adapters (as PEFT does)
                p.requires_grad_(False)
            self._lora = MegatronLora(self.chunks, self.spec, self.seed)
        self._adapters_config[adapter_name] = self._lora.add(adapter_name, config)
        self.module.to(self.device)

    def _remove_adapter(self, adapter_name: str) -> None:
        self._lora.remove(adapter_name)
        self._adapters_config.pop(adapter_name, None)

    @contextlib.contextmanager
    def _adapter_context(self, adapter_name: str | None) -> Any:
        if self._lora is None:
            yield
            return
        previous = self._lora.active.name
        self._lora.active.name = adapter_name
        try:
            yield
        finally:
            self._lora.active.name = previous

    def _adapters_disabled(self) -> Any:
        # the LoRA hooks (lora.py) add nothing while no adapter is active; the previous one is restored after
        return self._adapter_context(None)

    def _adapter_parameter_names(self, adapter_name: str) -> list[str]:
        return self._lora.parameter_names(adapter_name)

    def _adapter_state_dict(self, adapter_name: str) -> dict[str, torch.Tensor]:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        out = self._lora.full_state_dict(adapter_name)
        if self.pp_size > 1:
            gathered: list[Any] = [None] * self.pp_size
            dist.all_gather_object(gathered, out, group=ps.get_pipeline_model_parallel_group())
            out = {k: v for part in gathered for k, v in part.items()}
        return dict(sorted(out.items()))

    # ================================================================== running
    def _megatron_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``GPTModel.forward`` arguments: the attention mask Megatron wants (True = masked) and positions."""
        input_ids = inputs["input_ids"]
        b, s = input_ids.shape
        device = input_ids.device
        arange = torch.arange(s, device=device)
        position_ids = inputs.get("position_ids")
        attention_mask = inputs.get("attention_mask")
        packed = position_ids is not None and not bool((position_ids == arange).all())
        mask = None
        if packed or (attention_mask is not None and not bool(attention_mask.bool().all())):
            allowed = torch.ones(s, s, dtype=torch.bool, device=device).tril()[None].expand(b, s, s)
            if packed:
                first = position_ids[:, :1] - 1
                segment = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
                allowed = allowed & (segment[:, :, None] == segment[:, None, :])
            if attention_mask is not None:
                allowed = allowed & attention_mask.bool()[:, None, :]
            mask = ~allowed[:, None]
        return {"input_ids": input_ids, "position_ids": position_ids if packed else None, "attention_mask": mask}

    def _call_chunk(self, chunk: Any, inputs: dict[str, Any]) -> torch.Tensor:
        kw = self._megatron_inputs(inputs)
        inner = self.strategy.unwrap_module(chunk)  # the GPTModel inside megatron-core's DDP wrapper
        inner._twinkle_positions = kw.pop("position_ids")
        try:
            return chunk(input_ids=kw["input_ids"], position_ids=None, attention_mask=kw["attention_mask"])
        finally:
            inner._twinkle_positions = None

    def _run_module(self, module: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        if self.pp_size > 1:
            raise _pipeline_error("forward", self.pp_size)
        logits = self._call_chunk(module, inputs)
        return {"logits": logits[..., : self.spec.vocab_size]}

    def forward(self, *, inputs: dict[str, Any], adapter_name: str | None = None, **kwargs: Any) -> dict[str, Any]:
        if self.pp_size > 1:
            raise _pipeline_error("forward", self.pp_size)
        return super().forward(inputs=inputs, adapter_name=adapter_name, **kwargs)

    def backward(self, *, loss: Any = None, adapter_name: str | None = None, **kwargs: Any) -> None:
        if self.pp_size > 1:
            raise _pipeline_error("backward", self.pp_size)
        super().backward(loss=loss, adapter_name=adapter_name, **kwargs)

    def calculate_loss(self, *, inputs: dict[str, Any] | None = None, outputs: dict[str, Any] | None = None,
                       adapter_name: str | None = None, **kwargs: Any) -> LossOutput:
        if self.pp_size > 1 and (inputs is None or outputs is None):
            raise _pipeline_error("calculate_loss", self.pp_size)
        return super().calculate_loss(inputs=inputs, outputs=outputs, adapter_name=adapter_name, **kwargs)

    @trains  # the pipeline path below trains without going through the core's forward_backward
    def forward_backward(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                         **kwargs: Any) -> dict[str, Any]:
        if self.pp_size == 1:
            return super().forward_backward(inputs=inputs, adapter_name=adapter_name, **kwargs)
        return self._pipeline(inputs, adapter_name, forward_only=False)

    def forward_only(self, *, inputs: dict[str, Any], adapter_name: str | None = None,
                     disable_adapters: bool = False, **kwargs: Any) -> dict[str, Any]:
        if self.pp_size == 1:
            return super().forward_only(inputs=inputs, adapter_name=adapter_name, disable_adapters=disable_adapters,
                                        **kwargs)
        return self._pipeline(inputs, adapter_name, forward_only=True, disable_adapters=disable_adapters)

    def generation_module(self, *, adapter_name: str | None = None) -> Any:
        # a Megatron network takes no KV cache and is cut over tensor / pipeline ranks: a sampler needs its own
        # Hugging Face copy, refreshed from get_state_dict() (gathered, Hugging Face names) after every step
        return TwinkleModel.generation_module(self, adapter_name=adapter_name)

    # ================================================================== pipeline parallelism
    def _pipeline(self, inputs: dict[str, Any], adapter_name: str | None, *, forward_only: bool,
                  disable_adapters: bool = False) -> dict[str, Any]:
        name = self._resolve_name(adapter_name)
        state = self._states[name]
        inputs = self._to_device(self.strategy.prepare_inputs(dict(inputs)))
        pieces = self._micro_batches(inputs)
        if not forward_only:
            self._ensure_loss(state)
            # every stage needs the window's divisor before the last stage has computed a loss: count the labels
            state.open_window(_label_count(inputs), self.strategy, self.device)
        scored: list[tuple[dict[str, Any], LossOutput | None]] = []  # (outputs, loss) per micro-batch, last stage
        self._run_schedule(self._adapter_scope(adapter_name, disable_adapters), pieces,
                           self._forward_step(state, scored, forward_only=forward_only), forward_only=forward_only)
        if forward_only:
            return self._evaluation_outputs(scored, inputs)
        return self._training_outputs(state, scored)

    def _micro_batches(self, inputs: dict[str, Any]) -> list[dict[str, Any]]:
        """The batch split into the strategy's ``num_microbatches`` equal pipeline micro-batches (row-wise)."""
        rows = inputs["input_ids"].shape[0]
        micro = self.strategy.num_microbatches
        if rows % micro:
            raise ConfigError(f"a batch of {rows} rows cannot be split into num_microbatches={micro} equal pipeline "
                              f"micro-batches; change the batch size or strategy_options num_microbatches")
        size = rows // micro
        per_row = {k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows}
        return [{k: v[i * size:(i + 1) * size] if k in per_row else v for k, v in inputs.items()}
                for i in range(micro)]

    def _task_outputs(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        return self.task.process_outputs(outputs, inputs) if self.task is not None else outputs

    def _forward_step(self, state: TrainState, scored: list[tuple[dict[str, Any], LossOutput | None]], *,
                      forward_only: bool) -> Any:
        """megatron-core's ``forward_step_func``: run a chunk; on the last stage, score its output into ``scored``."""
        vocab = self.spec.vocab_size

        def forward_step(data_iterator: Any, chunk: Any) -> Any:
            batch = next(data_iterator)

            def loss_func(output_tensor: torch.Tensor) -> Any:
                logits = output_tensor[..., :vocab]
                if forward_only:  # the task sees the whole batch once the logits reached every stage
                    scored.append(({"logits": logits.detach()}, None))
                    return output_tensor.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}
                outputs = self._task_outputs({"logits": logits}, batch)
                result = state.apply_loss(outputs, batch, self.loss_context)
                scored.append(({k: v.detach() if torch.is_tensor(v) else v for k, v in outputs.items()}, result))
                scaled = self.precision.scale_loss(state.scale_for_backward(result.loss))
                return scaled, torch.tensor(int(float(result.num_tokens)), dtype=torch.int), {}

            return self._call_chunk(chunk, batch), loss_func

        return forward_step

    def _run_schedule(self, adapter_scope: Any, pieces: list[dict[str, Any]], forward_step: Any, *,
                      forward_only: bool) -> None:
        """Run megatron-core's pipeline schedule (1F1B, interleaved with ``vpp > 1``) over the micro-batches."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        chunks = self.chunks
        size, length = pieces[0]["input_ids"].shape
        grad_context = torch.no_grad() if forward_only else contextlib.nullcontext()
        for chunk in chunks:
            chunk.train(not forward_only)
        try:
            with adapter_scope, self.precision.autocast(self.device.type), grad_context:
                get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=[iter(pieces) for _ in chunks],
                    model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(pieces), seq_length=length,
                    micro_batch_size=size, forward_only=forward_only)
        finally:
            for chunk in chunks:
                chunk.train()

    def _evaluation_outputs(self, scored: list[tuple[dict[str, Any], None]], inputs: dict[str, Any]) -> dict[str, Any]:
        """The last stage's logits on every stage, then the task's outputs of the whole batch."""
        logits = torch.cat([outputs["logits"] for outputs, _ in scored]) if _is_last_stage() else None
        logits = self._logits_from_last_stage(logits, tuple(inputs["input_ids"].shape))
        with self.precision.autocast(self.device.type), torch.no_grad():
            return self._task_outputs({"logits": logits}, inputs)

    def _logits_from_last_stage(self, logits: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor:
        """Broadcast the last stage's ``logits`` (``None`` elsewhere) of a ``shape`` batch to every stage."""
        dtype_index = torch.tensor([_DTYPES.index(logits.dtype) if logits is not None else 0], dtype=torch.long,
                                   device=self.device)
        _broadcast_from_last_stage(dtype_index)
        if logits is None:
            logits = torch.empty((*shape, self.spec.vocab_size), dtype=_DTYPES[int(dtype_index)], device=self.device)
        else:
            logits = logits.contiguous()
        _broadcast_from_last_stage(logits)
        return logits

    def _training_outputs(self, state: TrainState, scored: list[tuple[dict[str, Any], LossOutput]]) -> dict[str, Any]:
        """Record the window's backward and report the loss on every stage (outputs and metrics on the last)."""
        results = [result for _, result in scored]
        loss_sum, tokens = self._loss_totals(results)
        state.record_backward(tokens)
        out: dict[str, Any] = {"loss": torch.tensor(loss_sum / tokens if tokens else math.nan), "num_tokens": tokens}
        if _is_last_stage():
            out = {**_join_micro_batches([outputs for outputs, _ in scored]), **out, **_mean_metrics(results)}
        return out

    def _loss_totals(self, results: list[LossOutput]) -> tuple[float, float]:
        """``(sum loss, tokens)`` of the micro-batches, computed on the last stage, known on every stage."""
        totals = torch.tensor([sum(float(r.loss.detach()) for r in results), sum(float(r.num_tokens) for r in results)],
                              dtype=torch.float64, device=self.device)
        _broadcast_from_last_stage(totals)
        return float(totals[0]), float(totals[1])

    def calculate_metric(self, *, adapter_name: str | None = None, reset: bool = True) -> dict[str, float]:
        if self.pp_size == 1:
            return super().calculate_metric(adapter_name=adapter_name, reset=reset)
        # metrics are updated where the loss is computed: the last pipeline stage; the others receive them
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        holder: list[Any] = [None]
        if _is_last_stage():
            holder[0] = super().calculate_metric(adapter_name=adapter_name, reset=reset)
        else:
            state = self._state(adapter_name)
            if reset:
                for metric in state.metrics:
                    metric.reset()
        dist.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return holder[0]


def _label_count(inputs: dict[str, Any]) -> float:
    """Tokens a loss will count in ``inputs``: labelled ones (``-100`` is ignored), else every input token."""
    labels = inputs.get("labels")
    return float((labels != -100).sum()) if labels is not None else float(inputs["input_ids"].numel())


def _is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


def _broadcast_from_last_stage(tensor: torch.Tensor) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.broadcast(tensor, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())


def _join_micro_batches(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The micro-batches' per-row outputs (logits, task outputs) joined into the batch's."""
    return {key: torch.cat([part[key] for part in parts]) for key, value in parts[0].items()
            if torch.is_tensor(value) and value.dim()}


def _mean_metrics(results: list[LossOutput]) -> dict[str, float]:
    """Each extra metric a loss reported, averaged over the micro-batches that reported it."""
    values: dict[str, list[float]] = {}
    for result in results:
        for key, value in result.metrics.items():
            values.setdefault(key, []).append(float(value))
    return {key: sum(v) / len(v) for key, v in values.items()}


def _mark_tensor_parallel(chunk: torch.nn.Module) -> None:
    """Tag TP-sharded weights (``tensor_model_parallel`` / ``partition_dim``) as Megatron's init would.

    megatron-core sets these attributes only while it initialises weights; the model is built with
    ``perform_initialization=False`` (the weights are loaded right after), and the gradient norm and
    the weight conversion read them.
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in chunk.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not hasattr(weight, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def _enable_position_ids(chunk: Any) -> None:
    """Let ``chunk`` take per-token RoPE positions (packed rows), set in ``chunk._twinkle_positions``.

    megatron-core's ``RotaryEmbedding`` returns the table for positions ``0..s-1`` ([s, 1, 1, d]); for
    packed rows the table rows are picked per token ([s, b, 1, d]), which broadcasts the same way in
    ``apply_rotary_pos_emb``.
    """
    chunk._twinkle_positions = None
    rotary = getattr(chunk, "rotary_pos_emb", None)
    if rotary is None:
        return
    original = rotary.forward

    def forward(max_seq_len: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        positions = chunk._twinkle_positions
        if positions is None:
            return original(max_seq_len, *args, **kwargs)
        table = original(int(positions.max()) + 1, *args, **kwargs)  # [P, 1, 1, d]
        return table[positions.t()].squeeze(2)  # [s, b, 1, d]

    rotary.forward = forward
