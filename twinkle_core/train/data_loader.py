"""A training data loader from data files in one call, built the way ``twinkle train`` builds it.

:func:`build_loader` is the recipe's ``data:`` section as keyword arguments: it fills a
:class:`~twinkle_core.train.recipe.DataConfig` and hands it to the trainer's own
:func:`~twinkle_core.train.build.load_datasets` and :func:`~twinkle_core.train.build.make_loader`, so a script
reads, validates, templates, packs, shards and collates its data exactly as a recipe would.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError

#: the error of a loader asked for without a tokenizer: what to pass instead
NO_TOKENIZER = ("build_loader needs a tokenizer to tokenise the data: pass tokenizer= (a transformers tokenizer), or "
                "model= a model that has one (TransformersModel(..., tokenizer=<directory or hf://org/name>) sets "
                "model.tokenizer; a model built from a model directory or hub id with a tokenizer has it already)")


def build_loader(train: str | os.PathLike[str] | list[Any], *, model: Any = None, tokenizer: Any = None,
                 task: Any = None, mode: str | None = None, max_length: int | None = None,
                 packing: bool | None = None, template: str | None = None, columns: dict[str, str] | None = None,
                 batch_size: int = 1, shuffle: bool = True, seed: int = 0,
                 cache_dir: str | os.PathLike[str] | None = None, options: dict[str, Any] | None = None) -> Any:
    """A data loader over ``train`` yielding collated batches for ``model.forward_backward(inputs=batch)``.

    The same path as a recipe's ``data:`` section under ``twinkle train``: ``train`` is any data spec a recipe's
    ``data.train`` takes (a ``.jsonl`` / ``.json`` / ``.parquet`` file, a directory, ``hf://org/name``, or a list of
    sources to concatenate or mix by weight); ``mode``, ``max_length``, ``packing``, ``template``, ``columns``,
    ``batch_size``, ``shuffle`` and ``seed`` are the ``data.*`` keys of the same names (``seed`` also mixes a list of
    sources); ``options`` are further keyword arguments for the task's ``load_dataset`` (``data.options``).
    ``cache_dir``: keep the tokenised data there for the next run (default: no cache).

    ``model``: its ``tokenizer`` (unless ``tokenizer=`` is given), its task (unless ``task=`` is given) and its
    data-parallel rank, so that each process reads its own share. ``task``: a registered task name or a task
    instance (default: the model's task, else ``causal_lm``); the loader collates with it. A task that prepares
    its data with the model (DPO's precomputed reference log-probs) also needs ``task.prepare_dataset`` and
    ``task.prepare_batch``, which ``twinkle train`` calls.

    One pass over the loader is one epoch; ``loader.set_epoch(n)`` reshuffles for epoch ``n`` and
    ``loader.state_dict()`` / ``load_state_dict`` resume it::

        from twinkle.data import build_loader
        from twinkle.model import TransformersModel

        model = TransformersModel(model_id="hf://Qwen/Qwen2.5-0.5B-Instruct")   # model.tokenizer: its own
        loader = build_loader("train.jsonl", model=model, mode="chat", max_length=1024, batch_size=4)
        for batch in loader:
            model.forward_backward(inputs=batch)
            model.clip_grad_and_step()
    """
    from twinkle_core.train import build
    from twinkle_core.train.recipe import DataConfig, Recipe, TrainConfig

    if tokenizer is None:
        tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        raise ConfigError(NO_TOKENIZER)
    task = _task_of(task, model)
    data = DataConfig(train=os.fspath(train) if isinstance(train, os.PathLike) else train, mode=mode,
                      max_length=max_length, packing=packing, template=template, columns=columns,
                      batch_size=batch_size, shuffle=shuffle, seed=seed,
                      cache_dir=os.fspath(cache_dir) if cache_dir is not None else False, options=dict(options or {}))
    recipe = Recipe(task=getattr(task, "name", None) or type(task).__name__, data=data, train=TrainConfig(seed=seed))
    problems = list(task.check_recipe(recipe))
    if problems:
        raise ConfigError("build_loader (data.<key> is its <key>= argument): " + "; ".join(problems))
    dataset, _ = build.load_datasets(recipe, task, tokenizer, Path.cwd())
    return build.make_loader(recipe, task, dataset, _data_parallel(model), shuffle=shuffle)


def _task_of(task: Any, model: Any) -> Any:
    """The task instance: ``task`` itself, the registered task of that name, the model's, or ``causal_lm``."""
    if task is None:
        task = getattr(model, "task", None) or "causal_lm"
    if isinstance(task, str):
        from twinkle_core.plugins import get_plugins

        return get_plugins().load("task", task)()
    return task


def _data_parallel(model: Any) -> Any:
    """The model's data-parallel view, or every process as a data-parallel rank when there is no model."""
    if model is not None:
        return model.data_parallel
    from twinkle_core.model.data_parallel import DataParallelView

    return DataParallelView.of_world()
