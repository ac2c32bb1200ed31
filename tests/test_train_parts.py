"""The trainer's parts as values: the task's own recipe rules (``Task.check_recipe``), the data-parallel view a run
shards its data by, the batch stream over epochs, and the default loss the trainer sets."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from twinkle_core import TaskRecord, hookimpl
from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh
from twinkle_core.model.data_parallel import DataParallelView
from twinkle_core.plugins import reset_plugins
from twinkle_core.task import Task
from twinkle_core.train import build
from twinkle_core.train.batches import BatchStream
from twinkle_core.train.recipe import recipe_from_dict

FAKES = "twinkle_test_train_parts"
sys.modules.setdefault(FAKES, sys.modules[__name__])

MINIMAL = {"model": {"model_id": "/models/tiny"}, "data": {"train": "/data/train.jsonl"}}


class ShortTask(Task):
    """Refuses ``data.max_length`` above 8 in its own words."""

    name = "short"

    @classmethod
    def check_recipe(cls, recipe: Any) -> list[str]:
        length = recipe.data.max_length
        return [f"data.max_length: the short task reads at most 8 tokens, got {length}"] if (length or 0) > 8 else []

    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> Any:
        return []

    def collate(self, features: list[Any]) -> dict[str, Any]:
        return {}


class NoDefaultLossTask(ShortTask):
    name = "no_default_loss"


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("short", f"{FAKES}:ShortTask")


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setenv("TWINKLE_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("TWINKLE_PLUGINS", FAKES)
    reset_plugins()
    yield
    reset_plugins()


def test_the_recipe_checker_asks_the_task(registry):
    assert recipe_from_dict({**MINIMAL, "task": "short"}).task == "short"
    with pytest.raises(ConfigError) as info:
        recipe_from_dict({**MINIMAL, "task": "short", "data": {"train": "d", "max_length": 16},
                          "optimizer": {"lr": -1}})
    assert info.value.args[0].splitlines()[1:] == [  # the task's rules come after the data rules, before training's
        "  data.max_length: the short task reads at most 8 tokens, got 16", "  optimizer.lr: must be > 0, got -1.0"]


def test_a_task_without_rules_and_an_unknown_task_add_nothing(registry):
    assert Task.check_recipe(recipe_from_dict(MINIMAL)) == []
    # an uninstalled task is reported later, with its key, by validate_plugin_names
    assert recipe_from_dict({**MINIMAL, "task": "not_installed", "data": {"train": "d", "mode": "sft"}})


def test_causal_lm_rules_live_in_the_task():
    from twinkle_core.tasks.causal_lm import CausalLMTask

    recipe = recipe_from_dict(MINIMAL)
    recipe.data.mode, recipe.task_options = "sft", {"truncation": "middle"}
    assert CausalLMTask.check_recipe(recipe) == [
        "data.mode: must be 'chat' or 'pretrain', got 'sft'",
        "task_options.truncation: must be one of 'right', 'left', 'error', got 'middle'"]


def view_model(rank: int, size: int) -> Any:
    return SimpleNamespace(data_parallel=DataParallelView(rank, size))


def test_the_run_shards_by_the_models_data_parallel_view(monkeypatch):
    monkeypatch.setattr(build.distributed, "world_size", lambda: 4)
    assert build.data_parallel_of(view_model(1, 2), DeviceMesh(dp=2, tp=2)) == DataParallelView(1, 2)
    assert build.data_parallel_of(view_model(3, 4), None) == DataParallelView(3, 4)
    # a view counting every process under a mesh with model parallelism: it cannot know its share
    assert build.data_parallel_of(view_model(3, 4), DeviceMesh(dp=1, tp=4)) == DataParallelView(0, 1)
    with pytest.raises(ConfigError, match="mesh has 2 data-parallel ranks out of 4, but the model does not say"):
        build.data_parallel_of(view_model(3, 4), DeviceMesh(dp=2, tp=2))


class Loader:
    def __init__(self, epochs: list[list[int]]) -> None:
        self.epochs, self.epoch = epochs, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(self.epochs[min(self.epoch, len(self.epochs) - 1)])


def test_the_batch_stream_moves_to_the_next_epoch():
    loader = Loader([[1, 2], [3]])
    stream = BatchStream(loader)
    assert [stream.next_batch() for _ in range(4)] == [1, 2, 3, 3]
    assert stream.epoch == loader.epoch == 2
    with pytest.raises(ConfigError, match="yields no batches"):
        BatchStream(Loader([[]])).next_batch()


def test_the_trainer_sets_the_default_loss_rule():
    calls: dict[str, Any] = {}

    class Model:
        def __init__(self, **kwargs: Any) -> None:
            pass

        def set_loss(self, name: str, **kwargs: Any) -> None:
            calls["loss"] = name

        def set_optimizer(self, name: str, **kwargs: Any) -> None:
            calls["optimizer"] = name

    recipe = recipe_from_dict(MINIMAL)
    build.build_model(recipe, Model, NoDefaultLossTask(), None, model_dir=None, mesh=None, trust=False,
                      adapter_name=None)
    assert calls == {"loss": "cross_entropy", "optimizer": "AdamW"}  # twinkle_core.task.default_loss_name
