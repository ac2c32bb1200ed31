"""What every preference loss shares: the policy's per-pair answer log-probabilities and the pair metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import LossContext, LossOutput, vocab_shard_of
from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE, TokenLogprobs, next_token_scores
from twinkle_core.loss.sequence_group import SequenceReduction, sequence_reduction
from twinkle_rl import layout
from twinkle_rl.checks import finite_number
from twinkle_rl.losses.scoring import TokenScoringLoss


@dataclass(frozen=True)
class PairLogps:
    """The policy's answer log-probabilities, one entry per pair (in :func:`twinkle_rl.layout.pairs` order).

    ``chosen`` / ``rejected`` are sums over the answer tokens; ``*_tokens`` the answers' token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    pairs: layout.Pairs
    #: the part of each pair's loss this rank reports: ``1 / sp_size`` when every rank of a sequence-parallel group
    #: computes the same whole pairs (see :mod:`twinkle_core.loss.sequence_group`), else 1
    share: float = 1.0

    @property
    def chosen_mean(self) -> torch.Tensor:
        return self.chosen / self.chosen_tokens

    @property
    def rejected_mean(self) -> torch.Tensor:
        return self.rejected / self.rejected_tokens

    def __len__(self) -> int:
        return len(self.pairs)

    def output(self, losses: torch.Tensor, metrics: dict[str, float]) -> LossOutput:
        """The per-pair ``losses`` summed, counted in pairs: this rank's :attr:`share` of both."""
        if self.share == 1.0:
            return LossOutput(loss=losses.sum(), num_tokens=len(self), metrics=metrics)
        return LossOutput(loss=losses.sum() * self.share, num_tokens=len(self) * self.share, metrics=metrics)


#: how the SFT (NLL) term on the chosen answers is averaged; see :class:`PreferenceLoss`
SFT_NORMALIZATIONS = ("answer", "batch_tokens")


def sft_normalization_option(where: str, value: Any) -> str:
    """``value`` if it is one of :data:`SFT_NORMALIZATIONS`, else a ``ConfigError`` naming the valid ones."""
    if value not in SFT_NORMALIZATIONS:
        raise ConfigError(f"{where}: sft_normalization must be one of {', '.join(SFT_NORMALIZATIONS)}, "
                          f"got {value!r}")
    return value


