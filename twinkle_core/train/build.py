"""Building a run from its recipe: task, tokenizer, datasets, model (with its loss, optimizer and scheduler) and
data loader (see the model constructor convention in :mod:`twinkle_core.train.loop`).

:func:`build_run` reads top to bottom, each step returning what it built, and hands back one
:class:`TrainingRun`; the trainer, checkpointing and evaluation take what they need from it. The module-level
helpers are functions rather than methods so that tests can patch them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinkle_core import distributed
from twinkle_core.errors import ConfigError
from twinkle_core.model.spec import ModelSpec
from twinkle_core.task import Task, default_loss_name
from twinkle_core.train.data_options import data_options, keyword_parameters
from twinkle_core.train.logging import StartupTimer
from twinkle_core.train.recipe import Recipe, validate_plugin_names
from twinkle_core.train.seeding import seed_everything

if TYPE_CHECKING:  # it imports torch, which this module leaves to the moment a run is built
    from twinkle_core.model.data_parallel import DataParallelView

logger = logging.getLogger("twinkle.train")

#: the adapter the loop adds with ``model.adapter`` and names in every later model call
ADAPTER_NAME = "default"

#: the ``data`` keys passed on to ``task.load_dataset`` when the recipe sets them


def dataloader_class() -> Any:
    from twinkle_core.data.loader import DataLoader

    return DataLoader


@dataclass(frozen=True)
class TrainingRun:
    """Everything a run trains with, built once from its recipe by :func:`build_run`.

    The objects it holds change as training goes (the model's weights, the loader's position); which objects
    they are does not. ``data_parallel`` says which share of the data this process reads; ``total_steps`` is the
    number of optimizer steps and ``micro_batches_per_epoch`` what the loader yields per epoch on this rank
    (``"unknown (streaming)"`` for a streamed data set).
    """

    recipe: Recipe
    output_dir: Path
    adapter_name: str | None
    task: Task
    tokenizer: Any
    model: Any
    mesh: Any
    train_dataset: Any
    eval_dataset: Any
    loader: Any
    data_parallel: DataParallelView
    total_steps: int
    micro_batches_per_epoch: int | str

    @property
    def strategy_name(self) -> str | None:
        """The strategy the model runs (the recipe may leave it to a default)."""
        return getattr(getattr(self.model, "strategy", None), "name", None) or self.recipe.strategy.name

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates at all: a held-out set, or the task's own evaluation."""
        return self.eval_dataset is not None or self.recipe.train.evaluate_options is not None

    def make_loader(self, dataset: Any, *, shuffle: bool) -> Any:
        """A data loader over ``dataset`` for this process's data-parallel share."""
        return make_loader(self.recipe, self.task, dataset, self.data_parallel, shuffle=shuffle)


def build_run(recipe: Recipe, *, output_dir: Path, adapter_name: str | None, timer: StartupTimer) -> TrainingRun:
    """Build everything ``recipe`` trains with, timing each phase on ``timer``. The task is closed again when a
    later step fails (what it started, a PPO critic or sampler threads, must not outlive a failed start)."""
    from twinkle_core.plugins import get_plugins

    with timer.phase("plugins"):
        plugins = get_plugins()
        validate_plugin_names(recipe, plugins)
    with timer.phase("imports"):  # torch, the task and the model class (after validate_components: loaded)
        seed_everything(recipe.train.seed)
        task = plugins.load("task", recipe.task)(**recipe.task_options)
    try:
        from twinkle_core.train.recipe.components import check_loss_inputs

        check_loss_inputs(recipe, task, plugins)  # a loss reading what the task does not produce: before any build
        return _build_with_task(recipe, task, plugins, output_dir=output_dir, adapter_name=adapter_name, timer=timer)
    except BaseException:
        task.close()
        raise


