"""The core's one LoRA-settings type (``twinkle_core.lora``): what every backend reads an adapter config into."""

from __future__ import annotations

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.lora import LoraSettings

peft = pytest.importorskip("peft")


def test_a_dict_is_read_with_peft_s_names_and_defaults():
    settings = LoraSettings.from_config({"type": "lora", "r": 4, "target_modules": ["q_proj"]}, backend="x")
    assert (settings.r, settings.alpha, settings.dropout, settings.target_modules) == (4, 8, 0.0, ["q_proj"])
    assert (settings.bias, settings.use_rslora, settings.init_lora_weights) == ("none", False, True)
    built = settings.to_peft()
    assert isinstance(built, peft.LoraConfig) and (built.r, built.lora_alpha) == (4, 8)


def test_a_peft_config_is_read_and_given_back_as_is():
    config = peft.LoraConfig(r=2, lora_alpha=6, lora_dropout=0.1, target_modules="all-linear", use_rslora=True)
    settings = LoraSettings.from_config(config, backend="x")
    assert (settings.r, settings.alpha, settings.dropout, settings.use_rslora) == (2, 6, 0.1, True)
    assert settings.to_peft() is config


def test_another_framework_s_name_is_refused_with_peft_s():
    with pytest.raises(ConfigError, match=r"unknown LoRA option\(s\) \['alpha'\]; did you mean 'lora_alpha' for "
                                          r"'alpha'\?"):
        LoraSettings.from_config({"r": 8, "alpha": 16}, backend="x")



def test_the_hf_backend_reads_dicts_through_it():
    adapters = pytest.importorskip("twinkle_backend_hf.adapters")
    built = adapters.to_peft_config({"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    assert isinstance(built, peft.LoraConfig) and (built.r, built.lora_alpha) == (4, 8)
    with pytest.raises(ConfigError, match=r"\['exclude_modules'\] are not supported by the HF backend"):
        adapters.to_peft_config({"r": 4, "exclude_modules": ["x"]})
