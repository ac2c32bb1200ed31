"""The keyword arguments the trainer passes to ``Task.load_dataset`` (and recipe validation to
``Task.check_data``), from a recipe."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from twinkle_core.task import Task
from twinkle_core.train.recipe.schema import Recipe

#: the ``data`` keys passed to ``load_dataset`` when the recipe sets them
DATA_KEYS = ("max_length", "mode", "packing", "template", "columns")


def keyword_parameters(function: Any) -> set[str]:
    """The named parameters ``function`` takes (not ``**kwargs``)."""
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # pragma: no cover
        return set()


def data_options(recipe: Recipe, task: Task, output_dir: Path) -> dict[str, Any]:
    """The keyword arguments of ``task.load_dataset``: ``data.options`` plus the ``data`` keys the recipe sets, the
    mixing seed of a list of sources and the tokenised-data cache where the task takes one."""
    d = recipe.data
    options = dict(d.options)
    options.update({key: getattr(d, key) for key in DATA_KEYS if getattr(d, key) is not None})
    if isinstance(d.train, list) or isinstance(d.eval, list):  # mixing several sources
        options["seed"] = d.seed if d.seed is not None else recipe.train.seed
    accepted = keyword_parameters(task.load_dataset)
    if "trust_remote_code" in accepted:  # a task that loads a processor or other repository files itself
        from twinkle_core.sources.resolve import trust_remote_code

        options["trust_remote_code"] = trust_remote_code(recipe.model.trust_remote_code)
    if "cache_dir" in accepted and d.cache_dir is not False \
            and "cache_dir" not in options:
        options["cache_dir"] = str(output_dir / "data_cache") if d.cache_dir in (None, True) else str(d.cache_dir)
    return options