def _build_with_task(recipe: Recipe, task: Task, plugins: Any, *, output_dir: Path, adapter_name: str | None,
                     timer: StartupTimer) -> TrainingRun:
    from twinkle_core.sources.resolve import trust_remote_code

    with timer.phase("imports"):
        model_cls = plugins.load("model", recipe.model.class_name)
    trust = trust_remote_code(recipe.model.trust_remote_code)
    with timer.phase("tokenizer"):
        model_dir, tokenizer = load_tokenizer(recipe, model_cls, trust)
    with timer.phase("data"):
        train_dataset, eval_dataset = load_datasets(recipe, task, tokenizer, output_dir)
    with timer.phase("model"):
        mesh = build_mesh(recipe)
        model = build_model(recipe, model_cls, task, tokenizer, model_dir=model_dir, mesh=mesh, trust=trust,
                            adapter_name=adapter_name, output_dir=output_dir)
    with timer.phase("setup"):
        view = data_parallel_of(model, mesh)
        # before any resume: what a task precomputes with the model (reference log-probs) uses its initial weights
        train_dataset = task.prepare_dataset(model, train_dataset, split="train", output_dir=str(output_dir))
        if eval_dataset is not None:
            eval_dataset = task.prepare_dataset(model, eval_dataset, split="eval", output_dir=str(output_dir))
        loader = make_loader(recipe, task, train_dataset, view, shuffle=recipe.data.shuffle)
        total_steps, micro_batches_per_epoch = count_steps(recipe, task, loader, view)
        set_schedule(recipe, model, total_steps, adapter_name)
    return TrainingRun(recipe=recipe, output_dir=output_dir, adapter_name=adapter_name, task=task,
                       tokenizer=tokenizer, model=model, mesh=mesh, train_dataset=train_dataset,
                       eval_dataset=eval_dataset, loader=loader, data_parallel=view, total_steps=total_steps,
                       micro_batches_per_epoch=micro_batches_per_epoch)


def load_tokenizer(recipe: Recipe, model_cls: Any, trust: bool) -> tuple[str | None, Any]:
    """``(the model's local directory or None, the tokenizer)``: the model class loads it, from ``model.tokenizer``
    or the model's own directory."""
    from twinkle_core.sources.resolve import resolve_model

    m = recipe.model
    model_dir = resolve_model(m.model_id, revision=m.revision) if m.model_id else None
    tokenizer_uri = m.tokenizer or m.model_id
    tokenizer_dir = model_dir if tokenizer_uri == m.model_id and model_dir is not None else resolve_model(tokenizer_uri)
    return model_dir, model_cls.load_tokenizer(tokenizer_dir, trust_remote_code=trust)


def load_datasets(recipe: Recipe, task: Task, tokenizer: Any, output_dir: Path) -> tuple[Any, Any]:
    """``(training set, held-out set or None)`` as the task loads them."""
    r = recipe
    options = data_options(recipe, task, output_dir)
    train_options = dict(options)
    if r.data.streaming:
        if "streaming" not in keyword_parameters(task.load_dataset):
            raise ConfigError(f"data.streaming: the task {r.task!r} cannot stream its data")
        if r.train.max_steps is None:
            raise ConfigError("data.streaming: the length of a streamed data set is unknown; set train.max_steps")
        train_options["streaming"] = True
    train_dataset = task.load_dataset(r.data.train, tokenizer, **train_options)
    eval_dataset = task.load_dataset(r.data.eval, tokenizer, **options) if r.data.eval else None
    if eval_dataset is None and r.train.evaluate_options is not None:
        logger.warning("train.evaluate_options is set but data.eval is not: there is no held-out set to evaluate")
    return train_dataset, eval_dataset


def build_mesh(recipe: Recipe) -> Any:
    """The recipe's device mesh for this job, or None when the strategy decides."""
    if not recipe.mesh:
        return None
    from twinkle_core.mesh import DeviceMesh

    return DeviceMesh.for_job(dict(recipe.mesh))


def build_model(recipe: Recipe, model_cls: Any, task: Task, tokenizer: Any, *, model_dir: str | None, mesh: Any,
                trust: bool, adapter_name: str | None, output_dir: Path | None = None) -> Any:
    """The model, prepared by the task, with the recipe's adapter, loss and optimizer set; with an adapter, a base
    that exists nowhere else is saved in ``output_dir`` first (``TwinkleModel.save_base``)."""
    r = recipe
    model = ModelSpec(
        model_id=model_dir, config=r.model.config, strategy=r.strategy.name, strategy_options=r.strategy.options,
        mesh=mesh, precision=r.precision, task=task, tokenizer=tokenizer, trust_remote_code=trust,
        attn_implementation=r.model.attn_implementation, gradient_checkpointing=r.model.gradient_checkpointing,
        seed=r.train.seed, options=r.model.options,
    ).build(model_cls)
    task.prepare_model(model)
    if r.model.adapter:
        if output_dir is not None:
            model.save_base(str(output_dir))
        model.add_adapter_to_model(ADAPTER_NAME, dict(r.model.adapter))
    loss_name = r.loss.name or default_loss_name(task)
    model.set_loss(loss_name, adapter_name=adapter_name, **{**task.loss_options(loss_name), **r.loss.options})
    # the model counts the micro-batches of a step itself (clip_grad_and_step steps on the last), so a task that
    # reads TrainingSetup.of(model) sees the run's accumulation, e.g. to split one rollout into that many pieces
    model.set_optimizer(r.optimizer.name, adapter_name=adapter_name, lr=r.optimizer.lr,
                        weight_decay=r.optimizer.weight_decay,
                        gradient_accumulation_steps=r.train.gradient_accumulation_steps, **r.optimizer.options)
    return model


