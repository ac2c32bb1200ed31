"""One construction spec: the trainer builds every model class from a ModelSpec, and the recipe's reserved
``model.options`` keys are the spec's fields."""

from __future__ import annotations

import dataclasses

import pytest

from twinkle_core.model.spec import RECIPE_KEYS, ModelSpec
from twinkle_core.train.recipe.schema import CONSTRUCTOR_KEYS


def test_every_field_but_the_class_options_has_a_recipe_key():
    fields = {f.name for f in dataclasses.fields(ModelSpec)} - {"options"}
    assert set(RECIPE_KEYS) == fields == CONSTRUCTOR_KEYS


def test_the_spec_builds_a_model_with_its_fields_and_the_class_options():
    class Recorder:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    built = ModelSpec(seed=3, strategy_options={"a": 1}, options={"max_lora_rank": 8}).build(Recorder)
    assert set(built.kwargs) == CONSTRUCTOR_KEYS | {"max_lora_rank"}
    assert built.kwargs["seed"] == 3 and built.kwargs["strategy_options"] == {"a": 1}


def test_the_backends_take_the_spec():
    pytest.importorskip("twinkle_backend_hf")
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_backend_hf.testing import tiny_qwen2_config

    model = ModelSpec(config=tiny_qwen2_config(), seed=3, options={"auto_class": None}).build(TransformersModel)
    assert model.seed == 3 and model.init_arguments["gradient_checkpointing"] is False


def test_class_options_cannot_shadow_a_field():
    with pytest.raises(ValueError, match=r"may not set \['seed'\]"):
        ModelSpec(options={"seed": 1}).arguments()
