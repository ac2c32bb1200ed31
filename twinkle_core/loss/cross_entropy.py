"""Next-token cross entropy: plain and chunked (bounded memory for large vocabularies)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import Loss, LossContext, LossOutput, vocab_shard_of
from twinkle_core.loss.fused_head import linear_cross_entropy
from twinkle_core.loss.helpers import check_reduction
from twinkle_core.loss.logprobs import (
    DEFAULT_CHUNK_SIZE,
    acc_dtype,
    label_logprobs,
    next_token_labels,
)
from twinkle_core.loss.vocab_parallel import refuse_vocab_shard

#: vocabularies from this size on get the fused LM head by default (``lm_head="auto"``): there the logits
#: dominate a step's memory (Mistral's 32,768 and up; Qwen's 151,936 at 2,048 tokens are 1.2 GB in float32)
FUSED_HEAD_MIN_VOCAB = 32_768
LM_HEAD_MODES = ("auto", "fused", "logits")


def _finish(total: torch.Tensor, count: torch.Tensor, reduction: str) -> LossOutput:
    if reduction == "mean":
        return LossOutput(loss=total / count.clamp(min=1), num_tokens=1, metrics={"tokens": float(count)})
    return LossOutput(loss=total, num_tokens=count)


class CrossEntropyLoss(Loss):
    """Token-level cross entropy of the shifted labels (or of ``inputs["shift_labels"]`` when present).

    ``loss`` is the sum over non-ignored tokens and ``num_tokens`` their count (``reduction="sum"``,
    the default, which keeps gradient accumulation exact); ``reduction="mean"`` returns the mean
    with ``num_tokens=1``. ``label_smoothing`` follows :func:`torch.nn.functional.cross_entropy`:
    ``(1 - eps) * nll + eps * mean_v(-log p(v))``.

    The logits are upcast to float32 (a full copy when they are bf16/fp16; float64 stays float64); use
    :class:`ChunkedCrossEntropyLoss` when that ``[N, V]`` copy does not fit.

    ``lm_head``: ``auto`` (the default) lets ``forward_backward`` hand over the final hidden states and the LM
    head's weight instead of logits when the vocabulary has at least ``FUSED_HEAD_MIN_VOCAB`` entries, and the
    loss applies the head chunk by chunk (:mod:`twinkle_core.loss.fused_head`: the ``[N, V]`` logits never
    exist, same value and gradients); ``fused`` does so at any vocabulary size; ``logits`` never.

    With ``context.vocab_shard`` (a tensor-parallel head's vocabulary slice, see
    :mod:`twinkle_core.loss.vocab_parallel`) the logits are this rank's slice and the loss is the chunked one
    taken across the tensor-parallel group: same value and gradients, no rank holds ``[N, V]``.
    """

    name: ClassVar[str] = "cross_entropy"

    def __init__(self, ignore_index: int = IGNORE_INDEX, reduction: str = "sum", label_smoothing: float = 0.0,
                 lm_head: str = "auto") -> None:
        self.ignore_index = ignore_index
        self.reduction = check_reduction(reduction)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        self.label_smoothing = label_smoothing
        if lm_head not in LM_HEAD_MODES:
            raise ConfigError(f"lm_head={lm_head!r} is not one of {', '.join(LM_HEAD_MODES)}")
        self.lm_head = lm_head

    def fuses_lm_head(self, vocab_size: int) -> bool:
        return self.lm_head == "fused" or (self.lm_head == "auto" and vocab_size >= FUSED_HEAD_MIN_VOCAB)

    def _chunked_loss(self, logits: torch.Tensor, inputs: dict[str, Any], shard: Any, chunk_size: int) -> LossOutput:
        """The chunked loss; with a ``shard``, from this rank's vocabulary slice (collective over its group)."""
        labels = next_token_labels(inputs, self.ignore_index, logits.device)
        label_lp, mean_lp = label_logprobs(logits, labels, self.ignore_index, chunk_size, vocab_shard=shard)
        eps = self.label_smoothing
        total = -label_lp.sum() if eps == 0.0 else -(1.0 - eps) * label_lp.sum() - eps * mean_lp.sum()
        return _finish(total, (labels != self.ignore_index).sum(), self.reduction)

    def _fused(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> LossOutput:
        hidden = outputs["hidden_states"]
        if isinstance(hidden, (tuple, list)):
            hidden = hidden[-1]
        labels = next_token_labels(inputs, self.ignore_index, hidden.device)
        total = linear_cross_entropy(hidden, outputs["lm_head_weight"], labels, outputs.get("lm_head_bias"),
                                     ignore_index=self.ignore_index, label_smoothing=self.label_smoothing)
        return _finish(total, (labels != self.ignore_index).sum(), self.reduction)

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        if outputs.get("logits") is None and outputs.get("lm_head_weight") is not None:
            # the fused head applies a whole [V, H] weight; no backend hands it a vocabulary slice of one
            refuse_vocab_shard(vocab_shard_of(context), self.where, "applies a whole LM head weight (lm_head='fused')")
            return self._fused(outputs, inputs)
        logits = outputs["logits"]
        if vocab_shard_of(context) is not None:
            return self._chunked_loss(logits, inputs, context.vocab_shard, DEFAULT_CHUNK_SIZE)
        labels = next_token_labels(inputs, self.ignore_index, logits.device).reshape(-1)
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).to(acc_dtype(logits.dtype)),
            labels,
            ignore_index=self.ignore_index,
            reduction="sum",
            label_smoothing=self.label_smoothing,
        )
        return _finish(total, (labels != self.ignore_index).sum(), self.reduction)


