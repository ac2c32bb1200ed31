"""Evaluation during and after training: the held-out loss (and perplexity) summed over every rank, and
the task's own evaluation (``Task.evaluate``, e.g. generation-based) with ``train.evaluate_options``.

:class:`Evaluator` does it for one :class:`~twinkle_core.train.build.TrainingRun`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from twinkle_core.metrics import LossMetric
from twinkle_core.train.batch_stats import loss_and_tokens
from twinkle_core.train.build import TrainingRun

#: sums its arguments over every rank (unchanged in a single process)
GlobalSum = Callable[..., tuple[float, ...]]


class Evaluator:
    """Evaluates the model of ``run``; ``global_sum`` reduces the held-out loss's sums over the ranks."""

    def __init__(self, run: TrainingRun, global_sum: GlobalSum) -> None:
        self.run = run
        self.global_sum = global_sum

    def evaluate(self) -> dict[str, float]:
        """``eval_loss`` / ``eval_ppl`` / the loss's own ``eval_*`` metrics, and the task's evaluation."""
        run = self.run
        metrics: dict[str, float] = {}
        if run.eval_dataset is not None and run.task.has_eval_loss:
            metrics.update(self._held_out_loss())
        # generation-based evaluation reads the held-out set: without data.eval there is nothing to evaluate
        evaluate_options = run.recipe.train.evaluate_options
        if run.eval_dataset is not None and (evaluate_options is not None or not run.task.has_eval_loss):
            extra = run.task.evaluate(run.model, run.eval_dataset, run.tokenizer, **(evaluate_options or {})) or {}
            for key, value in extra.items():
                metrics[key if key.startswith("eval_") else f"eval_{key}"] = value
        # evaluation forwards must not leak into the training metrics
        run.model.calculate_metric(adapter_name=run.adapter_name, reset=True)
        return metrics

    def _held_out_loss(self) -> dict[str, float]:
        run, name = self.run, self.run.adapter_name
        model, task = run.model, run.task
        loss_sum = tokens = 0.0
        loss_metrics = LossMetric()  # the loss's own metrics (DPO rewards ...), weighted like the loss
        for batch in run.make_loader(run.eval_dataset, shuffle=False):
            batch = task.prepare_batch(model, batch)
            outputs = model.forward_only(inputs=batch, adapter_name=name)
            result = model.calculate_loss(inputs=batch, outputs=outputs, adapter_name=name)
            batch_loss, batch_tokens = loss_and_tokens(result)
            loss_sum += batch_loss
            tokens += batch_tokens
            if hasattr(result, "metrics"):
                loss_metrics.update(batch, outputs, result)
        names = sorted(loss_metrics.metric_sums)
        loss_sum, tokens, *sums = self.global_sum(loss_sum, tokens, *(loss_metrics.metric_sums[n] for n in names))
        metrics = {"eval_loss": loss_sum / tokens if tokens else float("nan")}
        for key, value in zip(names, sums, strict=True):
            metrics[f"eval_{key}"] = value / tokens if tokens else float("nan")
        if tokens and math.isfinite(metrics["eval_loss"]) and metrics["eval_loss"] < 50:
            metrics["eval_ppl"] = math.exp(metrics["eval_loss"])
        return metrics
