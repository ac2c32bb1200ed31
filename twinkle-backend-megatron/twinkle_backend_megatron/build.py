"""Building megatron-core's ``GPTModel`` for a ``MegatronModel`` from a Hugging Face config or checkpoint.

The HF config (from ``model_id`` or ``config=``) becomes a megatron-core ``TransformerConfig`` sharded by the
strategy's mesh; the network is megatron-core's ``GPTModel`` with the local (Transformer-Engine-free) layer
spec, one chunk per virtual pipeline stage, loaded from the checkpoint or from the HF model's random init.
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_backend_megatron import convert, padding, recompute
from twinkle_core.errors import ConfigError, UnsupportedHardwareError
from twinkle_core.sources import resolve

_RECOMPUTE = {
    None: {},
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},
}


class MegatronBuildMixin:
    """How a ``MegatronModel`` builds its network (the weight helpers it calls are in ``weights.py``)."""

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

    def build_network(self) -> torch.nn.Module:
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
