"""What the clipped policy losses share: the policy's token log-probabilities, the importance ratio inputs,
the k3 KL estimate and the metrics. The losses themselves are in :mod:`twinkle_rl.losses.policy`.

Inputs every policy loss reads (besides ``labels``), per token in the shifted ``[B, T - 1]`` layout (position
``t`` holds the value for ``labels[:, t + 1]``; ``[B, T]`` aligned with ``labels`` also works, its first
column is dropped):

* ``old_logps`` (optional): the behaviour (sampling) policy's log-probabilities of the label tokens. Absent:
  the detached current ones (on-policy: ratio 1, with the gradient of the ratio);
* ``ref_logps`` (needed when ``beta != 0``): the reference model's, for the KL term;
* ``advantages``: per sequence ``[B]`` or per token (each loss says which it takes).

KL: ``KL_t = exp(ref - logp) - (ref - logp) - 1``, Schulman's k3 estimator of ``KL(pi || pi_ref)`` (as in
DeepSeekMath and TRL): unbiased, non-negative, evaluated on the sampled tokens.

Sequence parallelism (strategy ``ulysses``: Ulysses, ring or both): the batch holds each rank's slice of every
row (``shift_labels`` ``[B, L]``, no ``labels``; per-token inputs sliced and aligned with it by the strategy). Token
sums add up over the ranks as they are; per-sequence means, counts and ratios are summed over the sequence group
first (:mod:`twinkle_core.loss.sequence_group`), and a per-sequence loss reports ``1 / sp_size`` of its sum and of
its sequence count on each rank, so that the group counts every sequence once. ``dr_grpo`` then needs
``max_completion_length`` (a slice's length is not the batch's).

Metrics (means over this micro-batch): ``clip_fraction`` (share of the loss's units, tokens or sequences,
where the clipped branch is active, i.e. the unit gets no gradient from the surrogate), ``ratio_mean``,
``entropy`` (mean over label tokens of the entropy of ``softmax(logits / temperature)``, no gradient) and,
with ``ref_logps``, ``kl_mean`` (mean k3 estimate over label tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.loss.base import LossContext, vocab_shard_of
from twinkle_core.loss.helpers import align_to_shifted, require, scalar
from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE, next_token_scores
from twinkle_core.loss.sequence_group import SequenceReduction, sequence_reduction
from twinkle_rl.checks import finite_number
from twinkle_rl.losses.scoring import TokenScoringLoss


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float,
                      epsilon_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` (Schulman et al. 2017, eq. 7) and where the
    clipped branch is active (``r > 1 + eps_high`` with ``A > 0`` or ``r < 1 - eps_low`` with ``A < 0``)."""
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        is_clipped = ((ratio > 1.0 + epsilon_high) & (advantages > 0)) | ((ratio < 1.0 - epsilon_low) & (advantages < 0))
    return loss, is_clipped


