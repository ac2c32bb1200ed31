"""The training loop behind ``twinkle train``: ``train(recipe) -> summary``.

What it builds, in order: the plugin registry, the task (``task_options``), the tokenizer (the model
class's ``load_tokenizer``), the datasets (``task.load_dataset``), the model, the loss, optimizer and
scheduler, and the data loader.
Then, for every optimizer step, ``gradient_accumulation_steps`` micro-batches go through
``model.forward_backward`` and one ``model.clip_grad_and_step`` applies them. It logs to
``output_dir/logs.jsonl`` (and TensorBoard when installed), evaluates every ``eval_every`` steps
and at the end, writes ``checkpoint-N`` every ``save_every`` steps (keeping ``save_total_limit``)
and ``final`` at the end. The summary's ``startup`` (also in ``summary.json``) says where the time up to
the first optimizer step went: wall and CPU seconds per phase (:class:`twinkle_core.train.logging.StartupTimer`;
``twinkle train`` counts from the start of the process). ``resume`` (a checkpoint directory or ``latest``)
continues a run exactly: weights, optimizer, scheduler, RNG and the data loader's position come back. The optimizer
comes back as saved, so a recipe whose ``optimizer.lr`` or ``optimizer.weight_decay`` differs from the
checkpoint's is refused with a ConfigError rather than silently ignored (the model API has no way yet
to change them on a resumed optimizer and its schedule). Another world size or batch layout: see
:mod:`twinkle_core.train.resharding`. ``resume_weights_only`` loads only a checkpoint's weights and starts at step 0.

Stopping early: a first SIGINT (Ctrl+C) or SIGTERM only asks to stop; the loop finishes the current
optimizer step, saves ``checkpoint-N-interrupted`` (weights and counters of the same step) and raises
KeyboardInterrupt. With several processes the request is summed over the ranks at every step boundary,
so all of them stop at the same step even if only one got the signal. A second signal stops at once,
without saving (the state may be half-way through a step). An error mid-training also saves
``checkpoint-N-interrupted`` before it propagates (single process only: with several, the other ranks
may be blocked). Training refuses to go on, and saves nothing, after ``MAX_NONFINITE_STEPS``
consecutive steps with a non-finite loss or gradient norm (:class:`TrainingDivergedError`), or when
the first ``LABEL_CHECK_STEPS`` steps saw no label token on any rank (every label masked with
``IGNORE_INDEX``).

Model constructor convention
----------------------------
Every registered model class (``twinkle_register_models``) is constructed by the loop as::

    ModelClass(
        model_id=<local directory resolved from model.model_id, or None>,
        config=<model.config dict (a transformers config with model_type), or None>,
        strategy=<strategy.name, a registered strategy such as "single" or "ddp">,
        strategy_options=<strategy.options dict>,
        mesh=<twinkle_core.mesh.DeviceMesh built from the recipe's mesh, or None>,
        precision=<precision name: "no", "bf16", "fp16", "fp8" ...>,
        task=<the Task instance>,
        tokenizer=<the tokenizer>,
        trust_remote_code=<bool, off unless the recipe or TWINKLE_TRUST_REMOTE_CODE turns it on>,
        attn_implementation=<str or None>,
        gradient_checkpointing=<bool>,
        seed=<train.seed: the same initial weights on every rank>,
        **model.options,
    )

The constructor sets the strategy up (which joins the ``torch.distributed`` process group under
torchrun). Right after construction, before any adapter is added, the loop calls
``task.prepare_model(model)`` (backends do not call it themselves). Models
that know their data-parallel coordinates with model parallelism expose them as
``model.strategy.dp_rank`` / ``model.strategy.dp_size``; otherwise every rank of the process
group is a data-parallel rank. The logs read the learning rate from ``get_train_configs()["lr"]`` (see
:mod:`twinkle_core.model.train_configs`).

With ``model.adapter`` set, the loop calls ``add_adapter_to_model("default", adapter)`` and passes
``adapter_name="default"`` to every later call.

Where the parts live
--------------------
:class:`Trainer` is assembled from single-purpose mixins: building the components from the recipe
(:mod:`twinkle_core.train.build`), checkpoint saving and resuming (:mod:`twinkle_core.train.checkpointing`),
evaluation (:mod:`twinkle_core.train.evaluation`) and the per-step reporting
(:mod:`twinkle_core.train.step_log`). This module keeps the step loop itself and :func:`train`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

from twinkle_core import distributed
from twinkle_core.errors import ConfigError
from twinkle_core.train import resharding  # noqa: F401
from twinkle_core.train.batch_stats import _batch_tokens, _is_finite, _label_tokens, _loss_and_tokens
from twinkle_core.train.build import (  # noqa: F401 - seed_everything: resharding.reseed imports it from here
    ADAPTER_NAME,
    BuildMixin,
    seed_everything,
)
from twinkle_core.train.checkpointing import CheckpointMixin
from twinkle_core.train.evaluation import EvaluationMixin
from twinkle_core.train.guards import (  # noqa: F401 - MAX_NONFINITE_STEPS, LABEL_CHECK_STEPS: documented here
    IGNORE_INDEX,
    LABEL_CHECK_STEPS,
    MAX_NONFINITE_STEPS,
    StepGuard,
    StopSignals,
    TrainingDivergedError,
    bar_friendly_logging,
)
from twinkle_core.train.logging import StartupTimer, TrainLogger, take_startup_timer
from twinkle_core.train.progress import progress_bar, progress_enabled
from twinkle_core.train.recipe import Recipe, load_recipe, recipe_from_dict, recipe_to_dict
from twinkle_core.train.step_log import StepLogMixin

logger = logging.getLogger("twinkle.train")


# ---------------------------------------------------------------------- trainer
class Trainer(BuildMixin, CheckpointMixin, EvaluationMixin, StepLogMixin):
    """One training run. ``Trainer(recipe).run()`` is what :func:`train` does."""

    def __init__(self, recipe: Recipe, *, resume: str | None = None, resume_weights_only: str | None = None) -> None:
        self.recipe = recipe
        self.resume_spec = resume if resume is not None else recipe.train.resume
        #: ``--resume-weights-only``: a checkpoint whose weights (and adapter) start a fresh run at step 0
        self.weights_only_spec = resume_weights_only
        if self.resume_spec and resume_weights_only:
            raise ConfigError("--resume and --resume-weights-only (or train.resume) exclude each other: --resume "
                              "continues the run exactly, --resume-weights-only starts a new one from the weights")
        self.output_dir = Path(recipe.train.output_dir)
        self.adapter_name: str | None = ADAPTER_NAME if recipe.model.adapter else None
        self.step = 0
        self.epoch = 0
        self.total_steps = 0
        self.loader: Any = None
        self._iter: Any = None
        self._empty_epochs = 0
        self._boundary: dict[str, Any] = {}
        self._last_saved_step = -1
        self.guard = StepGuard(str(recipe.data.train))
        self.checkpoints: list[str] = []
        self.model: Any = None
        #: where the time before the first optimizer step went (``summary["startup"]``)
        self.startup_timer: StartupTimer = take_startup_timer()
        self.startup: dict[str, Any] | None = None

    # ------------------------------------------------------------------ data
    def _next_batch(self) -> Any:
        while True:
            if self._iter is None:
                self._iter = iter(self.loader)
            try:
                batch = next(self._iter)
            except StopIteration:
                self._iter = None
                self._empty_epochs += 1
                if self._empty_epochs > 2:
                    raise ConfigError("the training data loader yields no batches") from None
                self.epoch += 1
                self.loader.set_epoch(self.epoch)
                continue
            self._empty_epochs = 0
            return batch

    # ------------------------------------------------------------------ collectives
    @staticmethod
    def _global_sum(*values: float) -> tuple[float, ...]:
        """``values`` summed over every rank (unchanged in a single process)."""
        import torch

        from twinkle_core.accelerator import current_accelerator

        # on the accelerator's device, where its collective backend (nccl, hccl ...) can reduce it
        tensor = torch.tensor(values, dtype=torch.float64, device=current_accelerator().device())
        return tuple(float(v) for v in distributed.all_reduce_sum(tensor).cpu())

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any]:
        started = time.time()
        r, t = self.recipe, self.recipe.train
        try:
            self.build()
            with self.startup_timer.phase("setup"):
                self.is_main = distributed.is_main_process()
                if self.is_main:
                    self.output_dir.mkdir(parents=True, exist_ok=True)
                    import yaml

                    (self.output_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(r), sort_keys=False))
                resumed_from = self._resume()
                self._mark_boundary()
        except BaseException:
            if getattr(self, "task", None) is not None:
                self.task.close()  # what the task started (a PPO critic, sampler threads) also goes on a failed start
            raise

        model, name = self.model, self.adapter_name
        ga = t.gradient_accumulation_steps
        eval_enabled = self.eval_dataset is not None or t.evaluate_options is not None
        show_bar = progress_enabled(self.is_main)
        with self.startup_timer.phase("setup"):
            try:  # starts the recipe's trackers (train.report_to): one that cannot start stops the run here
                log = TrainLogger.for_recipe(r, enabled=self.is_main)
            except BaseException:
                self.task.close()
                raise
            bar = progress_bar(self.total_steps, self.step, enabled=show_bar)
        if self.is_main:
            logger.info("training %d optimizer steps (%s micro-batches per epoch per rank, %d accumulated per step)"
                        " from step %d; output in %s", self.total_steps, self.micro_batches_per_epoch, ga,
                        self.step, self.output_dir)
        eval_before = eval_after = None
        train_metrics: dict[str, Any] = {}
        final_path = None
        window = self._new_window()
        stop = StopSignals()
        try:
            with stop, bar_friendly_logging(show_bar):
                if t.eval_before_training and eval_enabled and self.step == 0:
                    with self.startup_timer.phase("eval_before"):
                        eval_before = self.evaluate()
                        log.log("eval", self.step, eval_before)
                window = self._new_window()
                first_step = time.perf_counter(), time.process_time()
                while self.step < self.total_steps:
                    step_loss, step_labels = 0.0, 0.0
                    for _ in range(ga):
                        made = time.time()
                        batch = self.task.next_training_batch(model, self._next_batch)
                        window["batch_time"] += time.time() - made  # data; for RL also sampling and rewards
                        outputs = model.forward_backward(inputs=batch, adapter_name=name)
                        loss, tokens = _loss_and_tokens(outputs)
                        step_loss += loss
                        labels = _label_tokens(batch)
                        step_labels += 1.0 if labels is None else labels  # no label tensor: assume labelled
                        window["loss"] += loss
                        window["tokens"] += tokens
                        window["input_tokens"] += _batch_tokens(batch)
                    grad_norm = model.clip_grad_and_step(max_grad_norm=t.max_grad_norm, adapter_name=name)
                    self.step += 1
                    if self.startup is None:
                        self._report_startup(first_step)
                    self.task.after_step(model, step=self.step)
                    self._mark_boundary()
                    bar.update(1)
                    is_eval_step = eval_enabled and t.eval_every is not None and self.step % t.eval_every == 0
                    if self.step % t.log_every == 0 or self.step == self.total_steps or is_eval_step:
                        train_metrics = self._log_step(log, bar, window, grad_norm, started, show_bar)
                        window = self._new_window()
                    # after the step's log line, before evaluating or saving it
                    self._check_step(stop, math.isfinite(step_loss) and _is_finite(grad_norm), step_labels)
                    paused = time.time()
                    if is_eval_step and self.step != self.total_steps:
                        log.log("eval", self.step, self._report_eval(self.evaluate()))
                        self._check_step(stop)  # a signal during a long evaluation stops before the next step
                    if t.save_every is not None and self.step % t.save_every == 0:
                        self._save_checkpoint()
                    window["paused"] += time.time() - paused  # not training time for tokens/s
                if eval_enabled:
                    eval_after = self._report_eval(self.evaluate())
                    log.log("eval", self.step, eval_after)
                    self._check_step(stop)
                final_path = self._save("final", save_optimizer=False)
                self.checkpoints.append(final_path)
        except BaseException as exc:
            bar.close()
            log.failed(exc)  # the trackers finish the run as failed / interrupted
            if stop.forced:
                logger.warning("stopped at once by a second signal, without saving; resume from the last checkpoint")
                raise
            if isinstance(exc, TrainingDivergedError) or self.guard.skip_interrupted_save:
                raise  # such a state is not worth resuming from
            self._save_interrupted(exc)
            if stop.signum is not None and not isinstance(exc, KeyboardInterrupt):
                # an error after a stop was asked for (under torchrun often because of it: the other ranks
                # are going away) is reported as the interrupt it followed
                raise KeyboardInterrupt(f"received {signal.Signals(stop.signum).name}") from exc
            raise
        finally:
            bar.close()
            log.close()
            self.task.close()
        summary = {
            "output_dir": str(self.output_dir),
            "steps": self.step,
            "num_training_steps": self.total_steps,
            "epoch": self.epoch,
            "resumed_from": resumed_from,
            "train_metrics": train_metrics,
            "eval_before": eval_before,
            "eval_after": eval_after,
            "final_checkpoint": final_path,
            "checkpoints": list(self.checkpoints),
            "wall_time_s": round(time.time() - started, 3),
            "startup": self.startup,
        }
        if self.is_main:
            import json

            from twinkle_core.train.logging import _plain

            (self.output_dir / "summary.json").write_text(json.dumps(_plain(summary), indent=2) + "\n")
            from twinkle_core.train.curves import write_curves

            write_curves(self.output_dir, ["loss", *self.task.curve_keys], title=f"{r.task}: {self.output_dir.name}")
        return summary

    def _check_step(self, stop: StopSignals, finite: bool = True, label_tokens: float | None = None) -> None:
        self.guard.check(stop, step=self.step, total_steps=self.total_steps, finite=finite, label_tokens=label_tokens,
                         global_sum=self._global_sum)


def train(recipe: Recipe | str | os.PathLike[str] | dict[str, Any], *, overrides: list[str] | None = None,
          resume: str | None = None, resume_weights_only: str | None = None) -> dict[str, Any]:
    """Train as the recipe says; return a summary (final metrics, evaluation before/after, paths, wall time).

    ``recipe`` is a :class:`Recipe`, a YAML path or a mapping; ``resume`` is a checkpoint directory or
    ``"latest"`` (default: ``train.resume``).
    """
    if isinstance(recipe, (str, os.PathLike)):
        recipe = load_recipe(recipe, overrides)
    elif isinstance(recipe, dict):
        recipe = recipe_from_dict(recipe, overrides)
    elif overrides:
        recipe = recipe_from_dict(recipe_to_dict(recipe), overrides)
    return Trainer(recipe, resume=resume, resume_weights_only=resume_weights_only).run()
