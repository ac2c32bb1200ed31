"""``npu_fusion_attention`` as a transformers attention implementation, packed sequences included.

:func:`apply` registers :func:`attention_forward` with transformers' ``AttentionInterface`` (and the flash-attention
mask builder, which hands over ``None`` or the 2-D padding mask) under the name ``npu_fusion_attention`` and selects it
for one network of a supported family. Every call runs in the ``TND`` layout: the tokens that take part (padding
removed) are laid end to end and ``actual_seq_qlen``/``actual_seq_kvlen`` give each sequence's cumulative end, so a
padded batch, a plain batch and a packed (padding-free) row whose ``position_ids`` restart at each sequence all take
the same path; so does decoding against a KV cache (one sequence per row). Causality is ``sparse_mode=3`` with the compressed 2048x2048 mask (``True`` = masked), as
transformers' own NPU flash-attention integration calls it.
"""

from __future__ import annotations

from typing import Any

NAME = "npu_fusion_attention"
#: model types whose decoder attention is plain causal self-attention over (B, heads, S, head_dim)
MODEL_TYPES = frozenset({"qwen2", "qwen3", "qwen3_moe", "llama", "mistral"})
CAUSAL_SPARSE_MODE = 3  # bottom-right aligned causal; equals top-left when query and key lengths match
_masks: dict[Any, Any] = {}


def compressed_causal_mask(device: Any) -> Any:
    """The 2048x2048 upper-triangular bool mask (``True`` = masked) that sparse_mode 2 and 3 take, one per device."""
    import torch

    if device not in _masks:
        _masks[device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
    return _masks[device]


def _sequences(batch: int, length: int, attention_mask: Any, position_ids: Any, device: Any) -> tuple[Any, list[int]]:
    """Flat indices (into batch*length) of the tokens that attend, and each sequence's cumulative end among them.

    A sequence starts at each row's first kept token and wherever ``position_ids`` do not continue by one.
    """
    import torch

    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"{NAME} expects the 2-D padding mask transformers builds for it, got shape "
                         f"{tuple(attention_mask.shape)}")
    keep = (attention_mask.bool() if attention_mask is not None
            else torch.ones(batch, length, dtype=torch.bool, device=device))
    positions = (position_ids.expand(batch, length) if position_ids is not None
                 else torch.arange(length, device=device).expand(batch, length))
    rows = torch.arange(batch, device=device)[:, None].expand(batch, length)
    index = keep.reshape(-1).nonzero().squeeze(-1)
    kept_rows, kept_positions = rows.reshape(-1)[index], positions.reshape(-1)[index]
    starts = torch.ones_like(kept_rows, dtype=torch.bool)
    starts[1:] = (kept_rows[1:] != kept_rows[:-1]) | (kept_positions[1:] != kept_positions[:-1] + 1)
    boundaries = starts.nonzero().squeeze(-1).tolist()[1:] + [int(index.numel())]
    return index, boundaries


def _cached_sequences(batch: int, q_len: int, kv_len: int, attention_mask: Any,
                      device: Any) -> tuple[Any, list[int], Any, list[int]]:
    """Decoding against a cache: one sequence per row, its queries the last ``q_len`` of its ``kv_len`` keys."""
    import torch

    keep_kv = (attention_mask.bool() if attention_mask is not None
               else torch.ones(batch, kv_len, dtype=torch.bool, device=device))
    keep_q = keep_kv[:, -q_len:]
    return (keep_q.reshape(-1).nonzero().squeeze(-1), keep_q.sum(1).cumsum(0).tolist(),
            keep_kv.reshape(-1).nonzero().squeeze(-1), keep_kv.sum(1).cumsum(0).tolist())


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
                      dropout: float = 0.0, sliding_window: int | None = None, position_ids: Any = None,
                      **_: Any) -> tuple[Any, None]:
    """query (B, N, Sq, D), key/value (B, Nkv, Skv, D) -> output (B, Sq, N, D), as transformers' attention functions.

    ``Sq == Skv`` (training, prefill): padding removed, packed rows split where ``position_ids`` restart.
    ``Sq < Skv`` (decoding with a cache): the bottom-right aligned causal mask lines the queries up with their keys.
    """
    import torch_npu

    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    if q_len == kv_len:
        q_index, q_ends = _sequences(batch, q_len, attention_mask, position_ids, query.device)
        kv_index, kv_ends = q_index, q_ends
    else:
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(f"{NAME} expects the 2-D padding mask transformers builds for it, got shape "
                             f"{tuple(attention_mask.shape)}")
        q_index, q_ends, kv_index, kv_ends = _cached_sequences(batch, q_len, kv_len, attention_mask, query.device)
    longest = max(b - a for a, b in zip([0, *kv_ends[:-1]], kv_ends))
    if sliding_window is not None and longest > sliding_window:
        raise ValueError(f"{NAME} runs full causal attention, but this model slides a window of {sliding_window} "
                         f"tokens over sequences of {longest}; turn it off with model.options.kernels: "
                         f"{{{NAME}: false}}")

    def tokens(t: Any, index: Any) -> Any:  # (B, n, S, D) -> (kept tokens, n, D)
        return t.transpose(1, 2).reshape(-1, t.shape[1], head_dim)[index]

    out = torch_npu.npu_fusion_attention(
        tokens(query, q_index), tokens(key, kv_index), tokens(value, kv_index), heads, "TND",
        atten_mask=compressed_causal_mask(query.device), scale=scaling if scaling is not None else head_dim ** -0.5,
        keep_prob=1.0 - dropout, actual_seq_qlen=q_ends, actual_seq_kvlen=kv_ends,
        sparse_mode=CAUSAL_SPARSE_MODE)[0]
    full = out.new_zeros(batch * q_len, heads, head_dim).index_copy(0, q_index, out)  # padding rows stay zero
    return full.view(batch, q_len, heads, head_dim), None


def apply(network: Any) -> int:
    """Select ``npu_fusion_attention`` for ``network`` if its family is supported; returns its attention modules."""
    config = getattr(network, "config", None)
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return 0
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    network.set_attn_implementation(NAME)
    return len(attention_layers(network))


def attention_layers(network: Any) -> list[Any]:
    """The modules of ``network`` that hand query/key/value to transformers' attention functions (its decoder
    self-attention layers: they carry ``is_causal`` and ``num_key_value_groups``)."""
    return [m for m in network.modules() if hasattr(m, "is_causal") and hasattr(m, "num_key_value_groups")]
