"""Core attention on ``torch.nn.functional.scaled_dot_product_attention`` for megatron-core's local layer spec.

Without Transformer Engine, megatron-core's local spec computes attention with ``DotProductAttention``: GQA key /
value heads copied to every query head, ``baddbmm`` into a ``[b * heads, s, s]`` buffer, the causal or padding mask
filled in, softmax, ``bmm``. torch's fused attention does the same in one kernel (on CPU: the flash kernel, which
skips the blocks above the diagonal of a causal mask and reads the GQA heads in place); on the 2-rank TP=2 CPU
benchmark it costs ~35% less per layer (fwd + bwd). :class:`SDPAttention` is ``DotProductAttention`` with that
forward, and :func:`with_sdpa_attention` puts it into a layer spec.

Same results (fp32, up to rounding) for everything the backend passes (see :func:`.forward.megatron_inputs`): no
mask (causal), or a boolean ``[b, 1, s, s]`` mask (True = masked) for padding and packed rows. The one difference
is a query that may attend to no key at all (a left-padding position): ``DotProductAttention`` fills masked scores
with -10000 and averages every value there, SDPA returns zeros; such a position carries no label and no real
token attends to it, so no loss or gradient changes. Configurations whose attention SDPA would compute differently
keep ``DotProductAttention`` (:func:`sdpa_is_exact`): attention dropout (megatron-core draws it from its own
per-TP-rank RNG tracker), sliding windows and softmax variants.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = ["SDPAttention", "sdpa_is_exact", "with_sdpa_attention"]


class SDPAttention(DotProductAttention):
    """``DotProductAttention`` (same constructor, heads per TP rank, scale) computed by torch's fused SDPA."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        """``[sq, b, heads, d]`` query, ``[sk, b, groups, d]`` key / value -> ``[sq, b, heads * d]``."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention takes neither packed_seq_params nor attention_bias (as "
                                      "megatron-core's DotProductAttention); build with core_attention='megatron'")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal and query.size(0) > 1
        # Megatron's mask says True = masked, SDPA's boolean mask True = attend
        allowed = None if attention_mask is None else ~attention_mask
        context = torch.nn.functional.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),  # [b, heads, s, d]
            attn_mask=allowed, is_causal=causal, scale=self._scale(),
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition)
        sq, b = query.size(0), query.size(1)
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _scale(self) -> float:
        # DotProductAttention divides its scale by the layer number under apply_query_key_layer_scaling and its
        # softmax multiplies it back (in fp32): the scores' net scale is the same
        coeff = self.layer_number if self.config.apply_query_key_layer_scaling else 1
        return self.softmax_scale * coeff


def sdpa_is_exact(config: Any) -> bool:
    """Whether :class:`SDPAttention` computes what ``DotProductAttention`` would for this ``TransformerConfig``."""
    return (not config.attention_dropout and config.window_size is None
            and getattr(config, "softmax_type", "vanilla") == "vanilla")


def with_sdpa_attention(layer_spec: Any) -> Any:
    """A copy of a megatron-core layer spec with every ``DotProductAttention`` core attention replaced by
    :class:`SDPAttention`."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    submodules = layer_spec.submodules
    if not dataclasses.is_dataclass(submodules):
        return layer_spec
    changes = {}
    for field in dataclasses.fields(submodules):
        value = getattr(submodules, field.name)
        if value is DotProductAttention:
            changes[field.name] = SDPAttention
        elif isinstance(value, ModuleSpec):
            changes[field.name] = with_sdpa_attention(value)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(submodules, **changes))
