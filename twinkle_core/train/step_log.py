"""What the loop reports as it trains: the per-step log line (loss, learning rate, gradient norm,
tokens/s, then the task's headline metrics, ``Task.console_keys``), evaluation results on the console (the
evaluation before training too), the per-source row counts of a mixture of several ``data.train`` sources, the
progress bar, and the start-up timing of the first step.

:class:`StepReporter` does it for one :class:`~twinkle_core.train.build.TrainingRun`; the lines themselves are
written by :class:`twinkle_core.train.logging.TrainLogger`. :class:`StepWindow` gathers what the steps between
two log lines did.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.train.build import TrainingRun
from twinkle_core.train.logging import StartupTimer, TrainLogger
from twinkle_core.train.progress import progress_bar, progress_enabled

logger = logging.getLogger("twinkle.train")


def rounded(value: Any, digits: int = 6) -> Any:
    """A finite float to ``digits`` significant digits (for log lines); anything else unchanged."""
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    return value


@dataclass
class StepWindow:
    """The sums of the micro-batches since the last log line, and the time they took."""

    loss: float = 0.0
    tokens: float = 0.0
    input_tokens: float = 0.0
    #: making batches (data; for an RL task also sampling and rewards)
    batch_time: float = 0.0
    #: evaluating and saving: not training time for tokens/s
    paused: float = 0.0
    started: float = field(default_factory=time.time)


def format_metric(value: Any) -> Any:
    """A metric for a sentence: two decimals in ``[0.01, 1000)`` (``0.25``, ``5.43``), else four significant
    digits (``1.2e-05``); anything not a finite float unchanged."""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.2f}" if value == 0 or 0.01 <= abs(value) < 1000 else f"{value:.4g}"
    return value


def startup_report(timer: StartupTimer, first_step: tuple[float, float], *, is_main: bool) -> dict[str, Any]:
    """Where the time up to the end of the first optimizer step of this run went (``summary["startup"]``);
    ``first_step`` is ``(perf_counter, process_time)`` when that step began."""
    timer.add("first_step", time.perf_counter() - first_step[0], time.process_time() - first_step[1])
    report = timer.report()
    if is_main:
        logger.debug("start-up (s): %s", timer.format(report))
    return report


class StepReporter:
    """The log lines, trackers and progress bar of ``run``, from step ``step`` on. Opening it starts the recipe's
    trackers (``train.report_to``): one that cannot start raises here, before any step."""

    def __init__(self, run: TrainingRun, *, step: int, is_main: bool, started: float) -> None:
        self.run = run
        self.is_main = is_main
        self.started = started
        self.show_bar = progress_enabled(is_main)
        self.log = TrainLogger.for_recipe(run.recipe, enabled=is_main)
        self.bar = progress_bar(run.total_steps, step, enabled=self.show_bar)

    def log_step(self, step: int, epoch: int, window: StepWindow, grad_norm: Any) -> dict[str, Any]:
        """The ``train`` log line of ``step``: the model's and the task's metrics over ``window``."""
        run = self.run
        metrics = dict(run.model.calculate_metric(adapter_name=run.adapter_name, reset=True))
        metrics.update(run.task.step_metrics())  # every rank calls it: a task may reduce over ranks inside
        loss = metrics.pop("loss", None)
        if loss is None and window.tokens:
            loss = window.loss / window.tokens
        now = time.time()
        interval = max(now - window.started - window.paused, 1e-9)
        values: dict[str, Any] = {
            "epoch": epoch,
            "loss": rounded(float(loss)) if loss is not None else None,
            "lr": run.model.get_train_configs(adapter_name=run.adapter_name)["lr"],
            "grad_norm": rounded(float(grad_norm)) if grad_norm is not None else None,
            "tokens_per_s": round(window.input_tokens * run.data_parallel.size / interval, 1),
            # the same tokens over the time the model computed: without making batches (an RL task's sampling)
            "batch_time_s": round(window.batch_time, 3),
            "train_tokens_per_s": round(window.input_tokens * run.data_parallel.size / max(interval - window.batch_time, 1e-9),
                                        1),
            "elapsed_s": round(now - self.started, 3),
        }
        metrics.pop("lr", None)  # logged once, from the train-configs schema above
        values.update({k: rounded(v) if isinstance(v, float) else v for k, v in metrics.items()})
        record = self.log.log("train", step, values)
        if self.is_main:
            self._show(step, values)
        return record

    def headline(self, values: dict[str, Any]) -> dict[str, Any]:
        """The task's headline metrics (``Task.console_keys``) among ``values``: the numbers the step line and the
        progress bar show after the loss, in the order the task names them."""
        return {key: rounded(values[key], 4) for key in self.run.task.console_keys
                if isinstance(values.get(key), (int, float)) and not isinstance(values.get(key), bool)}

    def _show(self, step: int, values: dict[str, Any]) -> None:
        headline = self.headline(values)
        if self.show_bar:
            self.bar.set_postfix({"loss": values["loss"], "lr": values["lr"], **headline}, refresh=False)
            return
        lr, grad_norm = values["lr"], values["grad_norm"]
        extra = "".join(f" {key} {value}" for key, value in headline.items())
        logger.info("step %d/%d loss %s lr %s grad_norm %s tokens/s %s%s", step, self.run.total_steps, values["loss"],
                    rounded(lr, 3) if lr is not None else None, rounded(grad_norm, 4) if grad_norm is not None else None,
                    values["tokens_per_s"], extra)

    def log_eval(self, step: int, metrics: dict[str, float], *, before_training: bool = False) -> dict[str, float]:
        """The ``eval`` log line of ``step`` and its console line (main process): ``step 20/100 eval: ...``, or
        ``eval before training: exact_match 0.00, loss 5.43`` for the evaluation before the first step."""
        if self.is_main:
            if before_training:
                text = ", ".join(f"{k.removeprefix('eval_')} {format_metric(v)}" for k, v in metrics.items())
                logger.info("eval before training: %s", text or "no metrics")
            else:
                text = " ".join(f"{k} {rounded(v, 4)}" for k, v in metrics.items())
                logger.info("step %d/%d eval: %s", step, self.run.total_steps, text)
        self.log.log("eval", step, metrics)
        return metrics

    def log_mixture(self) -> dict[str, Any] | None:
        """When ``data.train`` lists several sources (and is not streamed): log their row counts in the mixture
        once (``data: 3 sources, 1,200 rows: a.jsonl 800 (weight 2), ...``) and write them to ``logs.jsonl`` as a
        ``data`` line (``{"event": "data", "step": 0, "mixture": {...}}``); returns them for the run's summary.
        Main process only (other ranks: None)."""
        data = self.run.recipe.data
        if not self.is_main or data.streaming or not isinstance(data.train, (list, tuple)) or len(data.train) < 2:
            return None
        from twinkle_core.data.mixing import count_mixture

        counts = count_mixture(data.train)
        logger.info("data: %s", counts.describe())
        summary = counts.as_dict()
        self.log.log("data", 0, {"mixture": summary})  # nested: no top-level value for plots to pick up
        return summary

    def failed(self, exc: BaseException) -> None:
        """Training stopped on ``exc``: the bar goes, the trackers finish the run as failed / interrupted."""
        self.bar.close()
        self.log.failed(exc)

    def close(self) -> None:
        self.bar.close()
        self.log.close()