def data_parallel_of(model: Any, mesh: Any) -> DataParallelView:
    """The model's data-parallel view (:attr:`twinkle_core.model.base.TwinkleModel.data_parallel`), checked against
    the recipe's mesh. A view that counts every process while the mesh has model-parallel ranks comes from a model
    that knows only the world: with one data-parallel rank every process reads the same data; otherwise it cannot
    be told which share this process reads, and the run is refused."""
    view = model.data_parallel
    world = distributed.world_size()
    if mesh is None or world <= 1 or view.size != world or mesh.data_parallel_size == world:
        return view
    if mesh.data_parallel_size == 1:
        from twinkle_core.model.data_parallel import DataParallelView

        return DataParallelView(0, 1)
    raise ConfigError(
        f"mesh has {mesh.data_parallel_size} data-parallel ranks out of {world}, but the model does not say which one "
        f"this process is (its data_parallel view counts every process); this model class cannot be trained with "
        f"that mesh")


def make_loader(recipe: Recipe, task: Task, dataset: Any, view: DataParallelView, *, shuffle: bool) -> Any:
    """A data loader over ``dataset`` yielding this data-parallel rank's share, collated by the task."""
    r = recipe
    if getattr(dataset, "is_streaming", False):
        from twinkle_core.data.streaming import StreamingDataLoader

        return StreamingDataLoader(dataset, r.data.batch_size, task.collate, dp_rank=view.rank, dp_size=view.size)
    seed = r.data.seed if r.data.seed is not None else r.train.seed
    return dataloader_class()(dataset, r.data.batch_size, task.collate, shuffle=shuffle, seed=seed, drop_last=False,
                              dp_rank=view.rank, dp_size=view.size)


def count_steps(recipe: Recipe, task: Task, loader: Any, view: DataParallelView) -> tuple[int, int | str]:
    """``(optimizer steps of the run, micro-batches per epoch on this rank)``."""
    r = recipe
    streaming = getattr(loader, "is_streaming", False)
    micro_batches = 1 if streaming else len(loader)  # streaming: unknown (train.max_steps is required)
    ga = r.train.gradient_accumulation_steps
    if micro_batches == 0:
        raise ConfigError(f"data.train ({r.data.train}) yields no batches for this rank (data.batch_size="
                          f"{r.data.batch_size}, {view.size} data-parallel ranks)")
    per_epoch: int | str = "unknown (streaming)" if streaming else micro_batches
    if r.train.max_steps is not None:
        return r.train.max_steps, per_epoch
    total = (r.train.num_epochs * micro_batches * task.micro_batches_per_data_batch(r.data.batch_size, gradient_accumulation_steps=ga)) // ga
    if total == 0:
        raise ConfigError(
            f"train.gradient_accumulation_steps={ga} needs {ga} micro-batches per optimizer step but "
            f"data.train yields only {micro_batches} per epoch on this rank; lower it or raise train.num_epochs")
    return total, per_epoch


def set_schedule(recipe: Recipe, model: Any, total_steps: int, adapter_name: str | None) -> None:
    """The recipe's learning-rate schedule over ``total_steps`` (warm-up in steps, or as a share of them)."""
    s = recipe.lr_scheduler
    warmup = s.warmup_steps if s.warmup_steps is not None else int(round((s.warmup_ratio or 0.0) * total_steps))
    model.set_lr_scheduler(s.name, adapter_name=adapter_name, num_training_steps=total_steps,
                           num_warmup_steps=warmup, **s.options)
