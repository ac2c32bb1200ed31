"""The preference batch layout: how the ``preference`` task hands answer pairs to the preference losses.

A batch of ``P`` pairs holds ``S = 2P`` sequences: each pair's chosen and rejected answer to one prompt.
Besides ``input_ids`` / ``attention_mask`` / ``labels`` (``labels`` mask everything but answer tokens)
the batch carries

* ``pair_index`` ``[S]`` long: the pair each sequence belongs to;
* ``is_chosen`` ``[S]`` bool: ``True`` for the pair's chosen answer, ``False`` for its rejected one;
* ``sequence_index`` ``[B, T]`` long, only when sequences are packed into rows (padding-free): the
  sequence ``0 .. S-1`` each token belongs to, ``-1`` for padding. Without it, sequence ``s`` is row ``s``;
* optionally ``ref_logps`` ``[S]`` float: the reference model's summed log-probability of each
  sequence's answer tokens (see :mod:`twinkle_rl.reference`).
* optionally ``margin`` ``[S]`` float: the row's margin (its ``margin`` column), the same on both sequences of a
  pair (a reward model's margin loss, :mod:`twinkle_rl.losses.bradley_terry`).

The task orders sequences pair by pair (chosen, then rejected), so a batch split at an even row keeps
every pair whole; :func:`pairs` still checks that each pair is complete, so a split inside a pair is an
error, never a silent mis-pairing. Losses must read pairs only through :func:`pairs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: what the ``preference`` task provides and every preference loss requires (``Task.provides`` / ``Loss.requires``)
PREFERENCE_PAIRS = "preference_pairs"
#: what the ``reward_model`` task provides and the ``bradley_terry`` loss requires: pairs in the same layout, each
#: sequence scored by one number (a sequence-score network), not by token log-probabilities
SCORED_PAIRS = "scored_pairs"

LAYOUT_KEYS = ("pair_index", "is_chosen")


class PairLayoutError(ValueError):
    """The batch does not carry the preference layout, or carries a broken one."""


@dataclass(frozen=True)
class Pairs:
    """Sequence indices of each pair's chosen and rejected answer, in pair order."""

    chosen: torch.Tensor
    rejected: torch.Tensor

    def __len__(self) -> int:
        return int(self.chosen.numel())


def pairs(inputs: dict[str, Any], where: str) -> Pairs:
    """The pairs of a batch in the preference layout; a clear error when the layout is missing or broken."""
    missing = [key for key in LAYOUT_KEYS if inputs.get(key) is None]
    if missing:
        raise PairLayoutError(
            f"{where} trains on answer pairs, but the batch has no {' / '.join(missing)}: it was not built by the "
            f"'preference' task (task: preference in the recipe, rows with chosen / rejected answers; "
            f"pip install twinkle-rl). Splitting an ordinary batch into halves would pair unrelated rows.")
    pair_index = torch.as_tensor(inputs["pair_index"]).reshape(-1).long().cpu()
    is_chosen = torch.as_tensor(inputs["is_chosen"]).reshape(-1).bool().cpu()
    if pair_index.numel() != is_chosen.numel() or pair_index.numel() == 0:
        raise PairLayoutError(f"{where}: pair_index has {pair_index.numel()} entries, is_chosen {is_chosen.numel()}")
    chosen, rejected = {}, {}
    for sequence, (pair, is_c) in enumerate(zip(pair_index.tolist(), is_chosen.tolist(), strict=True)):
        side = chosen if is_c else rejected
        if pair in side:
            raise PairLayoutError(f"{where}: pair {pair} has two {'chosen' if is_c else 'rejected'} answers")
        side[pair] = sequence
    incomplete = sorted(set(chosen) ^ set(rejected))
    if incomplete:
        raise PairLayoutError(f"{where}: pair(s) {incomplete[:5]} have only one answer in this batch; the batch was "
                              f"split inside a pair (split preference batches at an even row)")
    order = sorted(chosen)
    return Pairs(torch.tensor([chosen[p] for p in order]), torch.tensor([rejected[p] for p in order]))


def sequence_sums(per_token: torch.Tensor, mask: torch.Tensor, inputs: dict[str, Any],
                  num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of shifted per-token values, and each sequence's number of counted tokens.

    ``per_token`` and ``mask`` are ``[B, T - 1]`` in the shifted layout of
    :func:`twinkle_core.loss.logprobs.token_logprobs` (position ``t`` scores label ``t + 1``)."""
    sequence_index = inputs.get("sequence_index")
    if sequence_index is None:
        if per_token.shape[0] != num_sequences:
            raise PairLayoutError(f"{per_token.shape[0]} rows for {num_sequences} sequences and no sequence_index")
        weights = mask.to(per_token.dtype)
        return (per_token * weights).sum(-1), weights.sum(-1)
    owner = torch.as_tensor(sequence_index, device=per_token.device).long()[:, 1:]  # the label's sequence
    valid = mask & (owner >= 0)
    sums = per_token.new_zeros(num_sequences).index_add(0, owner[valid], per_token[valid])
    counts = per_token.new_zeros(num_sequences).index_add(0, owner[valid], torch.ones_like(per_token[valid]))
    return sums, counts