class PreferenceLoss(TokenScoringLoss):
    """Base of the pairwise losses: options every one of them takes, :meth:`pair_logps` and the SFT term.

    ``sft_weight`` adds ``sft_weight`` times an NLL of the chosen answers to the loss (RPO, Pang et al. 2024),
    which keeps the chosen answers likely while the pair term pushes them apart. ``sft_normalization`` says
    how that NLL is averaged:

    * ``"answer"`` (default, the RPO paper's ``-log M(y_w|x) / |y_w|``): each chosen answer's NLL divided by
      its own token count, then averaged over pairs like the pair term. Each pair's loss depends on its own
      answers only, so gradient accumulation and data parallelism give exactly the loss of one big batch.
    * ``"batch_tokens"`` (TRL's: ``rpo_alpha`` of ``DPOTrainer`` up to 0.28, ``loss_type=["sigmoid", "sft"]``
      from 0.29, ``cpo_alpha`` of ``CPOTrainer``): one token mean of the NLL over every chosen answer token of
      the batch one forward pass sees (``data.batch_size`` pairs on one rank, TRL's per-device batch), so
      long answers weigh more. The model averages micro-batches and ranks weighted by their pair counts;
      TRL averages them equally, which is the same when every micro-batch holds as many pairs. Like TRL's,
      this term is not invariant to how a step is split: two micro-batches of ``n`` pairs are not one of
      ``2n`` (each half has its own token mean).

    Under sequence parallelism (strategy ``ulysses``) each rank scores its slice of every sequence and the answers'
    sums and token counts are summed over the sequence group (:mod:`twinkle_core.loss.sequence_group`); every rank
    then computes the same pairs and reports ``1 / sp_size`` of their loss and count. Packed pairs
    (``data.packing``) are refused there.

    With ``sft_weight > 0`` both averages are logged: ``nll/chosen`` (``"answer"``'s, the mean over pairs of
    each chosen answer's mean NLL) and ``nll/chosen_batch_tokens`` (``"batch_tokens"``'s, the value TRL logs
    as ``nll_loss`` for DPO and CPO / SimPO).
    """

    requires: ClassVar[frozenset[str]] = frozenset({layout.PREFERENCE_PAIRS})

    def __init__(self, *, sft_weight: float = 0.0, sft_normalization: str = "answer",
                 ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        sft_weight = finite_number(f"{self.name} loss: sft_weight", sft_weight, low=0.0)
        super().__init__(ignore_index=ignore_index, chunk_size=chunk_size)
        self.sft_weight = sft_weight
        self.sft_normalization = sft_normalization_option(f"{self.name} loss", sft_normalization)

    def pair_logps(self, outputs: dict[str, Any], inputs: dict[str, Any],
                   context: LossContext | None = None) -> PairLogps:
        """Sum and length of every answer under the policy, per pair; errors for batches a pair loss cannot use."""
        pairs = layout.pairs(inputs, self.where)
        reduction = sequence_reduction(inputs, context)
        scored = next_token_scores(outputs["logits"], inputs, ignore_index=self.ignore_index,
                                   chunk_size=self.chunk_size, vocab_shard=vocab_shard_of(context))
        if reduction.sliced:
            sums, counts = self.sliced_sequence_sums(scored, inputs, reduction, 2 * len(pairs))
        else:
            sums, counts = layout.sequence_sums(scored.logps, scored.mask, inputs, 2 * len(pairs))
        empty = (counts == 0).nonzero().flatten().tolist()
        if empty:
            # a length-normalised term would divide by zero and a summed one would compare an answer with nothing
            raise ValueError(f"{self.where}: sequence(s) {empty[:5]} have no answer tokens (every label is "
                             f"ignore_index={self.ignore_index}); the answer was truncated away, raise data.max_length "
                             f"or drop such pairs")
        chosen, rejected = pairs.chosen.to(sums.device), pairs.rejected.to(sums.device)
        return PairLogps(sums[chosen], sums[rejected], counts[chosen], counts[rejected], pairs, reduction.share)

    def sliced_sequence_sums(self, scored: TokenLogprobs, inputs: dict[str, Any], reduction: SequenceReduction,
                             num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-sequence answer sums and token counts from this rank's slice of every row (one sequence a row)."""
        if inputs.get("sequence_index") is not None:
            raise ValueError(f"{self.where}: packed preference batches (data.packing) are not supported under "
                             f"sequence parallelism (mesh sp / cp > 1); set data.packing: false")
        if scored.logps.shape[0] != num_sequences:
            raise layout.PairLayoutError(f"{scored.logps.shape[0]} rows for {num_sequences} sequences")
        return reduction.row_sums(scored.logps, scored.mask.to(scored.logps.dtype))

    def chosen_nll(self, logps: PairLogps, metrics: dict[str, float]) -> torch.Tensor:
        """Per pair, its share of the chosen answers' NLL under ``sft_normalization`` (the mean over pairs is the
        NLL the term adds); records ``nll/chosen`` and ``nll/chosen_batch_tokens``."""
        metrics.update(nll_metrics(logps))
        if self.sft_normalization == "answer":
            return -logps.chosen_mean
        # sum over pairs = pairs x (token sum / token count): the pair count is what the model divides by
        return -logps.chosen * (len(logps) / logps.chosen_tokens.sum())

    def sft_term(self, logps: PairLogps, metrics: dict[str, float]) -> torch.Tensor | float:
        """``sft_weight`` x :meth:`chosen_nll`, per pair (0, and no metric, when ``sft_weight`` is 0)."""
        if not self.sft_weight:
            return 0.0
        return self.sft_weight * self.chosen_nll(logps, metrics)


def smoothed_sigmoid_loss(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-(1 - ls) log sigmoid(z) - ls log sigmoid(-z)``: the pair loss when a share ``ls`` of labels is flipped."""
    loss = -F.logsigmoid(z)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-z)
    return loss


def mean(x: torch.Tensor) -> float:
    return float(x.detach().to(torch.float64).mean())  # float64: exact shares (accuracies) from float32 losses


def nll_metrics(logps: PairLogps) -> dict[str, float]:
    """The chosen answers' NLL averaged both ways (see :class:`PreferenceLoss`)."""
    with torch.no_grad():
        chosen = logps.chosen.to(torch.float64)
        return {
            "nll/chosen": mean(-chosen / logps.chosen_tokens),
            "nll/chosen_batch_tokens": float(-chosen.sum() / logps.chosen_tokens.sum()),
        }


def pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, chosen_logps: torch.Tensor,
                 rejected_logps: torch.Tensor) -> dict[str, float]:
    """Means over this micro-batch's pairs of the rewards and of the answers' log-probabilities as the loss uses
    them (sequence sums for DPO, per-token means for SimPO and ORPO: what TRL logs under these names)."""
    with torch.no_grad():
        return {
            "rewards/chosen": mean(chosen_rewards),
            "rewards/rejected": mean(rejected_rewards),
            "rewards/margins": mean(chosen_rewards - rejected_rewards),
            "rewards/accuracies": mean(chosen_rewards > rejected_rewards),
            "logps/chosen": mean(chosen_logps),
            "logps/rejected": mean(rejected_logps),
        }
