"""Hugging Face <-> Megatron: model configs and weights, sharded by TP / PP / EP.

Families: Llama, Mistral, Qwen2 / Qwen2.5 (q/k/v bias), Qwen3 (qk-norm) and Qwen3-MoE (fused or
per-expert checkpoint layout). A Megatron parameter is named by its local name inside one model
chunk (``decoder.layers.3.self_attention.linear_qkv.weight``); :class:`WeightMap` turns it into the
Hugging Face tensors it is made of and back:

* ``linear_qkv`` rows are Megatron's per-query-group layout ``[q heads of group g, k_g, v_g]`` for
  every group, split over TP ranks by groups;
* ``linear_fc1`` of a gated MLP is ``[gate shard t; up shard t]`` on TP rank ``t``;
* vocabulary-parallel embeddings / output layers are padded to a multiple of the TP size (the padded
  logits are cut off before any loss sees them);
* row-parallel layers (``linear_proj``, ``linear_fc2``) split the input dimension.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from twinkle_core.errors import ConfigError

#: model_type -> family traits
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"qkv_bias": None, "qk_norm": False, "moe": False},
    "mistral": {"qkv_bias": False, "qk_norm": False, "moe": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False, "moe": False},
    # the language model of Qwen2.5-VL (vision.py): Qwen2's decoder, with multimodal RoPE
    "qwen2_5_vl_text": {"qkv_bias": True, "qk_norm": False, "moe": False},
    "qwen3": {"qkv_bias": None, "qk_norm": True, "moe": False},
    "qwen3_moe": {"qkv_bias": None, "qk_norm": True, "moe": True},
}


def rope_theta(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(hf, "rope_theta", None) or 10000.0)


def _check_rope(hf: Any) -> None:
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if kind not in ("default", None):
        raise ConfigError(f"rope_type {kind!r} is not supported by the Megatron backend yet (only the default "
                          f"RoPE); use TransformersModel for this checkpoint")


@dataclass(frozen=True)
class ModelSpec:
    """What the converter needs to know about one architecture at one parallel layout."""

    model_type: str
    vocab_size: int
    padded_vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None


def model_spec(hf: Any, tp_size: int = 1) -> ModelSpec:
    model_type = hf.model_type
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported by the Megatron backend; supported: "
                          f"{', '.join(sorted(FAMILIES))}")
    family = FAMILIES[model_type]
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf.hidden_act!r} is not supported (the families above use silu)")
    _check_rope(hf)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    qkv_bias = family["qkv_bias"] if family["qkv_bias"] is not None else attention_bias
    if model_type == "llama" and (attention_bias or getattr(hf, "mlp_bias", False)):
        # Llama's attention_bias also adds an o_proj bias, which Megatron ties to the MLP biases
        raise ConfigError("Llama with attention_bias / mlp_bias is not supported by the Megatron backend")
    num_heads = hf.num_attention_heads
    groups = getattr(hf, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    if groups % tp_size or num_heads % tp_size:
        raise ConfigError(f"tensor parallel size {tp_size} must divide the number of attention heads ({num_heads}) "
                          f"and key/value heads ({groups})")
    vocab = hf.vocab_size
    padded = math.ceil(vocab / tp_size) * tp_size
    num_experts = None
    moe_ffn = None
    if family["moe"]:
        num_experts = hf.num_experts
        moe_ffn = hf.moe_intermediate_size
        if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
            raise ConfigError("Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step) is not supported")
    return ModelSpec(model_type=model_type, vocab_size=vocab, padded_vocab_size=padded, hidden_size=hf.hidden_size,
                     num_layers=hf.num_hidden_layers, num_heads=num_heads, num_query_groups=groups, head_dim=head_dim,
                     ffn_hidden_size=hf.intermediate_size, qkv_bias=qkv_bias, qk_norm=family["qk_norm"],
                     tied=bool(getattr(hf, "tie_word_embeddings", False)), num_experts=num_experts,
                     moe_ffn_hidden_size=moe_ffn)


def transformer_config_kwargs(hf: Any, spec: ModelSpec) -> dict[str, Any]:
    """``TransformerConfig`` arguments that reproduce the HF architecture exactly (fp32, no fusions)."""
    import torch.nn.functional as F

    kwargs: dict[str, Any] = dict(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads, num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=float(getattr(hf, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm, hidden_dropout=0.0,
        attention_dropout=float(getattr(hf, "attention_dropout", 0.0) or 0.0),
        init_method_std=float(getattr(hf, "initializer_range", 0.02)),
        # the unfused paths are the ones that exist on every device and match HF's maths
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )
    if spec.num_experts:
        kwargs.update(
            num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=hf.num_experts_per_tok,
            # HF: softmax over all experts, top-k, renormalise when norm_topk_prob. Megatron's
            # top-k-then-softmax equals the renormalised probabilities.
            moe_router_pre_softmax=not bool(getattr(hf, "norm_topk_prob", False)),
            moe_router_score_function="softmax", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_router_dtype="fp32",
            moe_permute_fusion=False,
        )
    return kwargs


# ---------------------------------------------------------------------- weights
@dataclass(frozen=True)
class Rule:
    """How one Megatron parameter is made from HF tensors: ``kind`` and the HF keys in order."""

    kind: str  # "plain" | "vocab" | "qkv" | "gated" | "fused_gated" | "fused_down"
    hf_keys: tuple[str, ...]
    #: index into a fused HF expert tensor ([num_experts, ...]) for fused_* kinds
    expert: int | None = None


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")

_LAYER_PLAIN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


class WeightMap:
    """Converts between one rank's Megatron parameters and full HF tensors.

    ``fused_experts``: the HF layout of MoE experts (``mlp.experts.gate_up_proj`` / ``down_proj``
    3-D tensors, transformers >= 5) instead of ``mlp.experts.{e}.gate_proj.weight`` ...
    """

    def __init__(self, spec: ModelSpec, *, fused_experts: bool = True) -> None:
        self.spec = spec
        self.fused_experts = fused_experts

    # ------------------------------------------------------------------ naming
    def rule(self, name: str, layer_offset: int = 0, expert_offset: int = 0) -> Rule | None:
        """The rule for Megatron parameter ``name`` of a chunk whose first layer is ``layer_offset``.

        ``None``: the parameter has no HF counterpart of its own (the tied output layer).
        """
        spec = self.spec
        if name == "embedding.word_embeddings.weight":
            return Rule("vocab", ("model.embed_tokens.weight",))
        if name == "output_layer.weight":
            return Rule("vocab", ("model.embed_tokens.weight" if spec.tied else "lm_head.weight",))
        if name == "decoder.final_layernorm.weight":
            return Rule("plain", ("model.norm.weight",))
        match = _LAYER.match(name)
        if match is None:
            raise KeyError(f"no Hugging Face counterpart known for Megatron parameter {name!r}")
        layer, rest = int(match.group(1)) + layer_offset, match.group(2)
        prefix = f"model.layers.{layer}."
        if rest in _LAYER_PLAIN:
            return Rule("plain", (prefix + _LAYER_PLAIN[rest],))
        if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
            kind = rest.rsplit(".", 1)[1]
            return Rule("qkv", tuple(f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"))
        if rest == "mlp.linear_fc1.weight":
            return Rule("gated", (f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"))
        expert = _EXPERT.match(rest)
        if expert is not None:
            index, which = int(expert.group(1)) + expert_offset, expert.group(2)
            if self.fused_experts:
                key = "gate_up_proj" if which == "linear_fc1" else "down_proj"
                return Rule("fused_gated" if which == "linear_fc1" else "fused_down",
                            (f"{prefix}mlp.experts.{key}",), expert=index)
            base = f"{prefix}mlp.experts.{index}."
            if which == "linear_fc1":
                return Rule("gated", (base + "gate_proj.weight", base + "up_proj.weight"))
            return Rule("plain", (base + "down_proj.weight",))
        raise KeyError(f"no Hugging Face counterpart known for Megatron parameter {name!r}")

    # ------------------------------------------------------------------ HF -> Megatron
    def to_local(self, rule: Rule, get: Callable[[str], torch.Tensor], *, tp_rank: int, tp_size: int,
                 partition_dim: int | None) -> torch.Tensor:
        """This TP rank's shard (``partition_dim=None``: not split) of the parameter ``rule`` describes."""
        spec = self.spec
        if rule.kind == "qkv":
            full = self._interleave_qkv(*(get(k) for k in rule.hf_keys))
        elif rule.kind == "gated":
            gate, up = (get(k) for k in rule.hf_keys)
            if partition_dim is None:
                return torch.cat([gate, up], 0)
            return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], 0)
        elif rule.kind == "fused_gated":
            full = get(rule.hf_keys[0])[rule.expert]  # [2I, H]: gate rows then up rows
            if partition_dim is None:
                return full
            gate, up = full.chunk(2, 0)
            return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], 0)
        elif rule.kind == "fused_down":
            full = get(rule.hf_keys[0])[rule.expert]
        else:
            full = get(rule.hf_keys[0])
        if rule.kind == "vocab" and full.shape[0] < spec.padded_vocab_size:
            pad = full.new_zeros((spec.padded_vocab_size - full.shape[0], *full.shape[1:]))
            full = torch.cat([full, pad], 0)
        if partition_dim is None:
            return full
        return full.chunk(tp_size, partition_dim)[tp_rank]

    def _interleave_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        groups, d = spec.num_query_groups, spec.head_dim
        per = spec.num_heads // groups
        rest = q.shape[1:]
        q = q.reshape(groups, per * d, *rest)
        k = k.reshape(groups, d, *rest)
        v = v.reshape(groups, d, *rest)
        return torch.cat([q, k, v], 1).reshape(groups * (per + 2) * d, *rest)

    # ------------------------------------------------------------------ Megatron -> HF
    def to_hf(self, rule: Rule, shards: list[torch.Tensor], partition_dim: int | None) -> dict[str, torch.Tensor]:
        """Full HF tensors from the shards of every TP rank (one shard when not split).

        Fused expert kinds return this expert's ``[2I, H]`` / ``[H, I]`` slice under the fused key; the
        caller stacks the experts.
        """
        spec = self.spec
        if rule.kind == "gated" or rule.kind == "fused_gated":
            halves = [s.chunk(2, 0) for s in shards]
            gate = torch.cat([h[0] for h in halves], 0)
            up = torch.cat([h[1] for h in halves], 0)
            if rule.kind == "fused_gated":
                return {rule.hf_keys[0]: torch.cat([gate, up], 0)}
            return {rule.hf_keys[0]: gate, rule.hf_keys[1]: up}
        full = shards[0] if partition_dim is None else torch.cat(shards, partition_dim)
        if rule.kind == "vocab":
            return {rule.hf_keys[0]: full[: spec.vocab_size]}
        if rule.kind == "qkv":
            groups, d = spec.num_query_groups, spec.head_dim
            per = spec.num_heads // groups
            rest = full.shape[1:]
            grouped = full.reshape(groups, (per + 2) * d, *rest)
            q, k, v = grouped.split([per * d, d, d], 1)
            return {rule.hf_keys[0]: q.reshape(groups * per * d, *rest),
                    rule.hf_keys[1]: k.reshape(groups * d, *rest),
                    rule.hf_keys[2]: v.reshape(groups * d, *rest)}
        return {rule.hf_keys[0]: full}


