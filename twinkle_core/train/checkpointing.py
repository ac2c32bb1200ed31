"""Checkpoint bookkeeping of a training run: what a checkpoint holds besides the model's own state,
``checkpoint-N`` / ``checkpoint-N-interrupted`` / ``final`` saving and pruning, and ``--resume`` /
``--resume-weights-only`` (with the checks that refuse a resume the run cannot continue exactly).

:class:`Checkpointer` does it for one :class:`~twinkle_core.train.build.TrainingRun`. The ``extra_state`` keys
:meth:`Checkpointer.save` writes are the ones :meth:`Checkpointer.resume` reads back, which is why both live here.

One run per output directory, also over time: :func:`check_start` runs before anything is built (the trainer calls
it once it holds the directory's lock; ``twinkle train`` also before launching). A new run (no ``--resume``; a
``--resume-weights-only`` run is a new run too) into a directory that holds another run's checkpoints, ``final``
model or log (a run that stopped before its first checkpoint) is refused with a
:class:`~twinkle_core.errors.ConfigError` naming the directory, that run's files and the three ways on:
``--resume latest`` continues it, ``--overwrite`` discards it, or another ``train.output_dir``. A cache
(``data_cache``) alone is no run. With ``--overwrite`` the trainer calls
:func:`discard_previous_run` on the main process once the model is built and any ``--resume-weights-only`` weights
are loaded (so ``--resume-weights-only latest --overwrite`` starts a new run in its own directory from the newest
checkpoint there, read before it is removed), between two barriers. It removes the checkpoints, ``final``, their
staging leftovers and the run's records (:data:`RUN_RECORDS`), logging each: only what a run writes. Caches
(``data_cache`` ...) and any other file stay, and are listed.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_core import distributed
from twinkle_core.checkpoint import (
    FINAL_NAME,
    CheckpointError,
    PreviousRun,
    checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    lost_marker,
    marker_problem,
    previous_run,
    prune_checkpoints,
)
from twinkle_core.errors import ConfigError
from twinkle_core.train import resharding
from twinkle_core.train.build import TrainingRun
from twinkle_core.train.curves import CURVES_FILE
from twinkle_core.train.logging import LOG_FILE
from twinkle_core.train.run_lock import LOCK_FILE
from twinkle_core.train.task_state import local_task_state

logger = logging.getLogger("twinkle.train")

#: what a run writes into its output directory besides checkpoints: removed by ``--overwrite`` with them
RUN_RECORDS = (LOG_FILE, "summary.json", CURVES_FILE, "recipe.yaml", "tensorboard")
#: the records that show a run trained in a directory even when it saved nothing (it stopped before its first
#: checkpoint): a new run there would append its log lines to that run's
RUN_TRACES = (LOG_FILE, "summary.json")
#: what an interrupted save leaves beside its checkpoint (:func:`twinkle_core.checkpoint.atomic_directory`)
_STAGING = re.compile(rf"^\.(checkpoint-\d+(-interrupted)?|{FINAL_NAME})\.(incomplete|replaced)$")
_OVERWRITE_HINT = "(Python: train(..., resume='latest') or train(..., overwrite=True))"
#: ``--overwrite`` with ``--resume``
OVERWRITE_WITH_RESUME = ("--overwrite discards the previous run in train.output_dir and --resume (train.resume) "
                         "continues it: pass one of them")


# ---------------------------------------------------------------------- before a run is built
def locate_checkpoint(spec: str, output_dir: Path, flag: str) -> Path:
    """The checkpoint directory ``spec`` names: a path, or a name under ``output_dir``. A missing one is a
    ConfigError naming what ``output_dir`` holds; one that lost its marker a CheckpointError."""
    found = Path(spec).expanduser()
    if not found.exists() and (output_dir / spec).exists():
        found = output_dir / spec
    if not found.exists():
        held = [path.name for _, _, path in list_checkpoints(output_dir)]
        held += [FINAL_NAME] if (output_dir / FINAL_NAME).is_dir() else []
        there = f"{output_dir} holds no checkpoint"
        if held:
            there = (f"{output_dir} holds {', '.join(held)}: pass one of them (a path, or a name under "
                     f"train.output_dir), or latest for the newest checkpoint")
        raise ConfigError(f"{flag}: checkpoint {spec!r} does not exist (neither as a path nor under train.output_dir); "
                          f"{there}")
    if lost_marker(found):
        raise CheckpointError(f"{flag}: {marker_problem(found)}")
    return found


def check_resumed_optimizer(path: str | Path, saved: dict[str, Any], optimizer: Any) -> None:
    """Refuse an optimizer option of the recipe's ``optimizer`` section that differs from ``saved`` (the
    checkpoint's ``extra_state["optimizer_options"]``): the resumed optimizer and schedule would keep the saved
    value whatever the recipe says. (Checkpoints from before this check have none.)"""
    changed = [f"optimizer.{key}={saved[key]!r} there but {value!r} in the recipe"
               for key, value in (("lr", optimizer.lr), ("weight_decay", optimizer.weight_decay))
               if key in saved and saved[key] != value]
    if changed:
        raise ConfigError(
            f"train.resume: {path} was trained with {'; '.join(changed)}. A resumed run keeps the checkpoint's "
            f"optimizer and learning-rate schedule, so the new value would be ignored; set the checkpoint's "
            f"value to resume, or start a new run to change it")


def check_resume(output_dir: str | Path, resume: str | None, optimizer: Any) -> None:
    """What the trainer's resume refuses that the files tell before anything is built: the checkpoint
    ``resume`` names (``latest``: the newest under ``output_dir``; none yet is no error) was trained with other
    optimizer options (:func:`check_resumed_optimizer`). ``twinkle train`` (``--dry-run`` too) calls it before
    launching; a checkpoint whose trainer state cannot be read is left to the resume itself to report."""
    if not resume:
        return
    output_dir = Path(output_dir)
    path = latest_checkpoint(output_dir) if resume == "latest" else locate_checkpoint(resume, output_dir, "--resume")
    if path is None:
        return
    extra = resharding.saved_extra_state(path)
    if extra is not None:
        check_resumed_optimizer(path, extra.get("optimizer_options") or {}, optimizer)


def check_start(output_dir: str | Path, *, resume: str | None = None, weights_only: str | None = None,
                overwrite: bool = False) -> PreviousRun | None:
    """Refuse a start that would mix two runs in ``output_dir``, before anything is built; return the previous run
    that ``overwrite`` is to discard (None: nothing to discard).

    ``resume`` (``--resume`` / ``train.resume``) continues a run: a checkpoint it names must exist and have its
    marker, and ``latest`` must find a checkpoint to continue where a previous run left only ``final``.
    Otherwise the run is new (``weights_only`` included) and ``output_dir`` must hold no checkpoint, ``final`` or
    log (:data:`RUN_TRACES`) of another run, unless ``overwrite``. A cache (``data_cache``) is not a run.
    """
    output_dir = Path(output_dir)
    if overwrite and resume:
        raise ConfigError(OVERWRITE_WITH_RESUME)
    if resume and resume != "latest":
        locate_checkpoint(resume, output_dir, "--resume")
    if weights_only and weights_only != "latest":
        locate_checkpoint(weights_only, output_dir, "--resume-weights-only")
    previous = _previous_run(output_dir)
    if resume:
        if resume == "latest" and previous is not None and previous.final is not None and not previous.checkpoints:
            raise ConfigError(
                f"--resume latest: train.output_dir {output_dir} holds no checkpoint-N to continue, only the final "
                f"model of {previous.describe()}: that run finished, there is nothing to resume. To train again from "
                f"scratch there, run without --resume and with --overwrite (removes that final model and its logs), "
                f"or set train.output_dir to a new directory")
        return None
    if previous is None or overwrite:
        return previous
    source = ""
    if weights_only:
        source = (" --resume-weights-only starts a new run: with --overwrite the weights of its checkpoint are "
                  "loaded first, then the previous run's files are removed; or write the new run elsewhere (the "
                  "checkpoint stays where it is).")
    if previous.paths:
        logs = f" and its logs ({', '.join(p.name for p in previous.records)})" if previous.records else ""
        raise ConfigError(
            f"train.output_dir {output_dir} already holds the checkpoints of {previous.describe()}{logs}; a new run "
            f"there would mix its checkpoints, final model and logs with that run's.{source} Continue that run with "
            f"--resume latest, or discard it with --overwrite (removes its checkpoints, final model and logs), or set "
            f"train.output_dir to a new directory {_OVERWRITE_HINT}")
    raise ConfigError(
        f"train.output_dir {output_dir} already holds the logs of {previous.describe()}, a run that saved no "
        f"checkpoint; a new run there would append its log lines and curves to that run's.{source} Discard them with "
        f"--overwrite, or set train.output_dir to a new directory, or keep appending with --resume latest (which "
        f"starts from step 0, as there is no checkpoint) {_OVERWRITE_HINT}")


def _previous_run(output_dir: Path) -> PreviousRun | None:
    """:func:`~twinkle_core.checkpoint.previous_run` with the run's :data:`RUN_TRACES`; a directory with traces and
    no checkpoint holds a run too."""
    previous = previous_run(output_dir)
    traces = tuple(output_dir / name for name in RUN_TRACES if (output_dir / name).exists())
    if not traces:
        return previous
    if previous is None:
        return PreviousRun(output_dir=output_dir, checkpoints=(), final=None, run_id=None, records=traces)
    return dataclasses.replace(previous, records=traces)


def discard_previous_run(previous: PreviousRun) -> list[Path]:
    """Remove what ``previous`` left in its output directory (main process only; the caller holds the directory's
    lock): its checkpoints, ``final``, interrupted saves' staging directories and :data:`RUN_RECORDS`. Each removal
    is logged; caches and anything else in the directory stay. Returns what was removed."""
    root = previous.output_dir
    doomed = list(previous.paths)
    if root.is_dir():
        doomed += sorted(path for path in root.iterdir() if _STAGING.match(path.name))
    doomed += [root / name for name in RUN_RECORDS if (root / name).exists()]
    removed = []
    for path in doomed:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    if removed:
        logger.warning("--overwrite: removed the previous run (%s) from %s: %s", previous.label, root,
                       ", ".join(p.name for p in removed))
    kept = sorted(path.name for path in root.iterdir() if path.name != LOCK_FILE) if root.is_dir() else []
    if kept:
        logger.info("--overwrite: kept %s in %s (caches, and files a run does not write: they are never removed)",
                    ", ".join(kept), root)
    return removed


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: the checkpoint it came from and its counters."""

    path: str
    step: int = 0
    epoch: int = 0


