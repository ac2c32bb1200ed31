"""Checkpoint bookkeeping of a training run: what a checkpoint holds besides the model's own state,
``checkpoint-N`` / ``checkpoint-N-interrupted`` saving and pruning, and ``--resume`` /
``--resume-weights-only`` (with the checks that refuse a resume the run cannot continue exactly).

:class:`CheckpointMixin` is that part of :class:`twinkle_core.train.loop.Trainer`. The ``extra_state``
keys :meth:`CheckpointMixin._save` writes are the ones :meth:`CheckpointMixin._resume` reads back, which is
why both live here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from twinkle_core import distributed
from twinkle_core.checkpoint import checkpoint_name, latest_checkpoint, prune_checkpoints
from twinkle_core.errors import ConfigError
from twinkle_core.train import resharding
from twinkle_core.train.task_state import local_task_state

logger = logging.getLogger("twinkle.train")


class CheckpointMixin:
    """Saving and resuming; the trainer supplies the recipe, the built model, task and loader, the counters
    (``step``, ``epoch``, ``total_steps``) and ``is_main``."""

    def _mark_boundary(self) -> None:
        """Remember the state after a complete optimizer step (what an interrupted checkpoint saves)."""
        self._boundary = self._state()

    def _state(self) -> dict[str, Any]:
        """The counters and positions a checkpoint of the current step holds besides the model's own state."""
        return {"step": self.step, "epoch": self.epoch, "loader": self.loader.state_dict(),
                "task": self.task.state_dict()}

    def _save(self, name: str, state: dict[str, Any] | None = None, **kwargs: Any) -> str:
        state = dict(state or self._state())
        # the task's state is per rank (each rank's share of a rollout queue): gathered, since only the main
        # process writes the extra state
        state["task"] = {"per_rank": distributed.all_gather_object(state.get("task") or {})}
        o, r = self.recipe.optimizer, self.recipe
        state["layout"] = resharding.layout(  # what --resume compares at another world size or batch size
            world_size=distributed.world_size(), dp_size=self.dp_size or 1, batch_size=r.data.batch_size,
            gradient_accumulation_steps=r.train.gradient_accumulation_steps, strategy=self._strategy_name())
        extra = {**state, "total_steps": self.total_steps,
                 "optimizer_options": {"lr": o.lr, "weight_decay": o.weight_decay}}  # checked on resume
        path = self.model.save(name, output_dir=str(self.output_dir), adapter_name=self.adapter_name,
                               extra_state=extra, **kwargs)
        self._last_saved_step = state["step"]
        return str(path) if path is not None else str(self.output_dir / name)

    def _save_checkpoint(self) -> None:
        path = self._save(checkpoint_name(self.step))
        self.checkpoints.append(path)
        logger.info("saved %s", path)
        if self.is_main:
            for removed in prune_checkpoints(self.output_dir, self.recipe.train.save_total_limit):
                logger.info("removed old checkpoint %s", removed)
        distributed.barrier()

    def _save_interrupted(self, exc: BaseException) -> str | None:
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
            path = self._save(name, dict(state))
        except BaseException as save_exc:  # never hide the original error
            logger.error("could not save the interrupted checkpoint %s: %s", name, save_exc)
            return None
        logger.warning("training stopped at step %d (%s); saved %s — continue with --resume latest",
                       state["step"], type(exc).__name__, path)
        self.checkpoints.append(path)
        return path

    def _resume(self) -> str | None:
        spec = self.resume_spec or self.weights_only_spec
        if not spec:
            return None
        flag = "train.resume" if self.resume_spec else "--resume-weights-only"
        if spec == "latest":
            # one process hashes the candidates, and every rank resumes from the same one
            path = distributed.broadcast_object(latest_checkpoint(self.output_dir) if self.is_main else None)
            if path is None:
                logger.warning("%s latest: no checkpoint under %s yet; starting from scratch", flag, self.output_dir)
                return None
        else:
            path = Path(spec).expanduser()
            if not path.exists() and (self.output_dir / spec).exists():
                path = self.output_dir / spec
            if not path.exists():
                raise ConfigError(f"{flag}: checkpoint {spec!r} does not exist")
        if not self.resume_spec:
            return self._load_weights_only(path)
        r = self.recipe
        now = resharding.layout(world_size=distributed.world_size(), dp_size=self.dp_size or 1,
                                batch_size=r.data.batch_size, gradient_accumulation_steps=r.train.gradient_accumulation_steps,
                                strategy=self._strategy_name())
        reshards = bool(getattr(getattr(self.model, "strategy", None), "reshards_checkpoints", False))
        world_changed = resharding.check_layout(path, resharding.saved_layout(path), now, reshards=reshards)
        extra = self.model.resume_from_checkpoint(str(path), adapter_name=self.adapter_name) or {}
        self._check_resumed_optimizer(path, extra.get("optimizer_options") or {})
        self.step = int(extra.get("step", 0))
        self.epoch = int(extra.get("epoch", 0))
        self.loader.set_epoch(self.epoch)
        self.task.load_state_dict(local_task_state(path, extra.get("task") or {}))
        if extra.get("loader") is not None:
            try:
                self.loader.load_state_dict(resharding.remap_loader_state(path, extra["loader"], self.loader))
            except ValueError as exc:  # another data set, seed or shuffle: the data order would differ
                raise ConfigError(f"train.resume: {path}: {exc}") from exc
        else:
            logger.warning("%s has no data-loader state; the data order restarts from the epoch's beginning", path)
        if world_changed:  # the per-rank RNG streams cannot carry over to another number of ranks
            resharding.reseed(r.train.seed, self.step)
        self._last_saved_step = self.step
        logger.info("resumed from %s at step %d (epoch %d)", path, self.step, self.epoch)
        return str(path)

    def _strategy_name(self) -> str | None:
        """The strategy the model runs (the recipe may leave it to a default)."""
        return getattr(getattr(self.model, "strategy", None), "name", None) or self.recipe.strategy.name

    def _load_weights_only(self, path: Path) -> str:
        """``--resume-weights-only``: the checkpoint's weights (the adapter's, with ``model.adapter``) and nothing
        else; optimizer, schedule, data order, RNG and counters start fresh at step 0, at any world size, batch
        size or strategy."""
        from twinkle_core import checkpoint

        # a plain exported model directory (no marker) is loaded as it is
        checkpoint.verify_on_main(path, self.is_main and checkpoint.is_complete(str(path)))
        self.model.load(str(path), adapter_name=self.adapter_name)
        logger.info("loaded the weights of %s; training starts fresh at step 0 (optimizer, schedule and data order "
                    "are new)", path)
        return str(path)

    def _check_resumed_optimizer(self, path: Path, saved: dict[str, Any]) -> None:
        """Refuse an optimizer option that differs from the checkpoint's: the resumed optimizer and schedule
        would keep the saved value whatever the recipe says. (Checkpoints from before this check have none.)"""
        o = self.recipe.optimizer
        changed = [f"optimizer.{key}={saved[key]!r} there but {value!r} in the recipe"
                   for key, value in (("lr", o.lr), ("weight_decay", o.weight_decay))
                   if key in saved and saved[key] != value]
        if changed:
            raise ConfigError(
                f"train.resume: {path} was trained with {'; '.join(changed)}. A resumed run keeps the checkpoint's "
                f"optimizer and learning-rate schedule, so the new value would be ignored; set the checkpoint's "
                f"value to resume, or start a new run to change it")

