"""Building megatron-core's ``GPTModel`` for a ``MegatronModel`` from a Hugging Face config or checkpoint.

The HF config (from ``model_id`` or ``config=``) becomes a megatron-core ``TransformerConfig`` sharded by the
strategy's mesh; the network is megatron-core's ``GPTModel`` with the local (Transformer-Engine-free) layer
spec, one chunk per virtual pipeline stage, loaded from the checkpoint or from the HF model's random init.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from twinkle_backend_megatron import convert, norms, padding
from twinkle_backend_megatron import recompute as recompute_settings
from twinkle_backend_megatron.forward import enable_position_ids
from twinkle_backend_megatron.kinds import TextNetwork
from twinkle_backend_megatron.vision import VisionLanguageNetwork
from twinkle_core.errors import ConfigError, UnsupportedHardwareError
from twinkle_core.sources import resolve

#: the network of each task ``model_kind`` MegatronModel builds (its ``supported_model_kinds``), see :mod:`.kinds`
NETWORKS = {kind.name: kind for kind in (TextNetwork, VisionLanguageNetwork)}

#: MegatronModel's ``core_attention`` choices (see :class:`NetworkOptions`)
CORE_ATTENTIONS = ("sdpa", "megatron")


@dataclass(frozen=True)
class NetworkOptions:
    """A ``MegatronModel``'s own constructor options, checked: where its network comes from and how it is built."""

    model_id: str | None
    config: Any
    revision: str | None
    trust_remote_code: bool
    recompute: str | None
    transformer_config: dict[str, Any]
    #: "sdpa": torch's fused attention wherever it is exact (:mod:`.sdpa_attention`), "megatron": megatron-core's
    #: ``DotProductAttention`` everywhere
    core_attention: str = "sdpa"

    @classmethod
    def checked(cls, *, model_id: str | None, config: Any, revision: str | None, trust_remote_code: bool | None,
                recompute: str | None, transformer_config: dict[str, Any] | None, attn_implementation: str | None,
                gradient_checkpointing: bool, precision: Any, core_attention: str = "sdpa") -> NetworkOptions:
        """The options, or the ``ConfigError`` / ``UnsupportedHardwareError`` that says what to change."""
        if model_id is None and config is None:
            raise ConfigError("MegatronModel needs model_id= (a path, hf:// or ms:// id) or config= "
                              "(a transformers config or a dict with model_type)")
        # the two options every model class takes from the trainer (see twinkle_core.train.loop)
        if attn_implementation is not None:
            raise ConfigError(f"model.attn_implementation={attn_implementation!r}: MegatronModel builds megatron-core's "
                              f"own attention; remove the option")
        if gradient_checkpointing and recompute is None:
            recompute = "full"  # activation checkpointing, in megatron-core's terms
        if recompute not in recompute_settings.SETTINGS:
            raise ConfigError(f"recompute must be one of {[k for k in recompute_settings.SETTINGS if k]} or None, "
                              f"got {recompute!r}")
        if core_attention not in CORE_ATTENTIONS:
            raise ConfigError(f"core_attention must be one of {CORE_ATTENTIONS}, got {core_attention!r}")
        if getattr(precision, "name", precision) == "fp8":
            raise UnsupportedHardwareError("precision 'fp8' on the Megatron backend needs Transformer Engine layers, "
                                           "which this release does not build (local layer spec); use 'bf16'")
        return cls(model_id, config, revision, resolve.trust_remote_code(trust_remote_code), recompute,
                   dict(transformer_config or {}), core_attention)

    def hf_config(self, model_path: str | None) -> Any:
        """The Hugging Face config: the checkpoint's, ``config=`` on its own, or ``config=`` over the checkpoint's."""
        import transformers

        spec = self.config
        if model_path is not None and spec is None:
            return self._checkpoint_config(model_path)
        if isinstance(spec, transformers.PretrainedConfig):
            return spec
        spec = dict(spec)
        model_type = spec.pop("model_type", None)
        if not model_type:
            raise ConfigError("model.config must name its model_type (e.g. qwen2, llama, qwen3)")
        if model_path is not None:
            base = self._checkpoint_config(model_path)
            for key, value in spec.items():
                setattr(base, key, value)
            return base
        return transformers.AutoConfig.for_model(model_type, **spec)

    def _checkpoint_config(self, model_path: str) -> Any:
        import transformers

        with resolve.explain_remote_code_refusal(f"the model {self.model_id!r}"):
            return transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=self.trust_remote_code)


@dataclass(frozen=True)
class Network:
    """What :func:`build_network` built: the module (one chunk, or a ``ModuleList`` of chunks) and its configs."""

    module: torch.nn.Module
    hf_config: Any
    spec: convert.ModelSpec
    transformer_config: Any
    model_path: str | None
    #: what the network is around its ``GPTModel`` (:mod:`.kinds`)
    kind: Any


