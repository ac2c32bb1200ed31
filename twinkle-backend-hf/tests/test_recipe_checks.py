"""What ``twinkle train`` (and ``--dry-run``) refuses for a TransformersModel recipe before building anything."""

from __future__ import annotations

import os

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.train.recipe import load_recipe, validate_components

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "quickstart", "recipe.yaml")


def test_a_lora_key_from_another_framework_is_refused_with_peft_s_name():
    recipe = load_recipe(QUICKSTART, ["model.adapter={r: 8, alpha: 16, target_modules: all-linear}"])
    with pytest.raises(ConfigError, match=r"model\.adapter: unknown LoRA option\(s\) \['alpha'\]; did you mean "
                                          r"'lora_alpha' for 'alpha'\?"):
        validate_components(recipe)
    validate_components(load_recipe(QUICKSTART, ["model.adapter={r: 8, lora_alpha: 16, target_modules: all-linear}"]))