def hub_layout(key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint-file form of one in-memory HF tensor: fused MoE experts (transformers >= 5 in memory)
    are written per expert, as on the Hub and as ``save_pretrained`` writes them."""
    if key.endswith("mlp.experts.gate_up_proj"):
        prefix = key[: -len("gate_up_proj")]
        out = {}
        for e, fused in enumerate(tensor):
            gate, up = fused.chunk(2, 0)
            out[f"{prefix}{e}.gate_proj.weight"] = gate.contiguous()
            out[f"{prefix}{e}.up_proj.weight"] = up.contiguous()
        return out
    if key.endswith("mlp.experts.down_proj"):
        prefix = key[: -len("down_proj")]
        return {f"{prefix}{e}.down_proj.weight": w.contiguous() for e, w in enumerate(tensor)}
    return {key: tensor.contiguous()}


# ---------------------------------------------------------------------- HF checkpoint files
class HFCheckpoint:
    """Reads tensors by name from a Hugging Face model directory (safetensors, else ``pytorch_model*.bin``)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._index: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        self._bin: dict[str, torch.Tensor] | None = None
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.exists(index):
            with open(index) as fh:
                self._index = {k: os.path.join(directory, f) for k, f in json.load(fh)["weight_map"].items()}
        elif os.path.exists(single):
            from safetensors import safe_open

            with safe_open(single, "pt") as fh:
                self._index = {k: single for k in fh.keys()}
        else:
            bins = sorted(f for f in os.listdir(directory) if f.startswith("pytorch_model") and f.endswith(".bin"))
            if not bins:
                raise FileNotFoundError(f"{directory} holds no model.safetensors(.index.json) or pytorch_model*.bin")
            self._bin = {}
            for name in bins:
                self._bin.update(torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True))

    def keys(self) -> list[str]:
        return sorted(self._bin if self._bin is not None else self._index)

    def __contains__(self, key: str) -> bool:
        return key in (self._bin if self._bin is not None else self._index)

    def get(self, key: str) -> torch.Tensor:
        if self._bin is not None:
            if key not in self._bin:
                raise KeyError(f"{self.directory} has no tensor {key!r}")
            return self._bin[key]
        if key not in self._index:
            raise KeyError(f"{self.directory} has no tensor {key!r}")
        path = self._index[key]
        handle = self._handles.get(path)
        if handle is None:
            from safetensors import safe_open

            handle = self._handles[path] = safe_open(path, "pt")
        return handle.get_tensor(key)

    def has_fused_experts(self) -> bool:
        return any(k.endswith("mlp.experts.gate_up_proj") for k in self.keys())

