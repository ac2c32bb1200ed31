"""What the loop reports as it trains: the per-step log line (loss, learning rate, gradient norm,
tokens/s), evaluation results on the console and the start-up timing of the first step.

:class:`StepLogMixin` is that part of :class:`twinkle_core.train.loop.Trainer`; the lines themselves are
written by :class:`twinkle_core.train.logging.TrainLogger`.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from twinkle_core.train.logging import TrainLogger

logger = logging.getLogger("twinkle.train")


def _round(value: Any, digits: int = 6) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    return value


class StepLogMixin:
    """The loop's reporting; the trainer supplies the model, task, counters, ``dp_size``, ``is_main`` and
    ``startup_timer``, and :meth:`_report_startup` sets ``startup``."""

    def _report_startup(self, first_step: tuple[float, float]) -> None:
        """Where the time up to the end of the first optimizer step of this run went (``summary["startup"]``);
        ``first_step`` is ``(perf_counter, process_time)`` when that step began."""
        timer = self.startup_timer
        timer.add("first_step", time.perf_counter() - first_step[0], time.process_time() - first_step[1])
        self.startup = timer.report()
        if self.is_main:
            logger.debug("start-up (s): %s", timer.format(self.startup))

    @staticmethod
    def _new_window() -> dict[str, float]:
        return {"loss": 0.0, "tokens": 0.0, "input_tokens": 0.0, "time": time.time(), "paused": 0.0, "batch_time": 0.0}

    def _report_eval(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.is_main:
            text = " ".join(f"{k} {_round(v, 4)}" for k, v in metrics.items())
            logger.info("step %d/%d eval: %s", self.step, self.total_steps, text)
        return metrics

    def _log_step(self, log: TrainLogger, bar: Any, window: dict[str, float], grad_norm: Any, started: float,
                  show_bar: bool) -> dict[str, Any]:
        metrics = dict(self.model.calculate_metric(adapter_name=self.adapter_name, reset=True))
        metrics.update(self.task.step_metrics())  # every rank calls it: a task may reduce over ranks inside
        loss = metrics.pop("loss", None)
        if loss is None and window["tokens"]:
            loss = window["loss"] / window["tokens"]
        now = time.time()
        interval = max(now - window["time"] - window["paused"], 1e-9)
        values: dict[str, Any] = {
            "epoch": self.epoch,
            "loss": _round(float(loss)) if loss is not None else None,
            "lr": self.model.get_train_configs(adapter_name=self.adapter_name)["lr"],
            "grad_norm": _round(float(grad_norm)) if grad_norm is not None else None,
            "tokens_per_s": round(window["input_tokens"] * (self.dp_size or 1) / interval, 1),
            # the same tokens over the time the model computed: without making batches (an RL task's sampling)
            "batch_time_s": round(window["batch_time"], 3),
            "train_tokens_per_s": round(window["input_tokens"] * (self.dp_size or 1)
                                        / max(interval - window["batch_time"], 1e-9), 1),
            "elapsed_s": round(now - started, 3),
        }
        metrics.pop("lr", None)  # logged once, from the train-configs schema above
        values.update({k: _round(v) if isinstance(v, float) else v for k, v in metrics.items()})
        record = log.log("train", self.step, values)
        if self.is_main:
            if show_bar:
                bar.set_postfix(loss=values["loss"], lr=values["lr"], refresh=False)
            else:
                logger.info("step %d/%d loss %s lr %s grad_norm %s tokens/s %s", self.step, self.total_steps,
                            values["loss"], _round(values["lr"], 3) if values["lr"] is not None else None,
                            _round(values["grad_norm"], 4) if values["grad_norm"] is not None else None,
                            values["tokens_per_s"])
        return record

