"""The Megatron backend's reading of the core's LoRA settings (``twinkle_core.lora``; its own tests are in the
core's tests/test_lora_settings.py)."""

from __future__ import annotations

import peft
import pytest
from twinkle_backend_megatron.lora import SUPPORTED_OPTIONS, lora_settings, to_lora_config

from twinkle_core.errors import ConfigError
from twinkle_core.lora import OPTIONS, LoraSettings


def test_what_a_backend_does_not_implement_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"\['use_dora'\] are not supported by the Megatron backend"):
        lora_settings({"r": 8, "use_dora": True})
    with pytest.raises(ConfigError, match="LoRA option use_dora is not supported by the Megatron backend"):
        lora_settings(peft.LoraConfig(r=8, use_dora=True))
    with pytest.raises(ConfigError, match="bias training"):
        lora_settings({"r": 8, "bias": "all"})
    assert SUPPORTED_OPTIONS <= OPTIONS


def test_other_configs_are_refused():
    with pytest.raises(ConfigError, match="only 'lora'"):
        LoraSettings.from_config({"type": "ia3"}, backend="the Megatron backend")
    with pytest.raises(ConfigError, match="must be a dict or a peft.LoraConfig, got int"):
        LoraSettings.from_config(8, backend="x")
    with pytest.raises(ConfigError, match="must be a dict or a peft.LoraConfig, got IA3Config"):
        to_lora_config(peft.IA3Config())
