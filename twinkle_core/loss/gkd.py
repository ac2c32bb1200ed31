"""Generalised knowledge distillation: generalised Jensen-Shannon divergence to a teacher."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.loss.base import Loss, LossContext, LossOutput, vocab_shard_of
from twinkle_core.loss.helpers import require, scalar
from twinkle_core.loss.logprobs import acc_dtype, next_token_labels
from twinkle_core.loss.vocab_parallel import refuse_vocab_shard


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` over the last dimension, from log-probabilities; ``0 * log 0`` counts as 0."""
    p = torch.exp(log_p)
    # Mask the log-ratio, not the product, so no 0 * inf reaches the backward pass either.
    gap = torch.where(p > 0, log_p - log_q, torch.zeros_like(log_p))
    return (p * gap).sum(-1)


class GKDLoss(Loss):
    """Generalised JSD between the student and ``inputs["teacher_logits"]`` on label positions.

    Following GKD (Agarwal et al., 2024, eq. 1) and TRL's ``GKDTrainer.generalized_jsd_loss``, with
    ``S``/``T`` the temperature-scaled student/teacher next-token distributions and
    ``M = beta * T + (1 - beta) * S``::

        JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)

    and the two ends taken as TRL does (the formula itself goes to 0 there):
    ``beta = 0`` is the **forward** KL ``KL(T || S)`` and ``beta = 1`` the **reverse** KL
    ``KL(S || T)``. Like TRL, the result is not rescaled by ``temperature ** 2``.

    ``teacher_logits`` is ``[B, T, V]`` aligned with the student's logits; positions are those whose
    shifted label is not ``ignore_index`` (``logits[:, t]`` with ``labels[:, t + 1]``). The teacher
    gets no gradient. Returns the sum over those tokens with ``num_tokens`` = their count. The
    divergence is computed in (at least) float32, ``chunk_size`` tokens at a time.
    """

    name: ClassVar[str] = "gkd"
    #: the teacher's logits come with the batch: a task that produces them (``Task.provides``) is needed
    requires: ClassVar[frozenset[str]] = frozenset({"teacher_logits"})

    def __init__(
        self, beta: float = 0.5, temperature: float = 1.0, ignore_index: int = IGNORE_INDEX, chunk_size: int = 1024
    ) -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.beta = beta
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size

    def _divergence(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        log_s = torch.log_softmax(student.to(acc_dtype(student.dtype)) / self.temperature, dim=-1)
        log_t = torch.log_softmax(teacher.to(acc_dtype(student.dtype)) / self.temperature, dim=-1)
        if self.beta == 0.0:
            return _kl(log_t, log_s)
        if self.beta == 1.0:
            return _kl(log_s, log_t)
        log_m = torch.logsumexp(
            torch.stack([log_t + math.log(self.beta), log_s + math.log(1.0 - self.beta)]), dim=0
        )
        return self.beta * _kl(log_t, log_m) + (1.0 - self.beta) * _kl(log_s, log_m)

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        refuse_vocab_shard(vocab_shard_of(context), self.where, "compares whole next-token distributions with the "
                           "teacher's")
        logits = outputs["logits"]
        teacher = require(inputs, "teacher_logits", "GKDLoss", "inputs").to(logits.device).detach()
        if teacher.shape != logits.shape:
            raise ValueError(f"teacher_logits {tuple(teacher.shape)} must match logits {tuple(logits.shape)}")
        vocab = logits.shape[-1]
        labels = next_token_labels(inputs, self.ignore_index, logits.device).reshape(-1)
        rows = (labels != self.ignore_index).nonzero(as_tuple=True)[0]
        flat_s, flat_t = logits.reshape(-1, vocab), teacher.reshape(-1, vocab)
        total = logits.new_zeros((), dtype=acc_dtype(logits.dtype))
        for start in range(0, rows.numel(), self.chunk_size):
            idx = rows[start : start + self.chunk_size]
            total = total + self._divergence(flat_s.index_select(0, idx), flat_t.index_select(0, idx)).sum()
        count = rows.numel()
        metrics = {"divergence_mean": scalar(total / max(count, 1))}
        return LossOutput(loss=total, num_tokens=count, metrics=metrics)
