"""Building a run's components from its recipe: task, tokenizer, datasets, model, loss, optimizer,
scheduler and data loader (see the model constructor convention in :mod:`twinkle_core.train.loop`).

:class:`BuildMixin` is the part of :class:`twinkle_core.train.loop.Trainer` that does it; the module-level
helpers are functions rather than methods so that tests can patch them.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.train.recipe import validate_plugin_names

logger = logging.getLogger("twinkle.train")

#: the adapter the loop adds with ``model.adapter`` and names in every later model call
ADAPTER_NAME = "default"


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


class BuildMixin:
    """:meth:`build` and its steps; the trainer supplies ``recipe``, ``output_dir``, ``adapter_name`` and
    ``startup_timer``, and gets ``task``, ``tokenizer``, the datasets, ``model``, ``mesh``, ``loader``,
    ``dp_rank`` / ``dp_size`` and ``total_steps``."""

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
