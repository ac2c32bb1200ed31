"""The default strategy is chosen through ``twinkle_select_default_strategy``: the core knows no backend's name.

The HF backend answers ``accelerate`` for a multi-process job, Megatron's plugin ``megatron`` for its models,
the core ``single`` for one process (or a class's first declared strategy); with no backend installed a
distributed job without a strategy is an error that says what to install.
"""

from __future__ import annotations

import types

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.hookspecs import hookimpl
from twinkle_core.mesh import default_strategy
from twinkle_core.plugins import TwinklePlugins, reset_plugins


@pytest.fixture
def core_only(monkeypatch):
    """The registry of twinkle-core installed alone (no entry points), plus the plugin modules given."""
    def use(*modules: types.ModuleType) -> TwinklePlugins:
        plugins = TwinklePlugins(autoload=False, extra_modules=[])
        for module in modules:
            plugins.pm.register(module)
        reset_plugins(plugins)
        return plugins

    yield use
    reset_plugins()


class AnyModel:
    supported_strategies = None


class OnlySingle:
    supported_strategies = ("single", "ddp")


def test_core_alone_runs_one_process_and_names_what_to_install_for_more(core_only):
    core_only()
    assert default_strategy(AnyModel, world_size=1) == default_strategy(None, world_size=1) == "single"
    assert default_strategy(OnlySingle, world_size=8) == "single"  # a declared strategy needs no backend
    with pytest.raises(ConfigError) as info:
        default_strategy(AnyModel, world_size=2)
    message = str(info.value)
    assert "2-process job of AnyModel" in message and "strategy.name" in message
    assert "pip install twinkle-backend-hf (accelerate, ddp, deepspeed, native_fsdp)" in message
    assert "pip install twinkle-backend-megatron (megatron)" in message


def test_a_plugin_answer_wins_over_the_core(core_only):
    chooser = types.ModuleType("chooser")

    @hookimpl
    def twinkle_select_default_strategy(model_class, world_size):
        return "mine" if model_class is AnyModel else None

    chooser.twinkle_select_default_strategy = twinkle_select_default_strategy
    core_only(chooser)
    assert default_strategy(AnyModel, world_size=1) == default_strategy(AnyModel, world_size=4) == "mine"
    assert default_strategy(OnlySingle, world_size=4) == "single"  # it declined: the core answered


def test_hf_backend_answers_as_before(core_only):
    pytest.importorskip("twinkle_backend_hf")
    from twinkle_backend_hf import plugin as hf_plugin

    core_only(hf_plugin)
    assert default_strategy(None, world_size=1) == "single"
    assert default_strategy(None, world_size=2) == default_strategy(AnyModel, world_size=8) == "accelerate"

    class MultiTenant:  # like MultiLoraTransformersModel
        supported_strategies = ("single",)

    assert default_strategy(MultiTenant, world_size=4) == "single"


def test_megatron_backend_answers_for_its_models(core_only):
    pytest.importorskip("twinkle_backend_hf")
    megatron_model = pytest.importorskip("twinkle_backend_megatron.model")
    from twinkle_backend_hf import plugin as hf_plugin
    from twinkle_backend_megatron import plugin as megatron_plugin

    core_only(hf_plugin, megatron_plugin)
    assert default_strategy(megatron_model.MegatronModel, world_size=1) == "megatron"
    assert default_strategy(megatron_model.MegatronModel, world_size=8) == "megatron"

    class Subclass(megatron_model.MegatronModel):
        pass

    assert default_strategy(Subclass, world_size=2) == "megatron"
    assert default_strategy(AnyModel, world_size=2) == "accelerate"
