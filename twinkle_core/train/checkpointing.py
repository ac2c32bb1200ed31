"""Checkpoint bookkeeping of a training run: what a checkpoint holds besides the model's own state,
``checkpoint-N`` / ``checkpoint-N-interrupted`` / ``final`` saving and pruning, and ``--resume`` /
``--resume-weights-only`` (with the checks that refuse a resume the run cannot continue exactly).

:class:`Checkpointer` does it for one :class:`~twinkle_core.train.build.TrainingRun`. The ``extra_state`` keys
:meth:`Checkpointer.save` writes are the ones :meth:`Checkpointer.resume` reads back, which is why both live here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_core import distributed
from twinkle_core.checkpoint import checkpoint_name, latest_checkpoint, prune_checkpoints
from twinkle_core.errors import ConfigError
from twinkle_core.train import resharding
from twinkle_core.train.build import TrainingRun
from twinkle_core.train.task_state import local_task_state

logger = logging.getLogger("twinkle.train")


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
        path = self.save("final", self.state(step, epoch), save_optimizer=False)
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
        if spec == "latest":
            # one process hashes the candidates, and every rank resumes from the same one
            path = distributed.broadcast_object(latest_checkpoint(output_dir) if self.is_main else None)
            if path is None:
                logger.warning("%s latest: no checkpoint under %s yet; starting from scratch", flag, output_dir)
            return path
        found = Path(spec).expanduser()
        if not found.exists() and (output_dir / spec).exists():
            found = output_dir / spec
        if not found.exists():
            raise ConfigError(f"{flag}: checkpoint {spec!r} does not exist")
        return found

    def resume(self) -> ResumePoint | None:
        """Load the checkpoint to continue from, if any: everything with ``resume``, only the weights with
        ``weights_only`` (the run then starts at step 0)."""
        spec = self.resume_spec or self.weights_only_spec
        if not spec:
            return None
        path = self._find(spec, "train.resume" if self.resume_spec else "--resume-weights-only")
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
        """Refuse an optimizer option that differs from the checkpoint's: the resumed optimizer and schedule
        would keep the saved value whatever the recipe says. (Checkpoints from before this check have none.)"""
        o = self.run.recipe.optimizer
        changed = [f"optimizer.{key}={saved[key]!r} there but {value!r} in the recipe"
                   for key, value in (("lr", o.lr), ("weight_decay", o.weight_decay))
                   if key in saved and saved[key] != value]
        if changed:
            raise ConfigError(
                f"train.resume: {path} was trained with {'; '.join(changed)}. A resumed run keeps the checkpoint's "
                f"optimizer and learning-rate schedule, so the new value would be ignored; set the checkpoint's "
                f"value to resume, or start a new run to change it")
