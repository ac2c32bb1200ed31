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

One run per output directory: :meth:`Trainer.run` takes an exclusive lock on ``output_dir`` (the file
``.twinkle.lock``, :class:`~twinkle_core.train.run_lock.RunLock`) on the main process before anything is
written there and gives it back when the run ends, also on errors and signals; a second run on the same
directory is refused at once with a ConfigError naming the holder's pid and host. Every checkpoint marker
records the run's id (:func:`twinkle_core.checkpoint.run_lineage`; a run resumed exactly keeps the id of the
run it continues), and ``resume: latest`` only considers the checkpoints of the run that saved last in
``output_dir`` (another run's later ``checkpoint-N`` is skipped with a warning naming the path to resume it by).

A new run does not mix with an earlier one either: once the lock is held, and before anything is built, a run
that does not resume (``--resume-weights-only`` starts a new run too) into an ``output_dir`` holding another run's
``checkpoint-N``, ``final`` or log is refused with a ConfigError naming that run and the fixes (``--resume latest``
to continue it, ``--overwrite`` to discard it, or another ``output_dir``;
:func:`twinkle_core.train.checkpointing.check_start`). With
``overwrite`` the main process removes that run's checkpoints, ``final`` and logs once the model is built and a
``--resume-weights-only`` checkpoint's weights are loaded, between barriers (so ``--resume-weights-only latest
--overwrite`` starts over in its own directory from the newest checkpoint there). A resume must name a checkpoint
that exists and kept its marker, or it is refused before anything is built.

