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
"""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

from twinkle_core import distributed
from twinkle_core.checkpoint import checkpoint_name, latest_checkpoint, prune_checkpoints
from twinkle_core.errors import ConfigError
from twinkle_core.metrics import LossMetric
from twinkle_core.train import resharding
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
from twinkle_core.train.recipe import (
    Recipe,
    load_recipe,
    recipe_from_dict,
    recipe_to_dict,
    validate_plugin_names,
)
from twinkle_core.train.task_state import local_task_state

logger = logging.getLogger("twinkle.train")

ADAPTER_NAME = "default"



# ---------------------------------------------------------------------- small helpers (patchable in tests)
def _keyword_parameters(function: Any) -> set[str]:
    """The named parameters ``function`` takes (not ``**kwargs``)."""
    import inspect

    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # pragma: no cover
        return set()


def dataloader_class() -> Any:
    from twinkle_core.data.loader import DataLoader

    return DataLoader


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    import torch

    torch.manual_seed(seed)


def _loss_and_tokens(result: Any) -> tuple[float, float]:
    """``(summed loss, tokens)`` from a ``LossOutput``, an outputs mapping or a bare (mean) tensor."""
    if isinstance(result, dict):
        loss, tokens = result.get("loss"), result.get("num_tokens", 1)
        mean = True
    elif hasattr(result, "loss") and hasattr(result, "num_tokens"):
        loss, tokens = result.loss, result.num_tokens
        mean = False
    else:
        loss, tokens, mean = result, 1, True
    if loss is None:
        return 0.0, 0.0
    loss_f = float(loss.detach() if hasattr(loss, "detach") else loss)
    tokens_f = float(tokens)
    return (loss_f * tokens_f if mean else loss_f), tokens_f


def _batch_tokens(batch: Any) -> float:
    if not isinstance(batch, dict):
        return 0.0
    mask = batch.get("attention_mask")
    if mask is not None and hasattr(mask, "sum"):
        return float(mask.sum())
    ids = batch.get("input_ids")
    if ids is not None and hasattr(ids, "numel"):
        return float(ids.numel())
    return 0.0


def _label_tokens(batch: Any) -> float | None:
    """How many labels of ``batch`` are not ``IGNORE_INDEX``; None when it has no label tensor."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if labels is None or not hasattr(labels, "ne"):
        return None
    return float(labels.ne(IGNORE_INDEX).sum())


def _is_finite(value: Any) -> bool:
    """None (a model that reports no gradient norm) counts as finite."""
    return value is None or math.isfinite(float(value))


def _round(value: Any, digits: int = 6) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    return value