class Checkpointer:
    """Saves and resumes the checkpoints of ``run``. ``resume`` is ``train.resume`` / ``--resume`` (a checkpoint
    directory or ``latest``), ``weights_only`` ``--resume-weights-only``; ``is_main`` says whether this process
    looks for the latest checkpoint and prunes old ones. ``checkpoints`` lists what it saved, in order."""

    def __init__(self, run: TrainingRun, *, is_main: bool, resume: str | None = None,
                 weights_only: str | None = None) -> None:
        self.run = run
        self.is_main = is_main
        self.resume_spec = resume
        self.weights_only_spec = weights_only
        self.checkpoints: list[str] = []
        self._boundary: dict[str, Any] = {}
        self._last_saved_step = -1

    # ------------------------------------------------------------------ saving
    def state(self, step: int, epoch: int) -> dict[str, Any]:
        """The counters and positions a checkpoint of ``step`` holds besides the model's own state."""
        return {"step": step, "epoch": epoch, "loader": self.run.loader.state_dict(),
                "task": self.run.task.state_dict()}

    def mark_boundary(self, step: int, epoch: int) -> None:
        """Remember the state after a complete optimizer step (what an interrupted checkpoint saves)."""
        self._boundary = self.state(step, epoch)

    def _layout(self) -> dict[str, Any]:
        r = self.run.recipe
        return resharding.layout(world_size=distributed.world_size(), dp_size=self.run.data_parallel.size,
                                 batch_size=r.data.batch_size,
                                 gradient_accumulation_steps=r.train.gradient_accumulation_steps,
                                 strategy=self.run.strategy_name)

    def save(self, name: str, state: dict[str, Any], **kwargs: Any) -> str:
        """Write the checkpoint ``name`` of ``state`` (:meth:`state`); ``kwargs`` go to ``model.save``."""
        run, o = self.run, self.run.recipe.optimizer
        state = dict(state)
        # the task's state is per rank (each rank's share of a rollout queue): gathered, since only the main
        # process writes the extra state
        state["task"] = {"per_rank": distributed.all_gather_object(state.get("task") or {})}
        state["layout"] = self._layout()  # what --resume compares at another world size or batch size
        extra = {**state, "total_steps": run.total_steps,
                 "optimizer_options": {"lr": o.lr, "weight_decay": o.weight_decay}}  # checked on resume
        path = run.model.save(name, output_dir=str(run.output_dir), adapter_name=run.adapter_name,
                              extra_state=extra, **kwargs)
        self._last_saved_step = state["step"]
        return str(path) if path is not None else str(run.output_dir / name)

    def save_checkpoint(self, step: int, epoch: int) -> str:
        """``checkpoint-<step>``, then the oldest beyond ``train.save_total_limit`` are removed."""
        path = self.save(checkpoint_name(step), self.state(step, epoch))
        self.checkpoints.append(path)
        logger.info("saved %s", path)
        if self.is_main:
            for removed in prune_checkpoints(self.run.output_dir, self.run.recipe.train.save_total_limit):
                logger.info("removed old checkpoint %s", removed)
        distributed.barrier()
        return path

    def save_final(self, step: int, epoch: int) -> str:
        """``final``: the trained weights, without optimizer state."""
        path = self.save(FINAL_NAME, self.state(step, epoch), save_optimizer=False)
        self.checkpoints.append(path)
        return path

    def save_interrupted(self, exc: BaseException) -> str | None:
        """``checkpoint-N-interrupted`` of the last complete step, when training stops on ``exc``; None when there
        is nothing new to save or it cannot be saved safely."""
        state = self._boundary
        if not state or state["step"] <= max(self._last_saved_step, 0):
            logger.warning("no optimizer step since the last checkpoint; nothing more to save")
            return None
        if distributed.world_size() > 1 and not isinstance(exc, KeyboardInterrupt):
            logger.error("an error on this rank stopped training; with several processes the interrupted "
                         "checkpoint is only written on Ctrl+C / SIGTERM (the others may be blocked)")
            return None
        name = checkpoint_name(state["step"], interrupted=True)
        try:
            path = self.save(name, state)
        except BaseException as save_exc:  # never hide the original error
            logger.error("could not save the interrupted checkpoint %s: %s", name, save_exc)
            return None
        logger.warning("training stopped at step %d (%s); saved %s — continue with --resume latest",
                       state["step"], type(exc).__name__, path)
        self.checkpoints.append(path)
        return path

    # ------------------------------------------------------------------ resuming
    def _find(self, spec: str, flag: str) -> Path | None:
        """The checkpoint ``spec`` names (``latest``: the newest under the output directory, None when there is
        none yet)."""
        output_dir = self.run.output_dir
        if spec != "latest":
            return locate_checkpoint(spec, output_dir, flag)
        # one process hashes the candidates, and every rank resumes from the same one
        path, listed = distributed.broadcast_object(
            (latest_checkpoint(output_dir), [p.name for _, _, p in list_checkpoints(output_dir)]) if self.is_main
            else (None, []))
        if path is None and listed:
            raise CheckpointError(
                f"{flag} latest: none of the checkpoints under {output_dir} ({', '.join(listed)}) can be resumed "
                f"from: each is broken, lost its marker or belongs to another run (the warnings above say which). "
                f"Resume one by path once it is repaired, or start a new run with --overwrite (removes them) or in "
                f"another train.output_dir")
        if path is None:
            logger.warning("%s latest: no checkpoint under %s yet; starting from scratch", flag, output_dir)
        return path

    def resume(self) -> ResumePoint | None:
        """Load the checkpoint to continue from, if any: everything with ``resume``, only the weights with
        ``weights_only`` (the run then starts at step 0)."""
        spec = self.resume_spec or self.weights_only_spec
        if not spec:
            return None
        path = self._find(spec, "--resume" if self.resume_spec else "--resume-weights-only")
        if path is None:
            return None
        if not self.resume_spec:
            return ResumePoint(self._load_weights_only(path))
        return self._resume_exactly(path)

    def _resume_exactly(self, path: Path) -> ResumePoint:
        run = self.run
        world_changed = resharding.check_layout(path, resharding.saved_layout(path), self._layout(),
                                                reshards=run.model.reshards_checkpoints)
        extra = run.model.resume_from_checkpoint(str(path), adapter_name=run.adapter_name) or {}
        self._check_resumed_optimizer(path, extra.get("optimizer_options") or {})
        step, epoch = int(extra.get("step", 0)), int(extra.get("epoch", 0))
        run.loader.set_epoch(epoch)
        run.task.load_state_dict(local_task_state(path, extra.get("task") or {}))
        if extra.get("loader") is not None:
            try:
                run.loader.load_state_dict(resharding.remap_loader_state(path, extra["loader"], run.loader))
            except ValueError as exc:  # another data set, seed or shuffle: the data order would differ
                raise ConfigError(f"train.resume: {path}: {exc}") from exc
        else:
            logger.warning("%s has no data-loader state; the data order restarts from the epoch's beginning", path)
        if world_changed:  # the per-rank RNG streams cannot carry over to another number of ranks
            resharding.reseed(run.recipe.train.seed, step)
        self._last_saved_step = step
        logger.info("resumed from %s at step %d (epoch %d)", path, step, epoch)
        return ResumePoint(str(path), step, epoch)

    def _load_weights_only(self, path: Path) -> str:
        """``--resume-weights-only``: the checkpoint's weights (the adapter's, with ``model.adapter``) and nothing
        else; optimizer, schedule, data order, RNG and counters start fresh at step 0, at any world size, batch
        size or strategy."""
        from twinkle_core import checkpoint

        # a plain exported model directory (no marker) is loaded as it is
        checkpoint.verify_on_main(path, self.is_main and checkpoint.is_complete(str(path)))
        self.run.model.load(str(path), adapter_name=self.run.adapter_name)
        logger.info("loaded the weights of %s; training starts fresh at step 0 (optimizer, schedule and data order "
                    "are new)", path)
        return str(path)

    def _check_resumed_optimizer(self, path: Path, saved: dict[str, Any]) -> None:
        check_resumed_optimizer(path, saved, self.run.recipe.optimizer)
