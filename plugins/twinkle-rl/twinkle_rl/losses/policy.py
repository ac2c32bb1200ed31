"""Clipped policy-gradient losses for RL on LLMs: GRPO, DAPO, Dr. GRPO, PPO and GSPO.

The token-level ones share PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization
Algorithms", eq. 7) with ``r_t = exp(log pi(o_t) - log pi_old(o_t))`` and advantage ``A``::

    l_t = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_t

(``KL_t`` the k3 estimate, see :mod:`twinkle_rl.losses.clipped`). They differ in the advantages they take and
in how ``l_t`` is aggregated (TRL's ``loss_type`` names for the GRPO family):

* :class:`GRPOLoss` (``"grpo"``, Shao et al. 2024, DeepSeekMath): mean over each sequence's tokens, then
  over sequences, ``1/G sum_i 1/|o_i| sum_t l``. Returns the sum of per-sequence means, ``num_tokens`` =
  sequences.
* :class:`DAPOLoss` (``"dapo"``, Yu et al. 2025): token level, ``1/sum_i |o_i| sum_i sum_t l``, with the
  decoupled clip range ``eps_low=0.2, eps_high=0.28``. Returns the token sum, ``num_tokens`` = tokens.
* :class:`DrGRPOLoss` (``"dr_grpo"``, Liu et al. 2025, "Understanding R1-Zero-Like Training"):
  ``1/(L G) sum_i sum_t l`` with a constant ``L`` (``max_completion_length``), no length normalisation.
  Returns ``sum_i sum_t l / L``, ``num_tokens`` = sequences.
* :class:`PPOLoss` (``"ppo"``): per-token advantages (GAE, Schulman et al. 2016), token-level aggregation
  as DAPO's, symmetric ``eps = 0.2``.
* :class:`GSPOLoss` (``"gspo"``, Zheng et al. 2025, "Group Sequence Policy Optimization"): one ratio per
  sequence, ``s_i = exp(1/|o_i| sum_t (log pi - log pi_old))``, and
  ``l_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) + beta * 1/|o_i| sum_t KL_t``; mean over
  sequences (``num_tokens`` = sequences).

The model divides the accumulated sums by the global ``num_tokens``, which makes each of these exact across
micro-batches and data-parallel ranks (a per-sequence mean is local to its sequence). "Sequences" are rows
with at least one label token; fully masked (padding) rows count for nothing. Each row must be one
completion: packed batches are refused where a row's tokens are averaged or share one advantage.

``temperature`` (default 1): the temperature the rollouts were sampled at; every log-probability is one of
``softmax(logits / temperature)`` (see :mod:`twinkle_core.loss.logprobs` for its memory cost: none beyond a
chunk).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import LossContext, LossOutput
from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE
from twinkle_rl.checks import optional_integer
from twinkle_rl.losses.clipped import PolicyLoss, PolicyTokens, clipped_surrogate


class _TokenRatioLoss(PolicyLoss):
    """Per-token ratios and surrogate; subclasses choose the aggregation in :meth:`aggregate`."""

    def aggregate(self, per_token: torch.Tensor, tokens: PolicyTokens) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def advantages(self, inputs: dict[str, Any], tokens: PolicyTokens) -> torch.Tensor:
        if torch.as_tensor(inputs.get("advantages", 0.0)).dim() == 1:
            # one advantage per row: a row must be one completion
            self.require_one_sequence_per_row(inputs, tokens.reduction)
        return self.token_input(inputs, "advantages", tokens.logps)

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        tokens = self.policy_tokens(outputs, inputs, context)
        advantages = self.advantages(inputs, tokens)
        ratio = torch.exp(tokens.log_ratio)
        loss_t, is_clipped = clipped_surrogate(ratio, advantages, self.epsilon_low, self.epsilon_high)
        if tokens.kl is not None and self.beta != 0.0:
            loss_t = loss_t + self.beta * tokens.kl
        loss, num = self.aggregate(loss_t * tokens.weights, tokens)
        return LossOutput(loss=loss, num_tokens=num, metrics=self.metrics(tokens, ratio, is_clipped, tokens.weights))


class GRPOLoss(_TokenRatioLoss):
    """GRPO: per-sequence token mean, summed over sequences; ``num_tokens`` = sequences.

    ``epsilon`` is the symmetric clip range; pass ``epsilon_high`` for an asymmetric one. Advantages ``[B]``
    or per token."""

    name: ClassVar[str] = "grpo"
    per_sequence: ClassVar[bool] = True

    def __init__(self, epsilon: float = 0.2, beta: float = 0.0, epsilon_high: float | None = None,
                 ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE, temperature: float = 1.0) -> None:
        super().__init__(epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high,
                         beta=beta, temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size)

    def aggregate(self, per_token: torch.Tensor, tokens: PolicyTokens) -> tuple[torch.Tensor, Any]:
        # per-sequence means over whole rows: each rank of a sequence-parallel group reports its share of them
        return tokens.sequence_mean(per_token).sum() * tokens.share, tokens.sequences().sum() * tokens.share


class DAPOLoss(_TokenRatioLoss):
    """DAPO: decoupled clip ``[1 - epsilon_low, 1 + epsilon_high]``, token-level aggregation.

    Returns the sum over all label tokens with ``num_tokens`` = number of label tokens. Advantages ``[B]`` or
    per token."""

    name: ClassVar[str] = "dapo"

    def __init__(self, epsilon_low: float = 0.2, epsilon_high: float = 0.28, beta: float = 0.0,
                 ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE, temperature: float = 1.0) -> None:
        super().__init__(epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta, temperature=temperature,
                         ignore_index=ignore_index, chunk_size=chunk_size)

    def aggregate(self, per_token: torch.Tensor, tokens: PolicyTokens) -> tuple[torch.Tensor, Any]:
        return per_token.sum(), tokens.weights.sum()


class DrGRPOLoss(_TokenRatioLoss):
    """Dr. GRPO: token sum divided by the constant ``max_completion_length`` per sequence.

    Returns ``sum_i sum_t l / max_completion_length`` with ``num_tokens`` = number of sequences, so the final
    loss is ``1 / (L * G) * sum_i sum_t l`` with no per-sequence length normalisation. Set
    ``max_completion_length`` to the generation limit; ``None`` falls back to the batch's shifted length
    ``T - 1``, which is only a constant when every micro-batch is padded alike.
    """

    name: ClassVar[str] = "dr_grpo"
    per_sequence: ClassVar[bool] = True

    def __init__(self, epsilon: float = 0.2, max_completion_length: int | None = None, beta: float = 0.0,
                 epsilon_high: float | None = None, ignore_index: int = IGNORE_INDEX,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, temperature: float = 1.0) -> None:
        super().__init__(epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high,
                         beta=beta, temperature=temperature, ignore_index=ignore_index, chunk_size=chunk_size)
        self.max_completion_length = optional_integer("dr_grpo loss: max_completion_length", max_completion_length,
                                                      low=1)

    def aggregate(self, per_token: torch.Tensor, tokens: PolicyTokens) -> tuple[torch.Tensor, Any]:
        if self.max_completion_length is None and tokens.reduction.sliced:
            raise ConfigError(f"{self.where}: under sequence parallelism the batch's length is not the length of a "
                              f"rank's slice; set the loss option max_completion_length (the generation limit)")
        length = self.max_completion_length or per_token.shape[-1]
        # a token sum (the slices' sums add up over the ranks) over a count of whole sequences (shared)
        return per_token.sum() / length, tokens.sequences().sum() * tokens.share


class PPOLoss(DAPOLoss):
    """PPO's clipped policy loss on per-token advantages (e.g. GAE from a critic), token-level aggregation.

    ``advantages`` must be per token, ``[B, T - 1]`` (shifted) or ``[B, T]`` (aligned with ``labels``); one
    advantage per sequence is refused (that is ``dapo``, or ``grpo``). ``epsilon`` is the symmetric clip range
    (0.2 as in the PPO paper); ``epsilon_high`` makes it asymmetric."""

    name: ClassVar[str] = "ppo"

    def __init__(self, epsilon: float = 0.2, beta: float = 0.0, epsilon_high: float | None = None,
                 ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE, temperature: float = 1.0) -> None:
        super().__init__(epsilon, epsilon if epsilon_high is None else epsilon_high, beta, ignore_index,
                         chunk_size, temperature)

    def advantages(self, inputs: dict[str, Any], tokens: PolicyTokens) -> torch.Tensor:
        shape = tuple(torch.as_tensor(inputs.get("advantages", 0.0)).shape)
        if len(shape) != 2:
            raise ValueError(f"{self.where} takes per-token advantages [B, T - 1] or [B, T] (e.g. GAE); got shape "
                             f"{shape}. For one advantage per sequence use 'dapo' (the same token-level loss) or "
                             f"'grpo'")
        return super().advantages(inputs, tokens)


class GSPOLoss(PolicyLoss):
    """GSPO: one length-normalised importance ratio per sequence, clipped per sequence.

    With ``d_t = log pi(o_t) - log pi_old(o_t)``: ``s_i = exp(1/|o_i| sum_t d_t)`` and the per-sequence loss
    ``-min(s_i A_i, clip(s_i, 1 - epsilon_low, 1 + epsilon_high) A_i) + beta * 1/|o_i| sum_t KL_t``, summed over
    sequences with ``num_tokens`` = sequences (Zheng et al. 2025, arXiv:2507.18071). The paper trains without
    a KL term; ``beta`` adds the per-token k3 estimate averaged per sequence, like the ratio.

    This is the sequence form of the objective. The paper's GSPO-token variant, with the same advantage on
    every token of a sequence, has the same value and gradient, so it is not separate here. The defaults
    ``epsilon_low=3e-4``, ``epsilon_high=4e-4`` are the clip ranges of the paper's experiments: a sequence ratio
    is a geometric mean of token ratios, far closer to 1 than one token's, so the range is about three orders
    of magnitude below PPO's 0.2.

    ``advantages`` must be ``[B]``, one per sequence; per-token advantages are refused (``ppo`` takes those).
    Metrics ``clip_fraction`` and ``ratio_mean`` are over sequences; ``entropy`` and ``kl_mean`` over tokens.
    """

    name: ClassVar[str] = "gspo"
    per_sequence: ClassVar[bool] = True

    def __init__(self, epsilon_low: float = 3e-4, epsilon_high: float = 4e-4, beta: float = 0.0,
                 ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE, temperature: float = 1.0) -> None:
        super().__init__(epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta, temperature=temperature,
                         ignore_index=ignore_index, chunk_size=chunk_size)

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        tokens = self.policy_tokens(outputs, inputs, context)
        shape, batch = tuple(torch.as_tensor(inputs.get("advantages", 0.0)).shape), tokens.logps.shape[0]
        if shape != (batch,):
            raise ValueError(f"{self.where} takes one advantage per sequence, shape [{batch}]; got {shape}. A "
                             f"sequence has one importance ratio, so per-token advantages do not apply: use 'ppo' "
                             f"for those")
        advantages = torch.as_tensor(inputs["advantages"]).to(device=tokens.logps.device, dtype=tokens.logps.dtype)
        ratio = torch.exp(tokens.sequence_mean(tokens.log_ratio))
        loss_seq, is_clipped = clipped_surrogate(ratio, advantages, self.epsilon_low, self.epsilon_high)
        if tokens.kl is not None and self.beta != 0.0:
            loss_seq = loss_seq + self.beta * tokens.sequence_mean(tokens.kl)
        sequences = tokens.sequences()
        return LossOutput(loss=(loss_seq * sequences).sum() * tokens.share, num_tokens=sequences.sum() * tokens.share,
                          metrics=self.metrics(tokens, ratio, is_clipped, sequences))


__all__ = ["DAPOLoss", "DrGRPOLoss", "GRPOLoss", "GSPOLoss", "PPOLoss"]
