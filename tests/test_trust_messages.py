"""Remote-code refusals name Twinkle's switches; a garbled TWINKLE_TRUST_REMOTE_CODE is one clear error."""

from __future__ import annotations

import pytest

from twinkle_core.envflags import env_flag
from twinkle_core.errors import ConfigError
from twinkle_core.sources import resolve

HF_REFUSAL = ("The repository /models/x contains custom code which must be executed to correctly load the model. "
              "You can inspect the repository content at /models/x .\n Please pass the argument "
              "`trust_remote_code=True` to allow custom code to be run.")


@pytest.mark.parametrize("raw", ["maybe", "2", "enable"])
def test_garbled_trust_flag_is_a_config_error_naming_variable_and_values(monkeypatch, raw):
    monkeypatch.setenv("TWINKLE_TRUST_REMOTE_CODE", raw)
    with pytest.raises(ConfigError) as info:
        resolve.trust_remote_code(None)
    message = str(info.value)
    assert "TWINKLE_TRUST_REMOTE_CODE" in message and repr(raw) in message
    for accepted in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        assert accepted in message
    assert resolve.trust_remote_code(False) is False  # an explicit value never reads the variable


def test_env_flag_errors_are_config_errors(monkeypatch):
    monkeypatch.setenv("TWINKLE_SOME_FLAG", "perhaps")
    with pytest.raises(ConfigError, match="TWINKLE_SOME_FLAG='perhaps'"):
        env_flag("TWINKLE_SOME_FLAG")


def test_remote_code_refusal_names_the_recipe_key_and_the_variable():
    with pytest.raises(ConfigError) as info, resolve.explain_remote_code_refusal("the model '/models/x'"):
        raise ValueError(HF_REFUSAL)
    message = str(info.value)
    assert "the model '/models/x'" in message
    assert "model.trust_remote_code: true" in message and "TWINKLE_TRUST_REMOTE_CODE=1" in message
    assert "pass the argument" not in message
    assert isinstance(info.value.__cause__, ValueError)


def test_other_value_errors_pass_through():
    with pytest.raises(ValueError, match="^unrelated$"), resolve.explain_remote_code_refusal("the model 'x'"):
        raise ValueError("unrelated")