def build_network(options: NetworkOptions, *, strategy: Any, device_type: str, seed: int,
                  model_kind: str = "causal_lm") -> Network:
    """megatron-core's ``GPTModel`` chunks of this rank, sharded by ``strategy``'s mesh, in the network of the
    task's ``model_kind`` (:mod:`.kinds`), with their weights loaded from the checkpoint (``model_id``) or from the
    Hugging Face model's random init (``config`` only)."""
    from megatron.core import tensor_parallel

    kind = NETWORKS[model_kind]()
    model_path = None
    if options.model_id is not None:
        from twinkle_core.sources.resolve import resolve_model

        model_path = resolve_model(options.model_id, revision=options.revision)
    hf_config = options.hf_config(model_path)
    if getattr(hf_config, "use_cache", None):
        hf_config.use_cache = False
    language_config = kind.language_config(hf_config)
    spec = kind.spec(hf_config, strategy.mesh.tp)
    kind.check_layout(strategy.mesh, strategy.options)
    # The random init (config only) is the HF model's, built first so the global RNG is where a
    # TransformersModel with the same seed would build it: both backends start from the same weights.
    init_state = kind.init_state(hf_config, options.trust_remote_code) if model_path is None else None
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    rotary = kind.rotary(language_config)
    position_embedding = rotary.pop("position_embedding_type")
    transformer_config = _transformer_config(options, language_config, spec, strategy, device_type, rotary)
    # with a vocabulary shard the head's logits stay split over the TP ranks (the losses take the softmax across
    # them); without, every rank gets the gathered full vocabulary
    parallel_output = strategy.vocab_shard(spec.vocab_size, spec.padded_vocab_size) is not None
    language = _gpt_chunks(transformer_config, language_config, spec, strategy.mesh.vpp, parallel_output,
                           position_embedding, sdpa=options.core_attention == "sdpa")
    padding.block_padding_gradient(language, getattr(language_config, "pad_token_id", None))
    module = kind.assemble(language, hf_config)
    weights = kind.weights(module, spec, strategy.mesh)
    if init_state is not None:
        fused = any(k.endswith("mlp.experts.gate_up_proj") for k in init_state)
        local = weights.local_state(init_state.__getitem__, fused_experts=fused)
    else:
        reader = convert.HFCheckpoint(model_path)
        local = weights.local_state(reader.get, fused_experts=reader.has_fused_experts())
    strategy.load_state_dict(module, local, strict=True)
    return Network(module, hf_config, spec, transformer_config, model_path, kind)


def check_layout(spec: Any, mesh: Any, *, sequence_parallel: bool) -> None:
    """Refuse a parallel layout this model cannot be built with (``spec``: :class:`convert.ModelSpec`)."""
    if spec.num_layers % (mesh.pp * mesh.vpp):
        raise ConfigError(f"{spec.num_layers} layers cannot be split evenly over pp={mesh.pp} x vpp={mesh.vpp} "
                          f"pipeline stages")
    if spec.num_experts:
        if mesh.tp > 1 and not sequence_parallel:
            # megatron-core's MoELayer.forward raises in training with TP > 1 and no sequence parallelism
            raise ConfigError("a mixture-of-experts model with tensor parallelism (mesh.tp > 1) needs "
                              "strategy.options.sequence_parallel=true: megatron-core's MoE layer trains only with "
                              "sequence parallelism under TP")
        if spec.num_experts % mesh.ep:
            raise ConfigError(f"mesh.ep={mesh.ep} must divide the number of experts ({spec.num_experts})")
    elif mesh.ep > 1:
        raise ConfigError(f"mesh.ep={mesh.ep} needs a mixture-of-experts model; {spec.model_type} is dense")


def _transformer_config(options: NetworkOptions, hf_config: Any, spec: convert.ModelSpec, strategy: Any,
                        device_type: str, rotary: dict[str, Any]) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    mesh = strategy.mesh
    check_layout(spec, mesh, sequence_parallel=bool(strategy.options["sequence_parallel"]))
    kwargs = convert.transformer_config_kwargs(hf_config, spec)
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
        **recompute_settings.SETTINGS[options.recompute], **rotary,
    )
    if "cuda_graph_scope" in getattr(TransformerConfig, "__dataclass_fields__", {}):
        # megatron-core's default "full" warns that it is deprecated in favour of [], which means the same
        kwargs["cuda_graph_scope"] = []
    kwargs.update(options.transformer_config)
    if options.recompute:
        recompute_settings.install()  # the recomputed forward must see the forward's autocast (bf16 / fp16)
    return TransformerConfig(**kwargs)


def _gpt_chunks(transformer_config: Any, hf_config: Any, spec: convert.ModelSpec, vpp: int,
                parallel_output: bool, position_embedding: str, sdpa: bool) -> torch.nn.Module:
    """One ``GPTModel`` per virtual pipeline stage of this rank (a ``ModuleList`` when ``vpp > 1``); with ``sdpa``
    its core attention is torch's fused SDPA where that is exact (:mod:`.sdpa_attention`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts, moe_grouped_gemm=False,
                                          qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    if sdpa:
        from twinkle_backend_megatron import sdpa_attention

        if sdpa_attention.sdpa_is_exact(transformer_config):
            layer_spec = sdpa_attention.with_sdpa_attention(layer_spec)
    chunks = []
    for stage in range(vpp):
        vp_stage = stage if vpp > 1 else None
        chunk = GPTModel(
            transformer_config, _block_spec(transformer_config, layer_spec, vp_stage), vocab_size=spec.padded_vocab_size,
            max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=parallel_output, share_embeddings_and_output_weights=spec.tied,
            position_embedding_type=position_embedding, rotary_base=convert.rope_theta(hf_config),
            vp_stage=vp_stage)
        enable_position_ids(chunk)
        _mark_tensor_parallel(chunk)
        chunks.append(chunk)
    return chunks[0] if vpp == 1 else torch.nn.ModuleList(chunks)


def _block_spec(transformer_config: Any, layer_spec: Any, vp_stage: int | None) -> Any:
    """The layer spec as it is, or under sequence parallelism with norms that megatron-core's local spec refuses
    there although they are correct (:mod:`.norms`)."""
    if not transformer_config.sequence_parallel:
        return layer_spec
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    return norms.with_sequence_parallel_norms(layer_spec, get_num_layers_to_build(transformer_config, vp_stage))


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
