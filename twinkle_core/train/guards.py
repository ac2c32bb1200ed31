"""What stops a training run besides its step count: signals, divergence and data that teaches nothing.

:class:`StopSignals` turns SIGINT / SIGTERM into a request honoured at the next optimizer-step boundary;
:class:`StepGuard` checks after every step whether to stop, with one collective so that all ranks decide alike,
and at the end of training whether any step was finite at all (:meth:`StepGuard.check_trained`).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from twinkle_core import distributed
from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError, TwinkleError

logger = logging.getLogger("twinkle.train")

#: consecutive steps with a non-finite loss or gradient norm after which training stops as diverged;
#: well above the handful of overflow steps a dynamic fp16 loss scaler skips while it settles
MAX_NONFINITE_STEPS = 25
#: a run whose first this-many steps see no label token on any rank is stopped: every label is masked
LABEL_CHECK_STEPS = 5
#: the label value the losses ignore (masked prompt tokens, padding)


class TrainingDivergedError(TwinkleError, RuntimeError):
    """The loss or gradient norm stayed non-finite for ``MAX_NONFINITE_STEPS`` consecutive steps, or for every step
    of a run shorter than that (:meth:`StepGuard.check_trained`)."""


class StopSignals:
    """SIGINT / SIGTERM ask the loop to stop at the next optimizer-step boundary; a second one stops at once.

    Raising from the handler would stop wherever the main thread is, e.g. inside the optimizer step, and
    the interrupted checkpoint would then hold step k+1's weights under step k's counters (a resume
    applies that step twice). So the first signal only records ``signum``, which the loop checks after
    each complete step. A second one puts the previous handlers back (a third gets their behaviour) and
    raises KeyboardInterrupt right away; ``forced`` tells the loop not to save that possibly torn state.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.forced = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
            for sig in self.SIGNALS:
                previous = signal.signal(sig, self._handle)
                # None: a handler not installed from Python, which cannot be put back; use the default
                self.previous[sig] = previous if previous is not None else signal.SIG_DFL
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum = signum
            logger.warning("received %s: stopping after the current optimizer step (send it again to stop at once)",
                           name)
            return
        self.forced = True
        self._restore()
        raise KeyboardInterrupt(f"received {name} twice")

    def _restore(self) -> None:
        for sig, previous in self.previous.items():
            signal.signal(sig, previous)
        self.previous = {}

    def __exit__(self, *exc: Any) -> None:
        self._restore()


def bar_friendly_logging(show_bar: bool) -> Any:
    """While the progress bar is shown, log lines go through tqdm.write so they do not break it."""
    import contextlib

    if not show_bar:
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


class StepGuard:
    """The per-run counters behind the stop decisions of :meth:`check`."""

    def __init__(self, data_name: str) -> None:
        self.data_name = data_name
        self.nonfinite_run = 0  # consecutive steps with a non-finite loss or gradient norm
        self.label_tokens_seen = 0.0  # over every rank, during the first LABEL_CHECK_STEPS steps of this run
        self.steps_this_run = 0
        #: steps of this run whose loss and gradient norm were finite on every rank (the same count on each)
        self.finite_steps = 0
        self.skip_interrupted_save = False  # a state not worth resuming from

    def check(self, stop: StopSignals, *, step: int, total_steps: int, finite: bool = True,
              label_tokens: float | None = None, global_sum: Callable[..., tuple[float, ...]]) -> None:
        """After a complete step (or an evaluation): stop on a signal, divergence or all-masked labels.

        The three are summed over the ranks in one collective, so every rank takes the same decision at the
        same step: a signal may reach one rank only, and a rank-local NaN loss must stop them all.
        ``label_tokens`` None: called between steps (after an evaluation), only the signal is checked.
        """
        values = (1.0 if stop.signum is not None else 0.0, 0.0 if finite else 1.0, label_tokens or 0.0)
        if distributed.world_size() > 1:
            values = global_sum(*values)
        signalled, nonfinite, labels = values
        if label_tokens is not None:
            self.nonfinite_run = self.nonfinite_run + 1 if nonfinite else 0
            self.finite_steps += 0 if nonfinite else 1
            if self.nonfinite_run >= MAX_NONFINITE_STEPS:
                raise TrainingDivergedError(
                    f"training diverged: {self.nonfinite_run} consecutive non-finite steps (loss or gradient "
                    f"norm) at step {step}; lower optimizer.lr, set train.max_grad_norm or use bf16 rather "
                    f"than fp16, and train again")
            self.steps_this_run += 1
            if self.steps_this_run <= LABEL_CHECK_STEPS:
                self.label_tokens_seen += labels
                if self.label_tokens_seen == 0 and (self.steps_this_run == LABEL_CHECK_STEPS
                                                      or step == total_steps):
                    self.skip_interrupted_save = True
                    raise ConfigError(
                        f"data.train ({self.data_name}): all labels are masked ({IGNORE_INDEX}) in the "
                        f"first {self.steps_this_run} steps on every rank, so training learns nothing; check the "
                        f"data format and the task's masking options (e.g. a prompt-only or truncated data set)")
        if signalled:
            name = signal.Signals(stop.signum).name if stop.signum is not None else "a signal on another rank"
            raise KeyboardInterrupt(f"stopping at step {step}: received {name}")

    def check_trained(self, *, step: int, suspects: str) -> None:
        """At the end of training, before ``final`` is written: a run none of whose steps had a finite loss and
        gradient norm (on every rank) trained nothing, even when it was too short for the ``MAX_NONFINITE_STEPS``
        guard; it fails with :class:`TrainingDivergedError` rather than ending with an untrained ``final``. Every
        rank counted the same reduced values, so all of them raise alike. ``suspects``: the settings to name."""
        if self.steps_this_run and not self.finite_steps:
            raise TrainingDivergedError(
                f"training diverged: every one of the {self.steps_this_run} optimizer steps of this run (up to step "
                f"{step}) had a non-finite loss or gradient norm (NaN or inf), so no update trained the model and no "
                f"final model was written (the checkpoints saved on the way are left as they are). Check {suspects}: "
                f"a learning rate that is too high, an fp16 overflow (use bf16), a loss option out of its range (e.g. "
                f"beta) and the data (NaN values, labels); then train again")
