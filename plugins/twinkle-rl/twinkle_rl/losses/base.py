"""What every preference loss shares: the policy's per-pair answer log-probabilities and the pair metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.loss.base import LossContext, require_whole_sequences
from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs
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

    @property
    def chosen_mean(self) -> torch.Tensor:
        return self.chosen / self.chosen_tokens

    @property
    def rejected_mean(self) -> torch.Tensor:
        return self.rejected / self.rejected_tokens

    def __len__(self) -> int:
        return len(self.pairs)


class PreferenceLoss(TokenScoringLoss):
    """Base of the pairwise losses: options every one of them takes, and :meth:`pair_logps`.

    ``sft_weight`` adds ``sft_weight`` times the chosen answer's mean per-token NLL to each pair's loss
    (RPO, Pang et al. 2024), which keeps the chosen answers likely while the pair term pushes them apart."""

    requires: ClassVar[frozenset[str]] = frozenset({layout.PREFERENCE_PAIRS})

    def __init__(self, *, sft_weight: float = 0.0, ignore_index: int = IGNORE_INDEX,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        sft_weight = finite_number(f"{self.name} loss: sft_weight", sft_weight, low=0.0)
        super().__init__(ignore_index=ignore_index, chunk_size=chunk_size)
        self.sft_weight = sft_weight

    def pair_logps(self, outputs: dict[str, Any], inputs: dict[str, Any],
                   context: LossContext | None = None) -> PairLogps:
        """Sum and length of every answer under the policy, per pair; errors for batches a pair loss cannot use."""
        require_whole_sequences(inputs, self.where, context)
        pairs = layout.pairs(inputs, self.where)
        logps, mask = token_logprobs(outputs["logits"], inputs["labels"], self.ignore_index, self.chunk_size)
        sums, counts = layout.sequence_sums(logps, mask, inputs, 2 * len(pairs))
        empty = (counts == 0).nonzero().flatten().tolist()
        if empty:
            # a length-normalised term would divide by zero and a summed one would compare an answer with nothing
            raise ValueError(f"{self.where}: sequence(s) {empty[:5]} have no answer tokens (every label is "
                             f"ignore_index={self.ignore_index}); the answer was truncated away, raise data.max_length "
                             f"or drop such pairs")
        chosen, rejected = pairs.chosen.to(sums.device), pairs.rejected.to(sums.device)
        return PairLogps(sums[chosen], sums[rejected], counts[chosen], counts[rejected], pairs)

    def sft_term(self, logps: PairLogps, metrics: dict[str, float]) -> torch.Tensor | float:
        """``sft_weight`` x the chosen answers' mean per-token NLL, per pair (0 when off); records ``nll/chosen``."""
        if not self.sft_weight:
            return 0.0
        nll = -logps.chosen_mean
        metrics["nll/chosen"] = mean(nll)
        return self.sft_weight * nll


def smoothed_sigmoid_loss(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-(1 - ls) log sigmoid(z) - ls log sigmoid(-z)``: the pair loss when a share ``ls`` of labels is flipped."""
    loss = -F.logsigmoid(z)
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * F.logsigmoid(-z)
    return loss


def mean(x: torch.Tensor) -> float:
    return float(x.detach().to(torch.float64).mean())  # float64: exact shares (accuracies) from float32 losses


def pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, logps: PairLogps) -> dict[str, float]:
    """Means over this micro-batch's pairs (the names TRL logs, so dashboards compare)."""
    with torch.no_grad():
        return {
            "rewards/chosen": mean(chosen_rewards),
            "rewards/rejected": mean(rejected_rewards),
            "rewards/margins": mean(chosen_rewards - rejected_rewards),
            "rewards/accuracies": mean(chosen_rewards > rejected_rewards),
            "logps/chosen": mean(logps.chosen),
            "logps/rejected": mean(logps.rejected),
        }
