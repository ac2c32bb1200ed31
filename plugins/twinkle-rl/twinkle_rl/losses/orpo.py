"""ORPO (Hong et al. 2024): supervised fine-tuning plus an odds-ratio preference term, no reference model."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.loss.base import LossContext, LossOutput
from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE
from twinkle_rl.checks import finite_number
from twinkle_rl.losses.base import PreferenceLoss, mean, pair_metrics


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` of ``p = exp(mean_logp)``, computed stably.

    ``log(1 - exp(a))`` is ``log(-expm1(a))`` above ``-log 2`` and ``log1p(-exp(a))`` below (Maechler's
    log1mexp); each branch gets an input clamped to its own side so that the branch ``where`` discards has a
    finite gradient too (``0 * inf`` would be NaN). ``a`` is kept ``eps`` below 0: a mean log-prob that
    rounds to 0 would make the odds infinite; that far up the odds are saturated anyway."""
    a = mean_logp.clamp(max=-torch.finfo(mean_logp.dtype).eps)
    cut = -math.log(2.0)
    near_zero = torch.log(-torch.expm1(a.clamp(min=cut)))
    far = torch.log1p(-torch.exp(a.clamp(max=cut)))
    return a - torch.where(a > cut, near_zero, far)


class ORPOLoss(PreferenceLoss):
    """``NLL(y_w) + beta * -log sigmoid(log_odds(y_w) - log_odds(y_l))`` per pair.

    ``NLL(y_w)`` is the chosen answer's mean per-token negative log-likelihood and ``log_odds(y) = a - log(1 -
    exp(a))`` with ``a`` the answer's mean per-token log-probability (the paper's ``P(y|x)``, eq. 4-7);
    ``beta`` is the paper's ``lambda``.

    Metrics: ``rewards/*`` are ``beta`` x mean per-token log-probs, ``log_odds_ratio`` the mean of
    ``log_odds(y_w) - log_odds(y_l)``, ``nll/chosen`` the SFT term, ``logps/*`` sequence sums.
    """

    name: ClassVar[str] = "orpo"

    def __init__(self, beta: float = 0.1, ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(ignore_index=ignore_index, chunk_size=chunk_size)
        self.beta = finite_number("orpo loss: beta", beta, low=0.0)

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        logps = self.pair_logps(outputs, inputs, context)
        chosen_mean, rejected_mean = logps.chosen_mean, logps.rejected_mean
        log_odds_ratio = log_odds(chosen_mean) - log_odds(rejected_mean)
        nll = -chosen_mean
        losses = nll - self.beta * F.logsigmoid(log_odds_ratio)
        metrics = pair_metrics(self.beta * chosen_mean, self.beta * rejected_mean, logps)
        metrics["log_odds_ratio"] = mean(log_odds_ratio)
        metrics["nll/chosen"] = mean(nll)
        return LossOutput(loss=losses.sum(), num_tokens=len(logps), metrics=metrics)
