"""The schema of ``TwinkleModel.get_train_configs()`` and its checker."""

from __future__ import annotations

import pytest

from twinkle_core.model.train_configs import check_train_configs


def configs(**changes):
    conforming = {"class": "M", "adapter_name": None, "adapters": [], "strategy": {"name": "single"},
                  "precision": "no", "optimizer": {"name": "AdamW", "lr": 1e-3}, "lr_scheduler": None, "loss": None,
                  "lr": 1e-3, "gradient_accumulation_steps": 1, "dp_rank": 0, "dp_size": 1,
                  "trainable_parameters": 10, "step": 0, "skipped_steps": 0}
    return {**conforming, **changes}


def test_a_conforming_result_has_no_problems():
    assert check_train_configs(configs()) == []
    assert check_train_configs(configs(optimizer=None, lr=None, adapter_name="a", adapters=["a"])) == []


def test_missing_keys_are_named():
    incomplete = configs()
    del incomplete["lr"], incomplete["class"]
    assert check_train_configs(incomplete) == ["missing key 'class' (str)", "missing key 'lr' (float | None)"]


@pytest.mark.parametrize(("key", "value"), [("step", True), ("dp_size", 1.0), ("lr", "1e-3"), ("adapters", ("a",)),
                                            ("strategy", "single"), ("adapter_name", 3)])
def test_wrong_types_are_problems(key, value):
    [problem] = check_train_configs(configs(**{key: value}))
    assert problem.startswith(f"{key!r} must be")


def test_an_integer_learning_rate_is_a_float():
    assert check_train_configs(configs(lr=1, optimizer={"name": "SGD", "lr": 1})) == []


@pytest.mark.parametrize(("changes", "words"), [
    ({"strategy": {"mesh": None}}, "'strategy' must carry its 'name'"),
    ({"loss": {"reduction": "sum"}}, "'loss' must carry its 'name'"),
    ({"lr": None}, "the learning rate is known exactly when an optimizer is set"),
    ({"optimizer": None}, "the learning rate is known exactly when an optimizer is set"),
    ({"adapter_name": "a"}, "'adapter_name' 'a' is not among 'adapters'"),
    ({"adapters": [1]}, "'adapters' must list adapter names"),
    ({"dp_rank": 2, "dp_size": 2}, "'dp_rank' 2 is not in range(dp_size=2)"),
    ({"gradient_accumulation_steps": 0}, "'gradient_accumulation_steps' must be >= 1"),
    ({"step": -1}, "'step' must be >= 0"),
])
def test_inconsistent_values_are_problems(changes, words):
    [problem] = check_train_configs(configs(**changes))
    assert words in problem


def test_not_a_dict():
    assert check_train_configs(None) == ["get_train_configs() must return a dict, got NoneType"]
