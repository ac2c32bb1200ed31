"""Splitting a batch along the sequence for sequence / context parallelism: every rank of a group of ``P``
keeps its share of every row (a contiguous chunk, or the load-balanced zig-zag pair of the ring), the loss-side
tensors shifted like ``labels`` first, so each rank scores exactly the tokens whose logits it computes.

:func:`shard_batch` also turns an ``attention_mask`` into the form the attention functions read from the
``position_ids`` (see :mod:`.ulysses`): a mask of ones, or right padding, is dropped; left padding gives pad tokens
the position ``PAD_POSITION``, which isolates each of them as a one-token sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from twinkle_backend_hf.sequence_parallel import ring_layout
from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError

#: the position given to pad tokens that must not see, or be seen by, any other token
PAD_POSITION = -2
#: batch keys that are model inputs: sharded along the sequence but never shifted
MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "inputs_embeds")
#: loss-side keys whose ``[B, T]`` tensors are aligned with ``labels`` (not with the logits): shifted like them
SHIFT_KEYS = ("labels", "advantages", "old_logps", "ref_logps", "loss_scale")


@dataclass
class ShardInfo:
    """How :func:`shard_batch` split a batch: the original and padded global lengths."""

    length: int
    padded_length: int
    sp_size: int
    sp_rank: int

    @property
    def local_length(self) -> int:
        return self.padded_length // self.sp_size


def _pad_seq(x: torch.Tensor, pad: int, value: Any) -> torch.Tensor:
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[1] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=1)


def _shift(x: torch.Tensor, value: Any) -> torch.Tensor:
    """``out[:, t] = x[:, t + 1]``; the last position gets ``value``."""
    shape = list(x.shape)
    shape[1] = 1
    return torch.cat([x[:, 1:], x.new_full(shape, value)], dim=1)


def _fill_value(key: str, x: torch.Tensor, ignore_index: int) -> Any:
    if x.dtype == torch.bool:
        return False
    if "labels" in key and not x.is_floating_point():
        return ignore_index
    return 0


def _positions_from_mask(mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """``None`` when the mask can be dropped (all ones / right padding), else positions with isolated pads."""
    real = mask.bool()
    if bool((real[:, 1:] <= real[:, :-1]).all()):  # all ones, or right padding (ones then zeros)
        return None
    count = real.sum(-1)
    first = real.long().argmax(-1)
    last = real.shape[1] - 1 - real.flip(-1).long().argmax(-1)
    if not bool(((count == 0) | (last - first + 1 == count)).all()):
        raise ConfigError("Ulysses sequence parallelism supports right- or left-padded rows only; this "
                          "attention_mask has padding between real tokens")
    return torch.where(real, positions, torch.full_like(positions, PAD_POSITION))


def shard_batch(batch: dict[str, Any], sp_size: int, sp_rank: int, *, ignore_index: int = IGNORE_INDEX,
                pad_token_id: int = 0, model_keys: tuple[str, ...] = MODEL_KEYS,
                shift_keys: tuple[str, ...] = SHIFT_KEYS,
                layout: str = "contiguous", ring_size: int | None = None) -> tuple[dict[str, Any], ShardInfo]:
    """This SP rank's share of ``batch`` (every rank of the group passes the same batch).

    * ``labels`` ``[B, T]`` become ``shift_labels`` (``shift_labels[:, t] = labels[:, t + 1]``), shifted
      *before* the split so that the last token of a chunk still predicts the first of the next; the
      ``labels`` key is removed, so a loss that does not know ``shift_labels`` fails loudly instead of
      shifting each chunk on its own.
    * ``layout`` (:mod:`.ring_layout`): ``contiguous`` (Ulysses) keeps chunk ``sp_rank``; ``zigzag`` (ring
      attention) keeps chunks ``sp_rank`` and ``2 sp - 1 - sp_rank`` of ``2 sp``. ``ring_size`` (default
      ``sp_size``: the whole group is the ring) nests the two for the hybrid (:func:`~.ring_layout.nested_indices`):
      ``layout`` over ``ring_size`` ring ranks, each share cut contiguously over ``sp_size / ring_size`` ranks.
    * ``position_ids`` are the *global* positions (``arange`` when absent), so RoPE sees the right angles.
    * ``attention_mask`` is dropped (see the module doc: right padding needs nothing, left padding
      moves into ``position_ids``).
    * the sequence is right-padded to a multiple of ``sp_size`` (``2 sp_size`` for ``zigzag``; labels
      ``ignore_index``, positions continuing the last sequence so that no real token attends to the padding).
    * every other per-token tensor is delivered aligned with the chunk's logits positions, like
      ``shift_labels``: ``[B, T, ...]`` tensors of ``shift_keys`` (aligned with ``labels``) are shifted
      first; other ``[B, T, ...]`` tensors are taken as aligned with the logits already (e.g.
      ``teacher_logits``, value targets) and only split; ``[B, T - 1, ...]`` tensors (aligned with the
      shifted labels) get one padding column at the end. Per-sequence tensors (``[B]``) and anything
      else pass unchanged. Losses therefore see every per-token tensor as ``[B, S/P]``, aligned with
      ``shift_labels``.
    """
    ref = batch.get("input_ids")
    if ref is None:
        ref = batch.get("inputs_embeds")
    if ref is None:
        raise ConfigError("sequence parallelism needs input_ids or inputs_embeds in the batch")
    rows, length = ref.shape[0], ref.shape[1]
    ring = sp_size if ring_size is None else ring_size
    multiple = ring_layout.nested_multiple(sp_size, ring, layout)
    padded = -(-length // multiple) * multiple
    pad = padded - length
    info = ShardInfo(length=length, padded_length=padded, sp_size=sp_size, sp_rank=sp_rank)
    local = padded // sp_size
    chunk: slice | torch.Tensor = slice(sp_rank * local, (sp_rank + 1) * local)
    if layout != "contiguous":
        chunk = ring_layout.nested_indices(padded, sp_size, ring, sp_rank, layout, device=ref.device)
    positions = _global_positions(batch, ref, rows, length, pad)

    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("attention_mask", "position_ids", "labels"):
            continue
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != rows:
            out[key] = value
        elif key in model_keys:
            if value.shape[1] != length:
                raise ValueError(f"{key} has shape {tuple(value.shape)}; expected sequence length {length}")
            fill = pad_token_id if key == "input_ids" else 0
            out[key] = _pad_seq(value, pad, fill)[:, chunk]
        else:
            out[key] = _loss_side_chunk(key, value, length, pad, chunk, ignore_index=ignore_index,
                                        shift=key in shift_keys)
    labels = batch.get("labels")
    if labels is not None and "shift_labels" not in batch:
        out["shift_labels"] = _pad_seq(_shift(labels, ignore_index), pad, ignore_index)[:, chunk]
    out["position_ids"] = positions[:, chunk].contiguous()
    return out, info


def _global_positions(batch: dict[str, Any], ref: torch.Tensor, rows: int, length: int, pad: int) -> torch.Tensor:
    """The batch's global ``position_ids`` (``arange`` when absent), with left padding isolated (see
    :func:`_positions_from_mask`) and continued over the ``pad`` alignment columns."""
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ref.device).expand(rows, -1)
    elif positions.dim() != 2:
        raise NotImplementedError(f"sequence parallelism needs 2-D position_ids; got {tuple(positions.shape)}")
    else:
        positions = positions.expand(rows, -1)
    mask = batch.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2:
            raise NotImplementedError("sequence parallelism supports 2-D attention masks only")
        isolated = _positions_from_mask(mask, positions)
        if isolated is not None:
            positions = isolated
    if pad:
        tail = positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)
        positions = torch.cat([positions, tail], dim=1)
    return positions


def _loss_side_chunk(key: str, value: torch.Tensor, length: int, pad: int, chunk: slice | torch.Tensor, *, ignore_index: int,
                     shift: bool) -> torch.Tensor:
    """This rank's chunk of a per-token tensor the loss reads, aligned with ``shift_labels`` (``shift``: it is
    aligned with ``labels`` and shifted first); a tensor of another length passes unchanged."""
    fill = _fill_value(key, value, ignore_index)
    if value.shape[1] == length:
        aligned = _shift(value, fill) if shift else value
    elif value.shape[1] == length - 1:
        aligned = _pad_seq(value, 1, fill)
    else:
        return value
    return _pad_seq(aligned, pad, fill)[:, chunk]
