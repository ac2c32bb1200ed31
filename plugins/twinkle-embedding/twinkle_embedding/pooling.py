"""Pooling token states into one vector per sequence, exactly as sentence-transformers' ``Pooling`` does.

* ``mean``: average of the non-padding tokens (sentence-transformers models such as all-MiniLM);
* ``cls``: the first non-padding token (BERT-style, e.g. GTE, BGE);
* ``last_token``: the last non-padding token (decoders such as Qwen3-Embedding); works with left
  and right padding alike.
"""

from __future__ import annotations

from typing import Any

from twinkle_core.errors import ConfigError

POOLING_MODES = ("mean", "cls", "last_token")
_ALIASES = {
    "mean": "mean", "mean_tokens": "mean", "avg": "mean", "average": "mean",
    "cls": "cls", "cls_token": "cls", "first": "cls",
    "last_token": "last_token", "lasttoken": "last_token", "last": "last_token", "eos": "last_token",
}
#: sentence-transformers' names of our modes
ST_NAMES = {"mean": "mean", "cls": "cls", "last_token": "lasttoken"}


def canonical_pooling(mode: Any, *, key: str = "pooling") -> str:
    if not isinstance(mode, str) or mode.lower() not in _ALIASES:
        raise ConfigError(f"{key}: unknown pooling {mode!r}; choose one of {', '.join(POOLING_MODES)} (or auto)")
    return _ALIASES[mode.lower()]


def pool(hidden: Any, attention_mask: Any, mode: str) -> Any:
    """``[batch, seq, dim]`` states and a ``[batch, seq]`` mask -> ``[batch, dim]`` embeddings."""
    import torch

    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    if attention_mask.shape != hidden.shape[:2]:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match the hidden states "
                         f"{tuple(hidden.shape)}; the embedding task needs unpacked, unsharded sequences")
    mask = attention_mask.to(hidden.device)
    if mode == "mean":
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        accumulate = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
        total = (hidden * weights).sum(dim=1, dtype=accumulate)
        count = torch.clamp(weights.sum(dim=1, dtype=accumulate), min=1e-9)
        return (total / count).to(hidden.dtype)
    dim = hidden.shape[-1]
    if mode == "cls":
        first = mask.to(torch.int).argmax(dim=1)
        index = first.view(-1, 1, 1).expand(-1, 1, dim)
        return torch.gather(hidden, 1, index).squeeze(1)
    if mode == "last_token":
        seq_len = hidden.shape[1]
        values, from_end = mask.flip(1).max(1)
        from_end = torch.where(values == 0, seq_len - 1, from_end)
        index = (seq_len - from_end - 1).view(-1, 1, 1).expand(-1, 1, dim)
        return torch.gather(hidden, 1, index).squeeze(1)
    raise ConfigError(f"unknown pooling {mode!r}; choose one of {', '.join(POOLING_MODES)}")