Stopping early: a first SIGINT (Ctrl+C) or SIGTERM only asks to stop; the loop finishes the current
optimizer step, saves ``checkpoint-N-interrupted`` (weights and counters of the same step) and raises
KeyboardInterrupt. With several processes the request is summed over the ranks at every step boundary,
so all of them stop at the same step even if only one got the signal. A second signal stops at once,
without saving (the state may be half-way through a step). An error mid-training also saves
``checkpoint-N-interrupted`` before it propagates (single process only: with several, the other ranks
may be blocked). Training refuses to go on, and saves nothing, after ``MAX_NONFINITE_STEPS``
consecutive steps with a non-finite loss or gradient norm (:class:`TrainingDivergedError`), or when
the first ``LABEL_CHECK_STEPS`` steps saw no label token on any rank (every label masked with
``IGNORE_INDEX``). A shorter run none of whose steps was finite fails the same way at its end, without ``final``.

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
``model.data_parallel`` (:class:`~twinkle_core.model.data_parallel.DataParallelView`; a
``TorchTwinkleModel`` reads its strategy's); by default every rank of the process group is a data-parallel
rank. The logs read the learning rate from ``get_train_configs()["lr"]`` (see
:mod:`twinkle_core.model.train_configs`). Without ``loss.name`` the loss is the task's default
(:func:`twinkle_core.task.default_loss_name`).

With ``model.adapter`` set, the loop calls ``add_adapter_to_model("default", adapter)`` and passes
``adapter_name="default"`` to every later call.

Where the parts live
--------------------
:func:`twinkle_core.train.build.build_run` builds everything from the recipe and returns a
:class:`~twinkle_core.train.build.TrainingRun` (task, tokenizer, datasets, model, loader, data-parallel view,
step totals). :class:`Trainer` hands that value to the objects that work on it: a
:class:`~twinkle_core.train.checkpointing.Checkpointer` (saving, resuming), an
:class:`~twinkle_core.train.evaluation.Evaluator` and a :class:`~twinkle_core.train.step_log.StepReporter` (log
lines, trackers, progress bar), and reads its micro-batches from a
:class:`~twinkle_core.train.batches.BatchStream`. This module keeps the step loop itself, as named phases, and
:func:`train`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twinkle_core import checkpoint, distributed
from twinkle_core.errors import ConfigError
from twinkle_core.task import default_loss_name
from twinkle_core.train.batch_stats import batch_tokens, is_finite, label_tokens, loss_and_tokens
from twinkle_core.train.batches import BatchStream
from twinkle_core.train.build import ADAPTER_NAME, TrainingRun, build_run
from twinkle_core.train.checkpointing import (
    OVERWRITE_WITH_RESUME,
    Checkpointer,
    check_start,
    discard_previous_run,
)
from twinkle_core.train.curves import write_curves
from twinkle_core.train.evaluation import Evaluator
from twinkle_core.train.guards import (  # noqa: F401 - MAX_NONFINITE_STEPS, LABEL_CHECK_STEPS: documented here
    IGNORE_INDEX,
    LABEL_CHECK_STEPS,
    MAX_NONFINITE_STEPS,
    StepGuard,
    StopSignals,
    TrainingDivergedError,
    bar_friendly_logging,
)
from twinkle_core.train.logging import StartupTimer, json_safe, take_startup_timer
from twinkle_core.train.recipe import Recipe, load_recipe, recipe_from_dict, recipe_to_dict
from twinkle_core.train.run_lock import RunLock
from twinkle_core.train.seeding import seed_everything  # noqa: F401 - part of this module's public names
from twinkle_core.train.step_log import StepReporter, StepWindow, startup_report

logger = logging.getLogger("twinkle.train")


@dataclass
class RunOutcome:
    """What a run reports besides its counters: the last training log line, the evaluations and the final model."""

    train_metrics: dict[str, Any] = field(default_factory=dict)
    eval_before: dict[str, float] | None = None
    eval_after: dict[str, float] | None = None
    #: the per-source row counts of a mixture of several ``data.train`` sources (main process)
    data_mixture: dict[str, Any] | None = None
    final_checkpoint: str | None = None


# ---------------------------------------------------------------------- trainer
class Trainer:
    """One training run. ``Trainer(recipe).run()`` is what :func:`train` does; :meth:`build` alone builds the
    run's parts (:attr:`plan`) without training."""

    def __init__(self, recipe: Recipe, *, resume: str | None = None, resume_weights_only: str | None = None,
                 overwrite: bool = False) -> None:
        self.recipe = recipe
        self.resume_spec = resume if resume is not None else recipe.train.resume
        #: ``--resume-weights-only``: a checkpoint whose weights (and adapter) start a fresh run at step 0
        self.weights_only_spec = resume_weights_only
        if self.resume_spec and resume_weights_only:
            raise ConfigError("--resume and --resume-weights-only (or train.resume) exclude each other: --resume "
                              "continues the run exactly, --resume-weights-only starts a new one from the weights")
        #: ``--overwrite``: a new run may replace the previous run's checkpoints, final model and logs in output_dir
        self.overwrite = overwrite
        if overwrite and self.resume_spec:
            raise ConfigError(OVERWRITE_WITH_RESUME)
        #: what ``overwrite`` discards once the run is built (:func:`check_start`)
        self.previous_run: checkpoint.PreviousRun | None = None
        self.output_dir = Path(recipe.train.output_dir)
        self.adapter_name: str | None = ADAPTER_NAME if recipe.model.adapter else None
        self.step = 0
        self.is_main = False  # known once the model joined the process group
        self.guard = StepGuard(str(recipe.data.train))
        #: what the run trains with, once :meth:`build` made it
        self.plan: TrainingRun | None = None
        self.stream: BatchStream | None = None
        self.checkpointer: Checkpointer | None = None
        self.evaluator: Evaluator | None = None
        #: where the time before the first optimizer step went (``summary["startup"]``)
        self.startup_timer: StartupTimer = take_startup_timer()
        self.startup: dict[str, Any] | None = None
        #: the lock on ``output_dir`` while :meth:`run` runs (main process only)
        self.run_lock: RunLock | None = None
        #: this run's id (the lock's on the main process); ``lineage``: the id its checkpoint markers record, the
        #: id of the run it continues when resumed exactly (``--resume latest`` keeps to one lineage)
        self.run_id: str = uuid.uuid4().hex
        self.lineage: str | None = None

    # ------------------------------------------------------------------ the built run
    @property
    def model(self) -> Any:
        return self.plan.model if self.plan is not None else None

    @property
    def task(self) -> Any:
        return self.plan.task if self.plan is not None else None

    @property
    def dp_rank(self) -> int | None:
        return self.plan.data_parallel.rank if self.plan is not None else None

    @property
    def dp_size(self) -> int | None:
        return self.plan.data_parallel.size if self.plan is not None else None

    @property
    def total_steps(self) -> int:
        return self.plan.total_steps if self.plan is not None else 0

    @property
    def epoch(self) -> int:
        return self.stream.epoch if self.stream is not None else 0

    def build(self) -> TrainingRun:
        """Build the task, tokenizer, datasets, model and loader of the recipe (:func:`build_run`)."""
        self.plan = build_run(self.recipe, output_dir=self.output_dir, adapter_name=self.adapter_name,
                              timer=self.startup_timer)
        return self.plan

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
        """Train; the output directory is locked (:class:`RunLock`, main process) from before anything is written
        there until the run ends, also on errors and signals."""
        started = time.time()
        lock = RunLock(self.output_dir) if distributed.is_main_process() else None  # RANK before the group exists
        if lock is not None:
            lock.acquire()  # a second run on this directory is refused here, before building anything
        self.run_lock = lock
        self.run_id = lock.run_id if lock is not None else uuid.uuid4().hex
        try:
            # every rank, before building anything: a start that would mix two runs is refused in a moment
            self.previous_run = check_start(self.output_dir, resume=self.resume_spec,
                                            weights_only=self.weights_only_spec, overwrite=self.overwrite)
            return self._run(started)
        finally:
            if lock is not None:
                lock.release()

    def _run(self, started: float) -> dict[str, Any]:
        resumed_from = self._start()
        reporter = self._open_reporter(started)
        stop = StopSignals()
        outcome = RunOutcome()
        with checkpoint.run_lineage(self.lineage):  # also for checkpoint-N-interrupted
            try:
                with stop, bar_friendly_logging(reporter.show_bar):
                    self._train(reporter, stop, outcome)
            except BaseException as exc:
                reported_as = self._stopped(exc, reporter, stop)
                if reported_as is not None:
                    raise reported_as from exc
                raise
            finally:
                reporter.close()
                self.plan.task.close()
        summary = self._summary(outcome, resumed_from, started)
        if self.is_main:
            self._write_summary(summary)
        return summary

    def _start(self) -> str | None:
        """Build the run, write its recipe and resume its checkpoint; the checkpoint resumed from, if any."""
        run = self.build()  # closes the task itself when building fails
        try:
            with self.startup_timer.phase("setup"):
                self.is_main = distributed.is_main_process()
                self.checkpointer = Checkpointer(run, is_main=self.is_main, resume=self.resume_spec,
                                                 weights_only=self.weights_only_spec)
                # --resume-weights-only reads its checkpoint (perhaps in output_dir) before --overwrite removes it
                resumed = self.checkpointer.resume()
                if self.overwrite:  # every rank: the barriers are collective
                    self._discard_previous_run()
                if self.is_main:
                    import yaml

                    self.output_dir.mkdir(parents=True, exist_ok=True)
                    (self.output_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe_to_dict(self.recipe),
                                                                                sort_keys=False))
                # a run continued exactly keeps its checkpoints' run id; a fresh one (or from weights only) is new
                continued = checkpoint.read_marker(resumed.path).get("run_id") if resumed and self.resume_spec else None
                self.lineage = continued or self.run_id
                self.step = resumed.step if resumed is not None else 0
                self.stream = BatchStream(run.loader, epoch=resumed.epoch if resumed is not None else 0)
                self.evaluator = Evaluator(run, self._global_sum)
                self.checkpointer.mark_boundary(self.step, self.stream.epoch)
        except BaseException:
            run.task.close()  # what the task started (a PPO critic, sampler threads) also goes on a failed start
            raise
        return resumed.path if resumed is not None else None

    def _discard_previous_run(self) -> None:
        """``overwrite``: the main process removes the previous run's files once every rank is past reading them
        (a ``--resume-weights-only`` checkpoint among them), and no rank goes on before they are gone."""
        distributed.barrier()
        if self.is_main and self.previous_run is not None:
            discard_previous_run(self.previous_run)
        distributed.barrier()
        self.previous_run = None

    def _open_reporter(self, started: float) -> StepReporter:
        run = self.plan
        with self.startup_timer.phase("setup"):
            try:  # starts the recipe's trackers (train.report_to): one that cannot start stops the run here
                reporter = StepReporter(run, step=self.step, is_main=self.is_main, started=started)
            except BaseException:
                run.task.close()
                raise
        if self.is_main:
            logger.info("training %d optimizer steps (%s micro-batches per epoch per rank, %d accumulated per step)"
                        " from step %d; output in %s", run.total_steps, run.micro_batches_per_epoch,
                        self.recipe.train.gradient_accumulation_steps, self.step, self.output_dir)
        return reporter

    def _train(self, reporter: StepReporter, stop: StopSignals, outcome: RunOutcome) -> None:
        """Evaluate before (when asked), train every step, evaluate after and save ``final``."""
        run, t = self.plan, self.recipe.train
        with self.startup_timer.phase("data"):  # reads the sources' row counts once more
            outcome.data_mixture = reporter.log_mixture()
        if t.eval_before_training and run.evaluates and self.step == 0:
            with self.startup_timer.phase("eval_before"):
                outcome.eval_before = reporter.log_eval(self.step, self.evaluator.evaluate(), before_training=True)
        window = StepWindow()
        first_step = time.perf_counter(), time.process_time()
        while self.step < run.total_steps:
            window = self._train_step(reporter, stop, window, first_step, outcome)
        self.guard.check_trained(step=self.step, suspects=self._divergence_suspects())
        if run.evaluates:
            outcome.eval_after = reporter.log_eval(self.step, self.evaluator.evaluate())
            self._check_step(stop)
        outcome.final_checkpoint = self.checkpointer.save_final(self.step, self.stream.epoch)

    def _train_step(self, reporter: StepReporter, stop: StopSignals, window: StepWindow,
                    first_step: tuple[float, float], outcome: RunOutcome) -> StepWindow:
        """One optimizer step, then what follows it: log line, checks, evaluation, checkpoint. Returns the window
        the next step adds to."""
        run, t = self.plan, self.recipe.train
        step_loss, step_labels, grad_norm = self._accumulate(window)
        self.step += 1
        if self.startup is None:
            self.startup = startup_report(self.startup_timer, first_step, is_main=self.is_main)
        run.task.after_step(run.model, step=self.step)
        self.checkpointer.mark_boundary(self.step, self.stream.epoch)
        reporter.bar.update(1)
        is_eval_step = run.evaluates and t.eval_every is not None and self.step % t.eval_every == 0
        if self.step % t.log_every == 0 or self.step == run.total_steps or is_eval_step:
            outcome.train_metrics = reporter.log_step(self.step, self.stream.epoch, window, grad_norm)
            window = StepWindow()
        # after the step's log line, before evaluating or saving it
        self._check_step(stop, math.isfinite(step_loss) and is_finite(grad_norm), step_labels)
        paused = time.time()
        if is_eval_step and self.step != run.total_steps:
            reporter.log_eval(self.step, self.evaluator.evaluate())
            self._check_step(stop)  # a signal during a long evaluation stops before the next step
        if t.save_every is not None and self.step % t.save_every == 0:
            self.checkpointer.save_checkpoint(self.step, self.stream.epoch)
        window.paused += time.time() - paused  # not training time for tokens/s
        return window

    def _accumulate(self, window: StepWindow) -> tuple[float, float, float | None]:
        """Forward and backward ``gradient_accumulation_steps`` micro-batches, each followed by
        ``clip_grad_and_step``, which steps on the last (the model was given the accumulation); ``(their summed
        loss, their label tokens, the step's pre-clip gradient norm)``, the first two also added to ``window``."""
        run, t = self.plan, self.recipe.train
        step_loss = step_labels = 0.0
        grad_norm = None
        for micro in range(t.gradient_accumulation_steps):
            made = time.time()
            batch = run.task.next_training_batch(run.model, self.stream.next_batch)
            window.batch_time += time.time() - made  # data; for RL also sampling and rewards
            outputs = run.model.forward_backward(inputs=batch, adapter_name=run.adapter_name)
            loss, tokens = loss_and_tokens(outputs)
            labels = label_tokens(batch)
            step_loss += loss
            step_labels += 1.0 if labels is None else labels  # no label tensor: assume labelled
            window.loss += loss
            window.tokens += tokens
            window.input_tokens += batch_tokens(batch)
            grad_norm = run.model.clip_grad_and_step(max_grad_norm=t.max_grad_norm, adapter_name=run.adapter_name)
            if grad_norm is None and micro == t.gradient_accumulation_steps - 1:
                raise ConfigError(f"the model did not step after train.gradient_accumulation_steps="
                                  f"{t.gradient_accumulation_steps} micro-batches: something set its optimizer again "
                                  f"with another gradient_accumulation_steps; set it in the recipe only")
        return step_loss, step_labels, grad_norm

    def _divergence_suspects(self) -> str:
        """The settings a run that never had a finite step names: learning rate, precision and loss options."""
        r = self.recipe
        loss = r.loss.name or default_loss_name(self.plan.task)
        options = f" with loss.options {dict(r.loss.options)}" if r.loss.options else ""
        return f"optimizer.lr={r.optimizer.lr!r}, precision={r.precision!r}, loss {loss!r}{options}"

    def _check_step(self, stop: StopSignals, finite: bool = True, label_tokens: float | None = None) -> None:
        self.guard.check(stop, step=self.step, total_steps=self.total_steps, finite=finite, label_tokens=label_tokens,
                         global_sum=self._global_sum)

    def _stopped(self, exc: BaseException, reporter: StepReporter, stop: StopSignals) -> BaseException | None:
        """Training stopped on ``exc``: save ``checkpoint-N-interrupted`` where that state is worth resuming from.
        Returns the exception to report instead of ``exc`` (None: ``exc`` itself)."""
        reporter.failed(exc)  # the trackers finish the run as failed / interrupted
        if stop.forced:
            logger.warning("stopped at once by a second signal, without saving; resume from the last checkpoint")
            return None
        if isinstance(exc, TrainingDivergedError) or self.guard.skip_interrupted_save:
            return None  # such a state is not worth resuming from
        self.checkpointer.save_interrupted(exc)
        if stop.signum is not None and not isinstance(exc, KeyboardInterrupt):
            # an error after a stop was asked for (under torchrun often because of it: the other ranks
            # are going away) is reported as the interrupt it followed
            return KeyboardInterrupt(f"received {signal.Signals(stop.signum).name}")
        return None

    # ------------------------------------------------------------------ the summary
    def _summary(self, outcome: RunOutcome, resumed_from: str | None, started: float) -> dict[str, Any]:
        return {
            "output_dir": str(self.output_dir),
            "steps": self.step,
            "num_training_steps": self.total_steps,
            "epoch": self.epoch,
            "resumed_from": resumed_from,
            "train_metrics": outcome.train_metrics,
            "eval_before": outcome.eval_before,
            "eval_after": outcome.eval_after,
            "data_mixture": outcome.data_mixture,
            "final_checkpoint": outcome.final_checkpoint,
            "checkpoints": list(self.checkpointer.checkpoints),
            "wall_time_s": round(time.time() - started, 3),
            "startup": self.startup,
        }

    def _write_summary(self, summary: dict[str, Any]) -> None:
        """``summary.json`` and the loss curves (main process)."""
        (self.output_dir / "summary.json").write_text(json.dumps(json_safe(summary), indent=2) + "\n")
        write_curves(self.output_dir, ["loss", *self.plan.task.curve_keys],
                     title=f"{self.recipe.task}: {self.output_dir.name}")


def train(recipe: Recipe | str | os.PathLike[str] | dict[str, Any], *, overrides: list[str] | None = None,
          resume: str | None = None, resume_weights_only: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Train as the recipe says; return a summary (final metrics, evaluation before/after, paths, wall time).

    ``recipe`` is a :class:`Recipe`, a YAML path or a mapping; ``resume`` is a checkpoint directory or
    ``"latest"`` (default: ``train.resume``). A new run into an ``output_dir`` that holds another run's
    checkpoints or log is refused unless ``overwrite`` (which then removes them, ``twinkle train --overwrite``).
    Unlike ``twinkle train``, it leaves the torch threads and warning filters of the calling program as they are
    (:func:`twinkle_core.threads.configure_threads` and :func:`twinkle_core.known_warnings.quiet_known_warnings`
    apply the command's choices).
    """
    if isinstance(recipe, (str, os.PathLike)):
        recipe = load_recipe(recipe, overrides)
    elif isinstance(recipe, dict):
        recipe = recipe_from_dict(recipe, overrides)
    elif overrides:
        recipe = recipe_from_dict(recipe_to_dict(recipe), overrides)
    return Trainer(recipe, resume=resume, resume_weights_only=resume_weights_only, overwrite=overwrite).run()
