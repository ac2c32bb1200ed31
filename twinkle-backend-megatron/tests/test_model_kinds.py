"""MegatronModel builds causal LMs (and vision-language models, test_vision_language.py) only: tasks that need another network are refused before anything is built,
with a message naming the HF backend's class that builds it (issue 21: refuse rather than score with a
vocabulary logit)."""

from __future__ import annotations

import pytest
from twinkle_backend_megatron.model import MegatronModel
from twinkle_backend_megatron.testing import make_tiny_model, tiny_qwen2_config

from twinkle_core.errors import ConfigError


@pytest.fixture
def builds(monkeypatch):
    """The networks MegatronModel builds from now on (none, when a task is refused first)."""
    built = []
    original = MegatronModel.build_network

    def build_network(self):
        built.append(type(self).__name__)
        return original(self)

    monkeypatch.setattr(MegatronModel, "build_network", build_network)
    return built


def test_megatron_declares_causal_lm_and_vision_language():
    assert MegatronModel.supported_model_kinds == ("causal_lm", "image_text_to_text")


def test_the_ppo_critic_of_a_megatron_policy_is_refused_before_building(builds):
    pytest.importorskip("twinkle_rl")
    from twinkle_rl.critic import Critic, ValueTask

    policy = make_tiny_model(seed=0)
    builds.clear()
    with pytest.raises(ConfigError, match=r"model_kind 'token_value'.*MegatronModel.*TransformersModel"):
        Critic(policy)  # policy.sibling(task=ValueTask()): the critic is built like its policy
    with pytest.raises(ConfigError, match="TransformersModel"):
        MegatronModel(config=tiny_qwen2_config(), task=ValueTask())
    assert builds == []


def test_the_embedding_task_is_refused_before_building(builds):
    pytest.importorskip("twinkle_embedding")
    from twinkle_embedding.task import EmbeddingTask

    with pytest.raises(ConfigError, match=r"model_kind 'encoder'.*MegatronModel.*TransformersModel"):
        MegatronModel(config=tiny_qwen2_config(), task=EmbeddingTask())
    assert builds == []


def test_a_causal_lm_task_builds(builds):
    from twinkle_core.tasks.causal_lm import CausalLMTask

    model = make_tiny_model(seed=0, task=CausalLMTask())
    assert builds == ["MegatronModel"] and model.describe()["class"] == "MegatronModel"
