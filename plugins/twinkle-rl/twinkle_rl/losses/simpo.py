"""SimPO (Meng et al. 2024): a reference-free, length-normalised pair loss with a target margin."""

from __future__ import annotations

from typing import Any, ClassVar

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.loss.base import LossContext, LossOutput
from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE
from twinkle_rl.checks import finite_number
from twinkle_rl.losses.base import PreferenceLoss, pair_metrics, smoothed_sigmoid_loss


class SimPOLoss(PreferenceLoss):
    """``-log sigmoid(beta / |y_w| log pi(y_w) - beta / |y_l| log pi(y_l) - gamma)`` per pair.

    The implicit reward is the mean per-token log-probability scaled by ``beta`` (no reference model); ``gamma``
    is the target reward margin. ``label_smoothing`` ``ls`` mixes in the flipped pair as for conservative DPO:
    ``-(1 - ls) log sigmoid(z) - ls log sigmoid(-z)``; ``sft_weight`` adds ``sft_weight`` x an NLL of the chosen
    answers, averaged as ``sft_normalization`` says: ``"answer"`` (default, per answer then over pairs) or
    ``"batch_tokens"`` (TRL ``CPOTrainer``'s ``cpo_alpha`` term: one token mean over the batch's chosen answer
    tokens); see :class:`~twinkle_rl.losses.base.PreferenceLoss`. TRL's SimPO is ``CPOTrainer`` with
    ``loss_type="simpo"``, whose ``cpo_alpha`` defaults to 1; here ``sft_weight`` defaults to 0 (the paper).

    Metrics (means over the micro-batch's pairs), with TRL ``CPOTrainer``'s meaning for ``loss_type="simpo"``:
    ``rewards/*`` are ``beta`` x the answers' mean per-token log-probs, ``logps/chosen`` / ``logps/rejected``
    the mean per-token log-probs themselves; with ``sft_weight`` ``nll/chosen`` and
    ``nll/chosen_batch_tokens`` (the latter is TRL's ``nll_loss``).
    """

    name: ClassVar[str] = "simpo"

    def __init__(self, beta: float = 2.0, gamma: float = 0.5, label_smoothing: float = 0.0, sft_weight: float = 0.0,
                 sft_normalization: str = "answer", ignore_index: int = IGNORE_INDEX,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__(sft_weight=sft_weight, sft_normalization=sft_normalization, ignore_index=ignore_index,
                         chunk_size=chunk_size)
        self.beta = finite_number("simpo loss: beta", beta, low=0.0, low_open=True)
        self.gamma = finite_number("simpo loss: gamma", gamma)
        self.label_smoothing = finite_number("simpo loss: label_smoothing", label_smoothing, low=0.0, high=0.5)

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        logps = self.pair_logps(outputs, inputs, context)
        chosen_rewards = self.beta * logps.chosen_mean
        rejected_rewards = self.beta * logps.rejected_mean
        losses = smoothed_sigmoid_loss(chosen_rewards - rejected_rewards - self.gamma, self.label_smoothing)
        metrics = pair_metrics(chosen_rewards, rejected_rewards, logps.chosen_mean, logps.rejected_mean)
        losses = losses + self.sft_term(logps, metrics)
        return logps.output(losses, metrics)
