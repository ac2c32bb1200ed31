"""An attention kernel that is not installed is a ConfigError that says what to do, not a bare ImportError."""

from __future__ import annotations

import importlib.util

import pytest
from twinkle_backend_hf.model import TransformersModel

from twinkle_core.errors import ConfigError

TINY = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_without_the_package_names_the_fix():
    with pytest.raises(ConfigError, match=r"attn_implementation='flash_attention_2'.*pip install flash-attn.*sdpa"):
        TransformersModel(config=TINY, attn_implementation="flash_attention_2")


def test_an_installed_implementation_builds():
    model = TransformersModel(config=TINY, attn_implementation="sdpa")
    assert model.hf_model.config._attn_implementation == "sdpa"
