"""The padding token's embedding row, as Hugging Face models train it.

A transformers decoder builds its input embedding as ``nn.Embedding(vocab, hidden, padding_idx=pad_token_id)``:
the padding row is looked up like any other, but lookups never send it a gradient. megatron-core's
``VocabParallelEmbedding`` has no ``padding_idx``, so without this the two backends would train that row
differently whenever the padding token also appears as real input (Qwen2's configs reuse EOS as padding). A
forward hook on the word embedding keeps the looked-up values and detaches them at the padding positions.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["block_padding_gradient"]


def _padding_mask(ids: torch.Tensor, output: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """``[..., 1]`` mask aligned with ``output``: ``[b, s, h]``, or ``[s/tp, b, h]`` when the embedding itself
    transposes and scatters the sequence over the tensor-parallel ranks (sequence parallelism)."""
    mask = ids == pad_token_id
    if tuple(output.shape[:2]) != tuple(mask.shape):
        from megatron.core import parallel_state as ps

        mask = mask.t().chunk(ps.get_tensor_model_parallel_world_size(), dim=0)[
            ps.get_tensor_model_parallel_rank()]
    return mask.unsqueeze(-1)


def block_padding_gradient(module: torch.nn.Module, pad_token_id: int | None) -> int:
    """Hook every word embedding in ``module`` (one per pipeline chunk that embeds); return how many."""
    if pad_token_id is None:
        return 0
    hooked = 0
    for name, child in module.named_modules():
        if not name.endswith("embedding.word_embeddings"):
            continue

        def hook(_module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            return torch.where(_padding_mask(args[0], output, pad_token_id), output.detach(), output)

        child.register_forward_hook(hook)
        hooked += 1
    return hooked
