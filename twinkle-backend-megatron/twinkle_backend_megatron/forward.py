"""Running a ``MegatronModel``'s chunks: Megatron's inputs from Twinkle's.

With ``pp == 1`` the core's forward / backward / loss run unchanged on the one chunk; with ``pp > 1`` only
``forward_backward`` / ``forward_only`` can run (they go to the pipeline schedule in ``pipeline.py``) and the
others raise :func:`pipeline_error`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from twinkle_core.errors import ConfigError


def pipeline_error(method: str, pp: int) -> ConfigError:
    """The error of an entry point that cannot run on its own under pipeline parallelism."""
    return ConfigError(
        f"MegatronModel.{method}() cannot run on its own with pipeline parallelism (mesh.pp={pp}): the forward "
        f"graph spans several ranks and megatron-core runs forward and backward together in its pipeline "
        f"schedule. Call forward_backward(inputs=...) for training (then clip_grad_and_step as usual) and "
        f"forward_only(inputs=...) for evaluation.")


def megatron_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
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


def enable_position_ids(chunk: Any) -> None:
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


def call_chunk(chunk: Any, inputs: dict[str, Any], unwrap: Callable[[Any], Any]) -> torch.Tensor:
    """Run one model chunk (as the strategy wraps it) on Twinkle's inputs; ``unwrap`` gives the ``GPTModel``
    inside megatron-core's DDP wrapper, which takes packed rows' positions (see :func:`enable_position_ids`)."""
    kw = megatron_inputs(inputs)
    inner = unwrap(chunk)
    inner._twinkle_positions = kw.pop("position_ids")
    try:
        return chunk(input_ids=kw["input_ids"], position_ids=None, attention_mask=kw["attention_mask"])
    finally:
        inner._twinkle_positions = None
