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
    """``NLL(y_w) - beta * log sigmoid(log_odds(y_w) - log_odds(y_l))`` per pair.

    ``log_odds(y) = a - log(1 - exp(a))`` with ``a`` the answer's mean per-token log-probability (the paper's
    ``P(y|x)``, eq. 4-7); ``beta`` is the paper's ``lambda``. ``NLL(y_w)`` is the chosen answers' negative
    log-likelihood, averaged as ``sft_normalization`` says (see :class:`~twinkle_rl.losses.base.PreferenceLoss`):
    ``"answer"`` (default: each chosen answer's mean per-token NLL, then over pairs) or ``"batch_tokens"`` (one
    token mean over the batch's chosen answer tokens, the normalisation of TRL's ``ORPOTrainer``). TRL's ORPO
    NLL also counts the prompt tokens of the chosen sequences (decoder-only models); here only answer tokens are
    scored, so neither option is TRL's ORPO NLL to the digit.

    Metrics (means over the micro-batch's pairs), with TRL ``ORPOTrainer``'s meaning: ``rewards/*`` are ``beta``
    x the answers' mean per-token log-probs, ``logps/chosen`` / ``logps/rejected`` those mean per-token
    log-probs, ``log_odds_ratio`` the mean of ``log sigmoid(log_odds(y_w) - log_odds(y_l))`` and
    ``log_odds_chosen`` the mean of ``log_odds(y_w) - log_odds(y_l)``; and ``nll/chosen`` /
    ``nll/chosen_batch_tokens`` (the two averages of the NLL over answer tokens; not TRL's ``nll_loss``, which
    includes the prompt).
    """

    name: ClassVar[str] = "orpo"

    def __init__(self, beta: float = 0.1, sft_normalization: str = "answer", ignore_index: int = IGNORE_INDEX,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(sft_normalization=sft_normalization, ignore_index=ignore_index, chunk_size=chunk_size)
        self.beta = finite_number("orpo loss: beta", beta, low=0.0)

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        logps = self.pair_logps(outputs, inputs, context)
        chosen_mean, rejected_mean = logps.chosen_mean, logps.rejected_mean
        log_odds_ratio = log_odds(chosen_mean) - log_odds(rejected_mean)
        ratio_term = F.logsigmoid(log_odds_ratio)
        metrics = pair_metrics(self.beta * chosen_mean, self.beta * rejected_mean, chosen_mean, rejected_mean)
        metrics["log_odds_ratio"] = mean(ratio_term)
        metrics["log_odds_chosen"] = mean(log_odds_ratio)
        losses = self.chosen_nll(logps, metrics) - self.beta * ratio_term
        return logps.output(losses, metrics)
