"""Evaluation during and after training: the held-out loss (and perplexity) summed over every rank, and
the task's own evaluation (``Task.evaluate``, e.g. generation-based) with ``train.evaluate_options``.

:class:`EvaluationMixin` is that part of :class:`twinkle_core.train.loop.Trainer`.
"""

from __future__ import annotations

import math
from typing import Any

from twinkle_core.metrics import LossMetric
from twinkle_core.train.batch_stats import _loss_and_tokens


class EvaluationMixin:
    """:meth:`evaluate`; the trainer supplies the built model, task, tokenizer, ``eval_dataset``,
    ``_make_loader`` and ``_global_sum`` (the reduction over ranks)."""

    def evaluate(self) -> dict[str, float]:
        r = self.recipe
        model, name = self.model, self.adapter_name
        metrics: dict[str, float] = {}
        if self.eval_dataset is not None and self.task.has_eval_loss:
            loss_sum = tokens = 0.0
            loss_metrics = LossMetric()  # the loss's own metrics (DPO rewards ...), weighted like the loss
            for batch in self._make_loader(self.eval_dataset, shuffle=False):
                batch = self.task.prepare_batch(model, batch)
                outputs = model.forward_only(inputs=batch, adapter_name=name)
                result = model.calculate_loss(inputs=batch, outputs=outputs, adapter_name=name)
                batch_loss, batch_tokens = _loss_and_tokens(result)
                loss_sum += batch_loss
                tokens += batch_tokens
                if hasattr(result, "metrics"):
                    loss_metrics.update(batch, outputs, result)
            names = sorted(loss_metrics.metric_sums)
            loss_sum, tokens, *sums = self._global_sum(loss_sum, tokens, *(loss_metrics.metric_sums[n] for n in names))
            metrics["eval_loss"] = loss_sum / tokens if tokens else float("nan")
            for key, value in zip(names, sums, strict=True):
                metrics[f"eval_{key}"] = value / tokens if tokens else float("nan")
            if tokens and math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] < 50:
                metrics["eval_ppl"] = math.exp(metrics["eval_loss"])
        extra: dict[str, Any] = {}
        # generation-based evaluation reads the held-out set: without data.eval there is nothing to evaluate
        if self.eval_dataset is not None and (r.train.evaluate_options is not None or not self.task.has_eval_loss):
            options = r.train.evaluate_options or {}
            extra = self.task.evaluate(model, self.eval_dataset, self.tokenizer, **options) or {}
        for key, value in extra.items():
            metrics[key if key.startswith("eval_") else f"eval_{key}"] = value
        # evaluation forwards must not leak into the training metrics
        model.calculate_metric(adapter_name=name, reset=True)
        return metrics
