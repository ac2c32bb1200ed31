"""The Bradley–Terry loss of a reward model: ``-log sigmoid(r_chosen - r_rejected - margin)`` per pair.

The reward model scores each sequence with one number (``model_kind = "sequence_score"``: ``logits`` ``[S, 1]``,
read at the sequence's last non-pad token). This is TRL's ``RewardTrainer.compute_loss``: with a ``margin`` column in
the data, the pair's margin is subtracted inside the sigmoid (Llama 2's margin loss), and
``center_rewards_coefficient`` adds ``c * (r_chosen + r_rejected) ** 2`` per pair (Eisenstein et al. 2023), which
keeps the rewards centred on zero. The loss is a sum over pairs reported with the pair count, so the model divides
by the pairs of the whole step (accumulation and data parallelism give the mean over every pair of the step, TRL's
mean over one batch when a step is one batch).

Metrics (TRL's names): ``accuracy`` (share of pairs whose chosen answer scores higher), ``margin`` (mean
``r_chosen - r_rejected``), ``mean_reward`` / ``min_reward`` / ``max_reward`` over every sequence, and
``rewards/chosen`` / ``rewards/rejected``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import Loss, LossContext, LossOutput
from twinkle_rl import layout
from twinkle_rl.checks import finite_number
from twinkle_rl.losses.base import mean


def sequence_scores(outputs: dict[str, Any], where: str) -> torch.Tensor:
    """``[S]`` float32 scores from a sequence-score network's ``logits`` ``[S, 1]``."""
    logits = outputs.get("logits")
    if logits is None or logits.dim() != 2 or logits.shape[-1] != 1:
        shape = None if logits is None else tuple(logits.shape)
        raise ConfigError(f"{where} needs one score per sequence (logits [S, 1] of a sequence_score network: the "
                          f"reward_model task), got logits of shape {shape}")
    return logits[:, 0].float()


class BradleyTerryLoss(Loss):
    name: ClassVar[str] = "bradley_terry"
    requires: ClassVar[frozenset[str]] = frozenset({layout.SCORED_PAIRS})

    def __init__(self, *, center_rewards_coefficient: float | None = None) -> None:
        if center_rewards_coefficient is not None:
            center_rewards_coefficient = finite_number("loss.options.center_rewards_coefficient",
                                                       center_rewards_coefficient, low=0.0)
        self.center_rewards_coefficient = center_rewards_coefficient

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        scores = sequence_scores(outputs, "the bradley_terry loss")
        pairs = layout.pairs(inputs, "the bradley_terry loss")
        device = scores.device
        chosen, rejected = scores[pairs.chosen.to(device)], scores[pairs.rejected.to(device)]
        difference = chosen - rejected
        margin = inputs.get("margin")  # [S]: each pair's margin on both of its sequences
        if margin is not None:
            margin = torch.as_tensor(margin, dtype=scores.dtype).reshape(-1)
            difference = difference - margin[pairs.chosen].to(device)
        losses = -F.logsigmoid(difference)
        if self.center_rewards_coefficient:
            losses = losses + self.center_rewards_coefficient * (chosen + rejected) ** 2
        with torch.no_grad():
            metrics = {
                "accuracy": mean(chosen > rejected),
                "margin": mean(chosen - rejected),
                "rewards/chosen": mean(chosen),
                "rewards/rejected": mean(rejected),
                "mean_reward": mean(scores),
                "min_reward": float(scores.min()),
                "max_reward": float(scores.max()),
            }
        return LossOutput(loss=losses.sum(), num_tokens=len(pairs), metrics=metrics)
