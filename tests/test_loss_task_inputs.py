"""A loss that reads batch features only some tasks produce (``Loss.requires``) is refused, before anything is
built, with a task that does not produce them (``Task.provides``), naming the task that does."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from twinkle_core import LossRecord, ModelRecord, TaskRecord, hookimpl
from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import Loss, LossOutput
from twinkle_core.plugins import TwinklePlugins
from twinkle_core.task import Task
from twinkle_core.train.recipe import recipe_from_dict, validate_components

FAKES = "twinkle_test_loss_task_inputs"
sys.modules.setdefault(FAKES, sys.modules[__name__])


class PairLoss(Loss):
    name = "pair_loss"
    requires = frozenset({"answer_pairs"})

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any], context: Any = None) -> LossOutput:
        raise AssertionError("never called by these tests")


class PairTask(Task):
    name = "pairs"
    provides = frozenset({"answer_pairs"})

    def load_dataset(self, path: str, tokenizer: Any, **options: Any) -> list:
        return []

    def collate(self, features: list) -> dict:
        return {}


@hookimpl
def twinkle_register_losses():
    yield LossRecord("pair_loss", f"{FAKES}:PairLoss")


@hookimpl
def twinkle_register_models():
    yield ModelRecord("ReferenceModel", "twinkle_core.testing.reference:ReferenceModel")


@hookimpl
def twinkle_register_tasks():
    yield TaskRecord("pairs", f"{FAKES}:PairTask")


def _recipe(task: str, loss: str) -> Any:
    return recipe_from_dict({"task": task, "loss": {"name": loss},
                             "model": {"class_name": "ReferenceModel", "model_id": "/m"},
                             "data": {"train": "/d"}})


def test_a_loss_without_its_inputs_is_refused_and_the_providing_task_is_named():
    plugins = TwinklePlugins(autoload=False, disabled=[], extra_modules=[FAKES])
    with pytest.raises(ConfigError) as info:
        validate_components(_recipe("causal_lm", "pair_loss"), plugins)
    assert str(info.value) == ("loss.name: the loss 'pair_loss' needs batches with answer_pairs, which the task "
                               "'causal_lm' does not produce; use task: 'pairs'")
    validate_components(_recipe("pairs", "pair_loss"), plugins)


def test_no_providing_task_installed_says_so():
    plugins = TwinklePlugins(autoload=False, disabled=[], extra_modules=[FAKES])
    PairTask.provides = frozenset()
    try:
        with pytest.raises(ConfigError, match="no installed task provides them"):
            validate_components(_recipe("causal_lm", "pair_loss"), plugins)
    finally:
        PairTask.provides = frozenset({"answer_pairs"})
