"""Clipped policy-gradient losses for RL on LLMs: GRPO, DAPO and Dr. GRPO.

All three share the PPO-style per-token term, with ``r = exp(log pi - log pi_old)`` and advantage
``A``::

    l_t = -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) + beta * KL_t

where ``KL_t = exp(ref - logp) - (ref - logp) - 1`` is the k3 estimator of ``KL(pi || pi_ref)``
(Schulman's approximation, as in DeepSeekMath and TRL). They differ in how ``l_t`` is aggregated
(TRL's ``loss_type`` names, see its GRPO trainer documentation):

* :class:`GRPOLoss` (``"grpo"``): mean over each sequence's tokens, then over sequences
  (``1/G * sum_i 1/|o_i| * sum_t``). Returned as the sum of the per-sequence means with
  ``num_tokens`` = number of sequences.
* :class:`DAPOLoss` (``"dapo"``): token level, ``1/sum_i |o_i| * sum_i sum_t``, with DAPO's decoupled
  clip range (``eps_low=0.2``, ``eps_high=0.28``). Returned as the token sum with ``num_tokens`` =
  number of tokens.
* :class:`DrGRPOLoss` (``"dr_grpo"``): ``1/(L * G) * sum_i sum_t`` with a constant ``L``
  (``max_completion_length``): no length normalisation. Returned as ``sum_i sum_t l / L`` with
  ``num_tokens`` = number of sequences.

The model divides the accumulated sums by the global ``num_tokens``, which makes each of these
exact across micro-batches and data-parallel ranks (for GRPO the mean over a sequence is local to
that sequence, so it needs no global count). "Sequences" are the rows with at least one label
token; fully masked rows (padding rows) are not counted.

Inputs (besides ``labels``):

* ``advantages``: ``[B]`` per sequence, or per token as ``[B, T - 1]`` (aligned with the shifted
  labels) or ``[B, T]`` (aligned with ``labels``);
* ``old_logps`` (optional): log-probabilities of the label tokens under the sampling policy,
  ``[B, T - 1]`` aligned with the shifted labels (``[B, T]`` aligned with ``labels`` also works).
  Absent: the detached current log-probabilities (on-policy, ``r = 1`` with the gradient of
  ``r``);
* ``ref_logps`` (needed when ``beta != 0``): reference-model log-probabilities, same layout.

Metrics: ``clip_fraction`` (share of label tokens where the clipped branch is active, i.e. the
token gets no gradient from the surrogate: ``r > 1 + eps_high`` with ``A > 0`` or
``r < 1 - eps_low`` with ``A < 0``), ``ratio_mean`` and, when ``ref_logps`` is given, ``kl_mean``
(mean k3 estimate over label tokens).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from twinkle_core.loss._common import align_to_shifted, require, scalar
from twinkle_core.loss.base import Loss, LossContext, LossOutput, require_whole_sequences
from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs


class _ClippedPolicyLoss(Loss):
    """Shared per-token computation; subclasses choose the aggregation in :meth:`_aggregate`."""

    def __init__(
        self,
        epsilon_low: float,
        epsilon_high: float,
        beta: float = 0.0,
        ignore_index: int = -100,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        if epsilon_low < 0 or epsilon_high < 0:
            raise ValueError(f"clip ranges must be non-negative, got {epsilon_low}, {epsilon_high}")
        if beta < 0:
            raise ValueError(f"beta must be non-negative, got {beta}")
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.beta = beta
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size

    def _aggregate(self, per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        logits = outputs["logits"]
        require_whole_sequences(inputs, type(self).__name__, context)
        logps, mask = token_logprobs(logits, inputs["labels"], self.ignore_index, self.chunk_size)
        batch, steps = logps.shape
        where = type(self).__name__

        def per_token(key: str) -> torch.Tensor:
            value = torch.as_tensor(require(inputs, key, where, "inputs")).to(logps.device)
            return align_to_shifted(value, batch, steps, key).to(logps.dtype)

        advantages = per_token("advantages")
        old = per_token("old_logps") if inputs.get("old_logps") is not None else logps.detach()
        # Masked positions carry arbitrary values (padding): zero them before exp so nothing overflows.
        log_ratio = torch.where(mask, logps - old, torch.zeros_like(logps))
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high)
        loss_t = -torch.min(ratio * advantages, clipped * advantages)

        kl = None
        if inputs.get("ref_logps") is not None:
            ref_gap = torch.where(mask, per_token("ref_logps") - logps, torch.zeros_like(logps))
            kl = torch.exp(ref_gap) - ref_gap - 1.0
            if self.beta != 0.0:
                loss_t = loss_t + self.beta * kl
        elif self.beta != 0.0:
            raise KeyError(f"{where} with beta={self.beta} needs inputs['ref_logps']")

        maskf = mask.to(loss_t.dtype)
        loss, num = self._aggregate(loss_t * maskf, maskf)

        with torch.no_grad():
            n_tok = maskf.sum().clamp(min=1)
            is_clipped = ((ratio > 1.0 + self.epsilon_high) & (advantages > 0)) | (
                (ratio < 1.0 - self.epsilon_low) & (advantages < 0)
            )
            metrics = {
                "clip_fraction": scalar((is_clipped.to(maskf.dtype) * maskf).sum() / n_tok),
                "ratio_mean": scalar((ratio * maskf).sum() / n_tok),
            }
            if kl is not None:
                metrics["kl_mean"] = scalar((kl * maskf).sum() / n_tok)
        return LossOutput(loss=loss, num_tokens=num, metrics=metrics)


def _sequences(maskf: torch.Tensor) -> torch.Tensor:
    return (maskf.sum(-1) > 0).sum()


class GRPOLoss(_ClippedPolicyLoss):
    """GRPO (DeepSeekMath): per-sequence token mean, summed over sequences; ``num_tokens`` = sequences.

    ``epsilon`` is the symmetric clip range; pass ``epsilon_high`` for an asymmetric one.
    """

    name: ClassVar[str] = "grpo"

    def __init__(
        self,
        epsilon: float = 0.2,
        beta: float = 0.0,
        epsilon_high: float | None = None,
        ignore_index: int = -100,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__(epsilon, epsilon if epsilon_high is None else epsilon_high, beta, ignore_index, chunk_size)

    def _aggregate(self, per_token: torch.Tensor, maskf: torch.Tensor) -> tuple[torch.Tensor, Any]:
        per_seq = per_token.sum(-1) / maskf.sum(-1).clamp(min=1)
        return per_seq.sum(), _sequences(maskf)


class DAPOLoss(_ClippedPolicyLoss):
    """DAPO: decoupled clip ``[1 - epsilon_low, 1 + epsilon_high]``, token-level aggregation.

    Returns the sum over all label tokens with ``num_tokens`` = number of label tokens.
    """

    name: ClassVar[str] = "dapo"

    def __init__(
        self,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.28,
        beta: float = 0.0,
        ignore_index: int = -100,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__(epsilon_low, epsilon_high, beta, ignore_index, chunk_size)

    def _aggregate(self, per_token: torch.Tensor, maskf: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return per_token.sum(), maskf.sum()


class DrGRPOLoss(_ClippedPolicyLoss):
    """Dr. GRPO: token sum divided by the constant ``max_completion_length`` per sequence.

    Returns ``sum_i sum_t l / max_completion_length`` with ``num_tokens`` = number of sequences, so
    the final loss is ``1 / (L * G) * sum_i sum_t l`` with no per-sequence length normalisation.
    Set ``max_completion_length`` to the generation limit; ``None`` falls back to the batch's
    shifted length ``T - 1``, which is only a constant when every micro-batch is padded alike.
    """

    name: ClassVar[str] = "dr_grpo"

    def __init__(
        self,
        epsilon: float = 0.2,
        max_completion_length: int | None = None,
        beta: float = 0.0,
        epsilon_high: float | None = None,
        ignore_index: int = -100,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        super().__init__(epsilon, epsilon if epsilon_high is None else epsilon_high, beta, ignore_index, chunk_size)
        if max_completion_length is not None and max_completion_length < 1:
            raise ValueError(f"max_completion_length must be positive, got {max_completion_length}")
        self.max_completion_length = max_completion_length

    def _aggregate(self, per_token: torch.Tensor, maskf: torch.Tensor) -> tuple[torch.Tensor, Any]:
        length = self.max_completion_length or per_token.shape[-1]
        return per_token.sum() / length, _sequences(maskf)
