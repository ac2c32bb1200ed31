"""Task seams the core applies on every backend (issue 21): model kinds declared and checked before
building, ``Task.model_inputs`` and ``Task.adapter_config`` honoured by ``TorchTwinkleModel`` itself, the
declared ``network`` accessor, and the typed view of the training set-up."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from twinkle_core.capabilities import check_model_kind, model_kinds
from twinkle_core.errors import ConfigError
from twinkle_core.model.base import TwinkleModel
from twinkle_core.model.train_configs import LossSpec, TrainingSetup
from twinkle_core.strategy import SingleProcessStrategy
from twinkle_core.task import Task
from twinkle_core.testing.conformance import make_batch
from twinkle_core.testing.reference import ReferenceModel, make_reference_model


class PlainTask(Task):
    name = "plain"

    def load_dataset(self, path: str, tokenizer: Any, **data_options: Any) -> Any:
        return []

    def collate(self, features: list[Any]) -> dict[str, Any]:
        return {}


class CriticTask(PlainTask):
    name = "critic_like"
    model_kind = "token_value"


def test_a_kind_the_class_does_not_declare_is_refused_before_building(monkeypatch):
    assert model_kinds(ReferenceModel) == ("causal_lm",) and model_kinds(TwinkleModel) is None

    def build_network(self):
        raise AssertionError("built")

    monkeypatch.setattr(ReferenceModel, "build_network", build_network)
    with pytest.raises(ConfigError, match=r"task 'critic_like' needs a network of model_kind 'token_value', which "
                                          r"ReferenceModel does not build \(it builds causal_lm\)"):
        make_reference_model(task=CriticTask())
    with pytest.raises(ConfigError, match="Model classes that build it|No installed model class declares it"):
        check_model_kind(ReferenceModel, CriticTask())
    check_model_kind(ReferenceModel, PlainTask())
    check_model_kind(ReferenceModel, None)


def test_the_model_kind_of_a_task_instance_counts():
    task = PlainTask()
    task.model_kind = "encoder"  # e.g. the embedding task's option
    with pytest.raises(ConfigError, match="model_kind 'encoder'"):
        check_model_kind(ReferenceModel, task)


class ExtraInputTask(PlainTask):
    model_inputs = ("extra_bias",)


class RecordingReference(ReferenceModel):
    def run_network(self, module, inputs):
        self.seen = sorted(inputs)
        return super().run_network(module, {k: v for k, v in inputs.items() if k != "extra_bias"})


def test_the_tasks_model_inputs_reach_the_network_and_nothing_else():
    model = RecordingReference(seed=0, task=ExtraInputTask())
    batch = {**make_batch(0), "extra_bias": torch.zeros(1), "advantages": torch.ones(8)}
    model.forward_only(inputs=batch)
    assert model.seen == ["attention_mask", "extra_bias", "input_ids"]
    assert model.network_input_keys == ("input_ids", "attention_mask", "position_ids", "extra_bias")
    plain = RecordingReference(seed=0)
    plain.forward_only(inputs=batch)
    assert plain.seen == ["attention_mask", "input_ids"]


class NarrowingTask(PlainTask):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def adapter_config(self, model, config):
        self.seen.append((model, dict(config)))
        return {**config, "target_modules": ["q_proj"]}


def test_the_core_applies_the_tasks_adapter_config_on_any_backend():
    task = NarrowingTask()
    model = make_reference_model(task=task)
    model.add_adapter_to_model("a", {"r": 2, "target_modules": "all-linear"})
    assert task.seen == [(model, {"r": 2, "target_modules": "all-linear"})]
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in model.adapter_parameter_names("a")}
    assert adapted == {"q_proj"}
    assert model.get_train_configs()["adapter_config"] == {"r": 2, "target_modules": "all-linear"}  # as given


def test_network_is_a_declared_accessor():
    model = make_reference_model()
    assert model.network is model.module

    class Bare:
        pass

    with pytest.raises(ConfigError, match="Bare exposes no network"):
        TwinkleModel.network.fget(Bare())


def test_training_setup_is_a_typed_view_of_the_train_configs():
    model = make_reference_model()
    assert TrainingSetup.of(model) == TrainingSetup(adapters=(), loss=None, step=0, gradient_accumulation_steps=1)
    model.set_loss("cross_entropy", reduction="sum")
    model.set_optimizer("SGD", lr=0.1, gradient_accumulation_steps=2)
    setup = TrainingSetup.of(model)
    assert setup.loss == LossSpec("cross_entropy", {"reduction": "sum"})
    assert setup.loss.option("reduction") == "sum" and setup.loss.option("beta", 0.0) == 0.0
    assert setup.gradient_accumulation_steps == 2
    assert TrainingSetup.of(object()) == TrainingSetup()


class TensorSequenceParallelStrategy(SingleProcessStrategy):
    """Takes the spec's boolean ``sequence_parallel`` as its own option (as Megatron's strategy does)."""

    name = "tsp_single"
    spec_options = frozenset({"sequence_parallel"})


def test_a_strategy_declares_the_spec_options_it_takes(monkeypatch):
    from twinkle_core.model import runtime

    plugins = runtime.get_plugins()

    class Plugins:
        def load(self, kind, name):
            return TensorSequenceParallelStrategy if name == "tsp_single" else plugins.load(kind, name)

    monkeypatch.setattr(runtime, "get_plugins", Plugins)
    model = make_reference_model(strategy="tsp_single", sequence_parallel=True)
    assert model.strategy.options == {"sequence_parallel": True}
    with pytest.raises(ConfigError, match="contradicts strategy_options"):
        make_reference_model(strategy="tsp_single", strategy_options={"sequence_parallel": False},
                             sequence_parallel=True)
    with pytest.raises(ConfigError, match="sequence_parallel=2 is mesh sp=2"):  # 'single' declares none
        make_reference_model(sequence_parallel=True)