# ---------------------------------------------------------------------- trainer
class Trainer:
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

    # ------------------------------------------------------------------ building
    def build(self) -> None:
        r, timer = self.recipe, self.startup_timer
        from twinkle_core.plugins import get_plugins
        from twinkle_core.sources.resolve import resolve_model, trust_remote_code

        with timer.phase("plugins"):
            plugins = get_plugins()
            validate_plugin_names(r, plugins)
        with timer.phase("imports"):  # torch, the task and the model class (after validate_components: loaded)
            seed_everything(r.train.seed)
            task_cls = plugins.load("task", r.task)
            self.task = task_cls(**r.task_options)
            model_cls = plugins.load("model", r.model.class_name)
        with timer.phase("tokenizer"):
            self._build_tokenizer(model_cls, trust_remote_code(r.model.trust_remote_code), resolve_model)
        with timer.phase("data"):
            self._build_datasets()
        with timer.phase("model"):
            self._build_model(model_cls)
        with timer.phase("setup"):
            self._build_loader_and_schedule()

    def _build_tokenizer(self, model_cls: Any, trust: bool, resolve_model: Any) -> None:
        r = self.recipe
        self.trust_remote_code = trust
        model_dir = resolve_model(r.model.model_id, revision=r.model.revision) if r.model.model_id else None
        tokenizer_uri = r.model.tokenizer or r.model.model_id
        if tokenizer_uri == r.model.model_id and model_dir is not None:
            tokenizer_dir = model_dir
        else:
            tokenizer_dir = resolve_model(tokenizer_uri)
        self.model_dir = model_dir
        self.tokenizer = model_cls.load_tokenizer(tokenizer_dir, trust_remote_code=trust)

    def _build_datasets(self) -> None:
        r = self.recipe
        data_options = dict(r.data.options)
        for key in ("max_length", "mode", "packing", "template", "columns"):
            value = getattr(r.data, key)
            if value is not None:
                data_options[key] = value
        if isinstance(r.data.train, list) or isinstance(r.data.eval, list):  # mixing several sources
            data_options["seed"] = r.data.seed if r.data.seed is not None else r.train.seed
        accepts = _keyword_parameters(self.task.load_dataset)
        if "cache_dir" in accepts and r.data.cache_dir is not False and "cache_dir" not in data_options:
            data_options["cache_dir"] = (str(self.output_dir / "data_cache") if r.data.cache_dir in (None, True)
                                         else str(r.data.cache_dir))
        train_options = dict(data_options)
        if r.data.streaming:
            if "streaming" not in accepts:
                raise ConfigError(f"data.streaming: the task {r.task!r} cannot stream its data")
            if r.train.max_steps is None:
                raise ConfigError("data.streaming: the length of a streamed data set is unknown; set train.max_steps")
            train_options["streaming"] = True
        self.train_dataset = self.task.load_dataset(r.data.train, self.tokenizer, **train_options)
        self.eval_dataset = (self.task.load_dataset(r.data.eval, self.tokenizer, **data_options)
                             if r.data.eval else None)
        if self.eval_dataset is None and r.train.evaluate_options is not None:
            logger.warning("train.evaluate_options is set but data.eval is not: there is no held-out set to evaluate")

    def _build_model(self, model_cls: Any) -> None:
        r = self.recipe
        mesh = None
        if r.mesh:
            from twinkle_core.mesh import DeviceMesh

            mesh = DeviceMesh.for_job(dict(r.mesh))
        self.mesh = mesh
        self.model = model_cls(
            model_id=self.model_dir,
            config=r.model.config,
            strategy=r.strategy.name,
            strategy_options=dict(r.strategy.options),
            mesh=mesh,
            precision=r.precision,
            task=self.task,
            tokenizer=self.tokenizer,
            trust_remote_code=self.trust_remote_code,
            attn_implementation=r.model.attn_implementation,
            gradient_checkpointing=r.model.gradient_checkpointing,
            seed=r.train.seed,
            **r.model.options,
        )
        model, name = self.model, self.adapter_name
        self.task.prepare_model(model)
        if r.model.adapter:
            model.add_adapter_to_model(ADAPTER_NAME, dict(r.model.adapter))
        loss_name = r.loss.name or getattr(self.task, "default_loss", "") or None
        if loss_name is None:
            raise ConfigError(f"loss.name: the task {r.task!r} has no default loss; set loss.name")
        model.set_loss(loss_name, adapter_name=name, **{**self.task.loss_options(loss_name), **r.loss.options})
        model.set_optimizer(r.optimizer.name, adapter_name=name, lr=r.optimizer.lr,
                            weight_decay=r.optimizer.weight_decay, **r.optimizer.options)

    def _build_loader_and_schedule(self) -> None:
        r, model, name = self.recipe, self.model, self.adapter_name
        self.dp_rank, self.dp_size = self._data_parallel_coords()
        # before any resume: what a task precomputes with the model (reference log-probs) uses its initial weights
        self.train_dataset = self.task.prepare_dataset(model, self.train_dataset, split="train",
                                                       output_dir=str(self.output_dir))
        if self.eval_dataset is not None:
            self.eval_dataset = self.task.prepare_dataset(model, self.eval_dataset, split="eval",
                                                          output_dir=str(self.output_dir))
        self.loader = self._make_loader(self.train_dataset, shuffle=r.data.shuffle)
        streaming = getattr(self.loader, "is_streaming", False)
        micro_batches = 1 if streaming else len(self.loader)  # streaming: unknown (train.max_steps is required)
        ga = r.train.gradient_accumulation_steps
        if micro_batches == 0:
            raise ConfigError(f"data.train ({r.data.train}) yields no batches for this rank (data.batch_size="
                              f"{r.data.batch_size}, {self.dp_size or 1} data-parallel ranks)")
        if r.train.max_steps is not None:
            self.total_steps = r.train.max_steps
        else:
            self.total_steps = (r.train.num_epochs * micro_batches * self.task.micro_batches_per_data_batch(r.data.batch_size)) // ga
            if self.total_steps == 0:
                raise ConfigError(
                    f"train.gradient_accumulation_steps={ga} needs {ga} micro-batches per optimizer step but "
                    f"data.train yields only {micro_batches} per epoch on this rank; lower it or raise "
                    f"train.num_epochs")
        self.micro_batches_per_epoch = "unknown (streaming)" if streaming else micro_batches
        s = r.lr_scheduler
        warmup = s.warmup_steps if s.warmup_steps is not None else int(round((s.warmup_ratio or 0.0)
                                                                             * self.total_steps))
        model.set_lr_scheduler(s.name, adapter_name=name, num_training_steps=self.total_steps,
                               num_warmup_steps=warmup, **s.options)

    def _data_parallel_coords(self) -> tuple[int | None, int | None]:
        strategy = getattr(self.model, "strategy", None)
        rank, size = getattr(strategy, "dp_rank", None), getattr(strategy, "dp_size", None)
        if isinstance(rank, int) and isinstance(size, int) and not isinstance(rank, bool):
            return rank, size
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None, None
        world, rank = dist.get_world_size(), dist.get_rank()
        mesh = self.mesh
        if mesh is None or mesh.data_parallel_size == world:
            return rank, world
        if mesh.data_parallel_size == 1:
            return 0, 1
        raise ConfigError(
            f"mesh has {mesh.data_parallel_size} data-parallel ranks out of {world}, but the model's strategy does "
            f"not say which one this process is (strategy.dp_rank); this model class cannot be trained with that mesh")

    def _make_loader(self, dataset: Any, *, shuffle: bool) -> Any:
        r = self.recipe
        seed = r.data.seed if r.data.seed is not None else r.train.seed
        if getattr(dataset, "is_streaming", False):
            from twinkle_core.data.streaming import StreamingDataLoader

            return StreamingDataLoader(dataset, r.data.batch_size, self.task.collate, dp_rank=self.dp_rank,
                                       dp_size=self.dp_size)
        cls = dataloader_class()
        return cls(dataset, r.data.batch_size, self.task.collate, shuffle=shuffle, seed=seed, drop_last=False,
                   dp_rank=self.dp_rank, dp_size=self.dp_size)

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

    def _mark_boundary(self) -> None:
        """Remember the state after a complete optimizer step (what an interrupted checkpoint saves)."""
        self._boundary = self._state()

    def _state(self) -> dict[str, Any]:
        """The counters and positions a checkpoint of the current step holds besides the model's own state."""
        return {"step": self.step, "epoch": self.epoch, "loader": self.loader.state_dict(),
                "task": self.task.state_dict()}

    # ------------------------------------------------------------------ checkpoints
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

    # ------------------------------------------------------------------ evaluation
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

    def _report_startup(self, first_step: tuple[float, float]) -> None:
        """Where the time up to the end of the first optimizer step of this run went (``summary["startup"]``);
        ``first_step`` is ``(perf_counter, process_time)`` when that step began."""
        timer = self.startup_timer
        timer.add("first_step", time.perf_counter() - first_step[0], time.process_time() - first_step[1])
        self.startup = timer.report()
        if self.is_main:
            logger.debug("start-up (s): %s", timer.format(self.startup))

    def _check_step(self, stop: StopSignals, finite: bool = True, label_tokens: float | None = None) -> None:
        self.guard.check(stop, step=self.step, total_steps=self.total_steps, finite=finite, label_tokens=label_tokens,
                         global_sum=self._global_sum)

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
