"""PPO's clipped value loss (``"ppo_value"``) for a per-token critic.

The critic is a token-classification network with one output per position: ``outputs["values"]`` ``[B, T]``
when the model provides it, else ``outputs["logits"][..., 0]`` of its ``[B, T, 1]`` logits.

Alignment. The critic's output at position ``t`` has read tokens ``0 .. t``: it is ``V(s_t)``, the value of
the state in which label token ``t + 1`` is generated, the same position whose logits predict that token in
the policy. So the loss reads ``values[:, :-1]`` (``[B, T - 1]``), and ``returns`` / ``old_values`` use the
shifted layout of the policy losses' ``old_logps``: entry ``[:, t]`` is the return of (the value before)
label token ``t + 1``. ``[B, T]`` tensors aligned with ``labels`` are accepted too (entry ``[:, t + 1]``
belongs to label ``t + 1``; the first column is dropped). Only positions with a label count.

Loss per token, with ``eps_v = clip_range_value`` (the value clipping is not in the PPO paper, Schulman et
al. 2017; it comes from OpenAI baselines' ppo2 and is the form TRL's PPO trainer uses)::

    l_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, V_old_t - eps_v, V_old_t + eps_v) - R_t)^2)

summed over label tokens, ``num_tokens`` = label tokens. ``clip_range_value=None`` trains on the plain
``0.5 (V - R)^2``. Without ``old_values`` the detached current values stand in (the first epoch on a
rollout, where they coincide).

Metrics: ``value_clip_fraction`` (share of tokens where the clipped branch is strictly larger, so the
token gets no gradient when ``V`` lies outside the trust region), ``value_mean`` and
``explained_variance`` ``1 - Var(R - V) / Var(R)`` (over this micro-batch's tokens; absent when ``Var(R)``
is 0 or there are fewer than two tokens).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.loss.base import Loss, LossContext, LossOutput
from twinkle_core.loss.helpers import align_to_shifted, require, scalar
from twinkle_core.loss.logprobs import acc_dtype
from twinkle_rl.checks import optional_finite_number


class PPOValueLoss(Loss):
    """``0.5 * max((V - R)^2, (clip(V, V_old +- clip_range_value) - R)^2)`` per label token; see the module."""

    name: ClassVar[str] = "ppo_value"

    def __init__(self, clip_range_value: float | None = 0.2, ignore_index: int = IGNORE_INDEX) -> None:
        # None (not inf) turns the clipping off
        self.clip_range_value = optional_finite_number("ppo_value loss: clip_range_value (None: no clipping)",
                                                       clip_range_value, low=0.0, low_open=True)
        self.ignore_index = ignore_index

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        if inputs.get("labels") is None or (context is not None and context.sp_size > 1):
            # returns / old_values are aligned with whole rows; a sequence-parallel slice is not
            raise ValueError(f"{self.where} needs inputs['labels'] of whole sequences and does not support sequence "
                             f"parallelism; train the critic with mesh.sp=1")
        values = self.critic_values(outputs)
        labels = torch.as_tensor(inputs["labels"]).to(values.device)
        if labels.shape != values.shape:
            raise ValueError(f"{self.where}: values have shape {tuple(values.shape)}, labels {tuple(labels.shape)}")
        predicted = values[:, :-1].to(acc_dtype(values.dtype))  # V(s_t) for label t + 1
        mask = labels[:, 1:] != self.ignore_index
        zeros = torch.zeros_like(predicted)
        returns = torch.where(mask, self.token_input(inputs, "returns", predicted), zeros)
        predicted = torch.where(mask, predicted, zeros)
        unclipped = (predicted - returns) ** 2
        if self.clip_range_value is None:
            loss_t, is_clipped = unclipped, torch.zeros_like(mask)
        else:
            old = (self.token_input(inputs, "old_values", predicted) if inputs.get("old_values") is not None
                   else predicted.detach())
            old = torch.where(mask, old, zeros)
            clipped_values = torch.clamp(predicted, old - self.clip_range_value, old + self.clip_range_value)
            clipped = (clipped_values - returns) ** 2
            loss_t = torch.max(unclipped, clipped)
            is_clipped = clipped > unclipped
        weights = mask.to(predicted.dtype)
        loss = 0.5 * (loss_t * weights).sum()
        return LossOutput(loss=loss, num_tokens=weights.sum(),
                          metrics=self.metrics(predicted, returns, is_clipped, weights))

    def critic_values(self, outputs: dict[str, Any]) -> torch.Tensor:
        """``[B, T]``: ``outputs["values"]``, or the single label of a token-classification head's logits."""
        values = outputs.get("values")
        if values is None:
            logits = require(outputs, "logits", self.where, "outputs")
            if logits.dim() != 3 or logits.shape[-1] != 1:
                raise ValueError(f"{self.where} reads a critic with one output per token (logits [B, T, 1] or "
                                 f"outputs['values'] [B, T]); got logits of shape {tuple(logits.shape)}")
            values = logits[..., 0]
        if values.dim() != 2:
            raise ValueError(f"{self.where}: values must be [B, T], got shape {tuple(values.shape)}")
        return values

    def token_input(self, inputs: dict[str, Any], key: str, like: torch.Tensor) -> torch.Tensor:
        value = torch.as_tensor(require(inputs, key, self.where, "inputs")).to(like.device)
        return align_to_shifted(value, like.shape[0], like.shape[1], key).to(like.dtype)

    @staticmethod
    def metrics(values: torch.Tensor, returns: torch.Tensor, is_clipped: torch.Tensor,
                weights: torch.Tensor) -> dict[str, float]:
        with torch.no_grad():
            count = weights.sum()
            n = count.clamp(min=1)
            metrics = {
                "value_clip_fraction": scalar((is_clipped.to(weights.dtype) * weights).sum() / n),
                "value_mean": scalar((values * weights).sum() / n),
            }
            if count > 1:
                return_var = _masked_variance(returns, weights)
                if return_var > 0:
                    metrics["explained_variance"] = scalar(1 - _masked_variance(returns - values, weights) / return_var)
        return metrics


def _masked_variance(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Population variance of the weighted-in entries (masked entries of ``x`` are 0 and weigh 0)."""
    n = weights.sum()
    mean = (x * weights).sum() / n
    return (((x - mean) ** 2) * weights).sum() / n


__all__ = ["PPOValueLoss"]
