"""Training metrics accumulated over micro-batches and reduced over data-parallel ranks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from twinkle_core.constants import IGNORE_INDEX


class Metric(ABC):
    """Accumulates sums during micro-batches; ``compute`` turns the (globally summed) totals into values.

    ``totals()`` returns named float sums so the model can all-reduce them in one go.
    """

    name: ClassVar[str] = ""
    #: whether ``update`` reads ``outputs["logits"]``; only then does ``forward_backward`` compute full logits
    #: for a loss that could apply the LM head itself (``Loss.fuses_lm_head``)
    reads_logits: ClassVar[bool] = True

    def __init__(self) -> None:
        self.reset()

    @abstractmethod
    def update(self, inputs: dict[str, Any], outputs: dict[str, Any], loss_output: Any) -> None: ...

    @abstractmethod
    def totals(self) -> dict[str, float]: ...

    @abstractmethod
    def compute(self, totals: dict[str, float]) -> dict[str, float]: ...

    @abstractmethod
    def reset(self) -> None: ...


class LossMetric(Metric):
    """Token-weighted mean loss over everything since the last reset, and the loss's own metrics.

    A loss may report metrics of its micro-batch (``LossOutput.metrics``: DPO's ``rewards/accuracies``,
    GRPO's clip fraction ...) as means over its ``num_tokens`` units; they are averaged the same way as
    the loss, weighted by ``num_tokens``, over every micro-batch and rank since the last reset. Every rank
    runs the same loss, so every rank reports the same names (the model sums the totals in one all-reduce).
    """

    name = "loss"
    reads_logits = False
    _PREFIX = "loss_metric:"

    def reset(self) -> None:
        self.loss_sum = 0.0
        self.tokens = 0.0
        self.metric_sums: dict[str, float] = {}

    def update(self, inputs: dict[str, Any], outputs: dict[str, Any], loss_output: Any) -> None:
        if loss_output is not None:
            self.loss_sum += float(loss_output.loss.detach())
            weight = float(loss_output.num_tokens)
            self.tokens += weight
            for key, value in (getattr(loss_output, "metrics", None) or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.metric_sums[key] = self.metric_sums.get(key, 0.0) + float(value) * weight

    def totals(self) -> dict[str, float]:
        return {"loss_sum": self.loss_sum, "tokens": self.tokens,
                **{self._PREFIX + key: value for key, value in sorted(self.metric_sums.items())}}

    def compute(self, totals: dict[str, float]) -> dict[str, float]:
        tokens = totals["tokens"]
        result = {"loss": totals["loss_sum"] / tokens if tokens else float("nan"), "tokens": tokens}
        for key, value in totals.items():
            if key.startswith(self._PREFIX):
                result[key[len(self._PREFIX):]] = value / tokens if tokens else float("nan")
        return result


class TokenAccuracy(Metric):
    """Share of label tokens (``labels != -100``) that the argmax of the shifted logits predicts.

    Given a loss context with a ``vocab_shard`` (tensor-parallel logits, one vocabulary slice per rank), the
    argmax is taken across the ranks (:func:`~twinkle_core.loss.vocab_parallel.vocab_parallel_argmax`)."""

    name = "accuracy"

    def reset(self) -> None:
        self.correct = 0.0
        self.total = 0.0

    def update(self, inputs: dict[str, Any], outputs: dict[str, Any], loss_output: Any, context: Any = None) -> None:
        logits = outputs.get("logits")
        if logits is None or (inputs.get("labels") is None and inputs.get("shift_labels") is None):
            return
        from twinkle_core.loss.logprobs import next_token_labels
        from twinkle_core.loss.vocab_parallel import vocab_parallel_argmax

        shard = getattr(context, "vocab_shard", None)  # logits of this rank's vocabulary slice: argmax across ranks
        predicted = logits.argmax(-1) if shard is None else vocab_parallel_argmax(logits, shard)
        target = next_token_labels(inputs, IGNORE_INDEX, predicted.device)
        mask = target != IGNORE_INDEX
        self.correct += float((predicted.eq(target) & mask).sum())
        self.total += float(mask.sum())

    def totals(self) -> dict[str, float]:
        return {"correct": self.correct, "total": self.total}

    def compute(self, totals: dict[str, float]) -> dict[str, float]:
        return {"accuracy": totals["correct"] / totals["total"] if totals["total"] else float("nan")}
