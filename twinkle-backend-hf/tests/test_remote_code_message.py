"""A model or tokenizer whose code Twinkle may not run says which Twinkle switch allows it."""

from __future__ import annotations

import json

import pytest
from twinkle_backend_hf.model import TransformersModel

from twinkle_core.errors import ConfigError

REMOTE_CONFIG = '''
from transformers import PretrainedConfig


class TinyRemoteConfig(PretrainedConfig):
    model_type = "tiny_remote_message"
'''


@pytest.fixture
def remote_code_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("TWINKLE_TRUST_REMOTE_CODE", raising=False)
    (tmp_path / "configuration_tiny_remote.py").write_text(REMOTE_CONFIG)
    auto_map = {"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
                "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM",
                "AutoTokenizer": ["tokenization_tiny_remote.TinyRemoteTokenizer", None]}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tiny_remote_message", "auto_map": auto_map}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": auto_map[
        "AutoTokenizer"]}}))
    return tmp_path


def check(message: str) -> None:
    assert "model.trust_remote_code: true" in message
    assert "TWINKLE_TRUST_REMOTE_CODE=1" in message
    assert "pass the argument" not in message


def test_untrusted_model_names_the_recipe_key_and_variable(remote_code_dir):
    with pytest.raises(ConfigError) as info:
        TransformersModel(model_id=str(remote_code_dir))
    check(str(info.value))
    assert str(remote_code_dir) in str(info.value)


def test_untrusted_tokenizer_names_the_recipe_key_and_variable(remote_code_dir):
    with pytest.raises(ConfigError) as info:
        TransformersModel.load_tokenizer(str(remote_code_dir))
    check(str(info.value))


def test_garbled_trust_variable_is_one_config_error(remote_code_dir, monkeypatch):
    monkeypatch.setenv("TWINKLE_TRUST_REMOTE_CODE", "maybe")
    with pytest.raises(ConfigError, match="TWINKLE_TRUST_REMOTE_CODE='maybe'"):
        TransformersModel(model_id=str(remote_code_dir))