class ChunkedCrossEntropyLoss(CrossEntropyLoss):
    """Cross entropy with the same value and gradients as :class:`CrossEntropyLoss`, bounded memory.

    Approach (see :mod:`twinkle_core.loss.logprobs`): a custom autograd function walks the labelled
    tokens ``chunk_size`` at a time. Forward upcasts one chunk of logits to float32 and keeps only its
    per-token log-sum-exp; backward recomputes that chunk's softmax and writes
    ``softmax - (1 - eps) * onehot - eps / V`` straight into the logits gradient. The extra memory is
    one ``[chunk_size, V]`` float32 chunk (plus a few of its temporaries) and ``O(N)`` scalars, instead
    of the full ``[N, V]`` float32 upcast and log-softmax; ignored tokens cost nothing.

    If ``outputs`` has no ``"logits"`` but has ``"hidden_states"`` (``[B, T, H]``, the final,
    post-norm hidden states; for a tuple the last element is used) and ``"lm_head_weight"``
    (``[V, H]``, optional ``"lm_head_bias"``), the LM head is applied chunk by chunk
    (:func:`~twinkle_core.loss.fused_head.linear_cross_entropy`), so the ``[N, V]`` logits are never
    materialised at all; ``lm_head`` is as for :class:`CrossEntropyLoss`.
    """

    name: ClassVar[str] = "chunked_cross_entropy"

    def __init__(
        self,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        ignore_index: int = IGNORE_INDEX,
        reduction: str = "sum",
        label_smoothing: float = 0.0,
        lm_head: str = "auto",
    ) -> None:
        super().__init__(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                         lm_head=lm_head)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        logits = outputs.get("logits")
        if logits is None:
            if outputs.get("hidden_states") is None or outputs.get("lm_head_weight") is None:
                raise KeyError(
                    "ChunkedCrossEntropyLoss needs outputs['logits'], or outputs['hidden_states'] "
                    "with outputs['lm_head_weight']"
                )
            refuse_vocab_shard(vocab_shard_of(context), self.where, "applies a whole LM head weight (lm_head='fused')")
            return self._fused(outputs, inputs)
        return self._chunked_loss(logits, inputs, vocab_shard_of(context), self.chunk_size)