@dataclass(frozen=True)
class PolicyTokens:
    """One micro-batch scored by the policy, ``[B, T - 1]`` each.

    ``log_ratio`` is ``logp - old_logp`` (0 where masked); ``kl`` the k3 estimate (0 where masked), ``None``
    without ``ref_logps``; ``weights`` the mask as floats in the computation dtype."""

    logps: torch.Tensor
    log_ratio: torch.Tensor
    kl: torch.Tensor | None
    entropy: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor
    #: whole rows, or this rank's slices of them (sequence parallelism): see :mod:`twinkle_core.loss.sequence_group`
    reduction: SequenceReduction = SequenceReduction()

    @property
    def share(self) -> float:
        """The part of a per-sequence loss (and of its sequence count) this rank reports (``1 / sp_size``)."""
        return self.reduction.share

    def sequence_mean(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[B]``: the mean of ``per_token`` over each whole row's label tokens (0 for a row without any)."""
        sums, counts = self.reduction.row_sums(per_token, self.weights)
        return sums / counts.clamp(min=1)

    def sequences(self) -> torch.Tensor:
        """``[B]`` floats: 1 for a row with at least one label token (padding rows count for nothing)."""
        return (self.reduction.count(self.weights.sum(-1)) > 0).to(self.weights.dtype)

    def token_mean(self, per_token: torch.Tensor) -> float:
        return scalar((per_token * self.weights).sum() / self.weights.sum().clamp(min=1))


class PolicyLoss(TokenScoringLoss):
    """Base of the clipped policy losses: hyper-parameters, :meth:`policy_tokens` and :meth:`metrics`.

    ``temperature`` must be the temperature the rollouts were sampled at: log-probabilities are those of
    ``softmax(logits / temperature)``. ``chunk_size`` bounds the memory of the log-softmax (rows per chunk).
    """

    #: a recipe pairing a policy loss with a task whose batches have no advantages is refused before anything runs
    requires: ClassVar[frozenset[str]] = frozenset({"advantages"})
    #: True where each row is one sequence of the loss (per-sequence means or ratios): packed rows are refused
    per_sequence: ClassVar[bool] = False

    def __init__(self, *, epsilon_low: float, epsilon_high: float, beta: float = 0.0, temperature: float = 1.0,
                 ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        where = f"{self.name} loss"
        self.epsilon_low = finite_number(f"{where}: the lower clip range (epsilon / epsilon_low)", epsilon_low, low=0.0)
        self.epsilon_high = finite_number(f"{where}: the upper clip range (epsilon / epsilon_high)", epsilon_high,
                                          low=0.0)
        self.beta = finite_number(f"{where}: beta", beta, low=0.0)
        self.temperature = finite_number(f"{where}: temperature", temperature, low=0.0, low_open=True)
        super().__init__(ignore_index=ignore_index, chunk_size=chunk_size)

    def policy_tokens(self, outputs: dict[str, Any], inputs: dict[str, Any],
                      context: LossContext | None = None) -> PolicyTokens:
        """Score the labels under the policy; align ``old_logps`` / ``ref_logps``; errors for unusable batches."""
        reduction = sequence_reduction(inputs, context)
        if self.per_sequence:
            self.require_one_sequence_per_row(inputs, reduction)
        scored = next_token_scores(outputs["logits"], inputs, temperature=self.temperature,
                                   ignore_index=self.ignore_index, chunk_size=self.chunk_size,
                                   vocab_shard=vocab_shard_of(context), with_entropy=True)
        logps, mask = scored.logps, scored.mask
        zeros = torch.zeros_like(logps)
        old = self.token_input(inputs, "old_logps", logps) if inputs.get("old_logps") is not None else logps.detach()
        # masked positions carry arbitrary values (padding): zero them before exp so nothing overflows
        log_ratio = torch.where(mask, logps - old, zeros)
        kl = None
        if inputs.get("ref_logps") is not None:
            ref_gap = torch.where(mask, self.token_input(inputs, "ref_logps", logps) - logps, zeros)
            kl = torch.exp(ref_gap) - ref_gap - 1.0
        elif self.beta != 0.0:
            raise KeyError(f"{self.where} with beta={self.beta} needs inputs['ref_logps']")
        return PolicyTokens(logps, log_ratio, kl, scored.entropy, mask, mask.to(logps.dtype), reduction)

    def token_input(self, inputs: dict[str, Any], key: str, like: torch.Tensor) -> torch.Tensor:
        """``inputs[key]`` in the shifted ``[B, T - 1]`` layout of ``like`` (a ``[B]`` tensor is broadcast)."""
        value = torch.as_tensor(require(inputs, key, self.where, "inputs")).to(like.device)
        return align_to_shifted(value, like.shape[0], like.shape[1], key).to(like.dtype)

    def require_one_sequence_per_row(self, inputs: dict[str, Any], reduction: SequenceReduction) -> None:
        """Refuse packed rows (collective over the sequence group for sliced rows, whose packing only the whole
        group can see)."""
        if reduction.rows_are_packed(inputs):
            raise ValueError(f"{self.where} takes each row for one completion (per-sequence advantages, means or "
                             f"ratios), but the batch is packed (position_ids without attention_mask); train the "
                             f"policy on padded batches")

    def metrics(self, tokens: PolicyTokens, ratio: torch.Tensor, is_clipped: torch.Tensor,
                unit_weights: torch.Tensor) -> dict[str, float]:
        """The metrics of the module docstring; ``ratio`` / ``is_clipped`` are per unit (``unit_weights`` 1/0)."""
        with torch.no_grad():
            units = unit_weights.sum().clamp(min=1)
            metrics = {
                "clip_fraction": scalar((is_clipped.to(unit_weights.dtype) * unit_weights).sum() / units),
                "ratio_mean": scalar((ratio * unit_weights).sum() / units),
                "entropy": tokens.token_mean(tokens.entropy),
            }
            if tokens.kl is not None:
                metrics["kl_mean"] = tokens.token_mean(tokens.kl)
        return metrics


__all__ = ["PolicyLoss", "PolicyTokens", "clipped_surrogate"]
