"""The core's online-RL contracts without any sampler or reward plugin: ``twinkle_core.sampling`` (sampling
parameters, seeds, the weight-sync protocol of the ``Sampler`` base class) and ``twinkle_core.rewards``
(``load_reward``: ``module:function``, registered names, options)."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from typing import Any

import pytest
import torch

from twinkle_core import hookimpl
from twinkle_core.errors import ConfigError, PluginNotFoundError
from twinkle_core.plugins import TwinklePlugins
from twinkle_core.records import RewardRecord
from twinkle_core.rewards import Reward, load_reward
from twinkle_core.sampling import Completion, Sampler, SamplingParams, WeightUpdate, sample_seed

FAKES = "twinkle_test_sampling_contract_fakes"
sys.modules.setdefault(FAKES, sys.modules[__name__])  # a stable import name for the records below


# ---------------------------------------------------------------------- SamplingParams
def test_sampling_params_defaults_are_plain_sampling():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (1.0, 1.0, 0, 64)
    assert params.stop == () and params.stop_token_ids == ()
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=1)  # the edges are allowed: greedy


@pytest.mark.parametrize(("options", "message"), [
    ({"temperature": -0.1}, r"task_options\.sampling\.temperature must be a finite number >= 0, got -0\.1"),
    ({"top_p": 0.0}, r"task_options\.sampling\.top_p must be in \(0, 1\], got 0\.0"),
    ({"top_p": 1.5}, r"task_options\.sampling\.top_p must be in \(0, 1\], got 1\.5"),
    ({"top_k": -1}, r"task_options\.sampling\.top_k must be >= 0 \(0 = off\), got -1"),
    ({"max_new_tokens": 0}, r"task_options\.sampling\.max_new_tokens must be >= 1, got 0"),
])
def test_bad_sampling_params_name_the_key(options, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        SamplingParams(**options)


def test_stop_lists_become_tuples_and_token_ids_ints():
    # a recipe gives lists (YAML) and a tokenizer may give numpy or tensor integers
    params = SamplingParams(stop=["\n\n", "###"], stop_token_ids=[torch.tensor(7), 3])  # type: ignore[list-item]
    assert params.stop == ("\n\n", "###")
    assert params.stop_token_ids == (7, 3) and all(type(t) is int for t in params.stop_token_ids)
    hash(params)  # frozen and hashable: usable as a cache key
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]


def test_a_single_stop_string_is_not_split_into_characters():
    # a recipe's ``stop: "###"`` (a string, not a list) is one stop string, never three '#' stops
    assert SamplingParams(stop="###").stop == ("###",)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="non-empty strings"):
        SamplingParams(stop=("",))
    with pytest.raises(ConfigError, match="integers"):
        SamplingParams(stop_token_ids=(3.7,))  # type: ignore[arg-type]


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_a_non_finite_temperature_is_refused(temperature):
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=temperature)


# ---------------------------------------------------------------------- sample_seed
def test_sample_seed_is_deterministic_distinct_and_63_bit():
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3)
    seeds = {sample_seed(base, rollout, prompt, sample)
             for base in (0, 1) for rollout in range(4) for prompt in range(8) for sample in range(4)}
    assert len(seeds) == 2 * 4 * 8 * 4, "every coordinate gives its own seed"
    assert sample_seed(1, 2, 3) != sample_seed(1, 3, 2) != sample_seed(2, 1, 3), "the order of coordinates matters"
    assert sample_seed(5) != sample_seed(5, 0), "a missing coordinate is not a zero"
    assert all(0 <= s < 2**63 for s in seeds)  # fits torch.Generator.manual_seed and int64
    assert sample_seed(torch.tensor(1), 2) == sample_seed(1, 2)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- Sampler weight sync
class EchoSampler(Sampler):
    name = "echo"

    def __init__(self, **options: Any) -> None:
        self.updates: list[WeightUpdate] = []
        super().__init__(**options)

    def sample(self, prompts, *, n, params, seeds):
        return [[Completion(token_ids=p[-1:], logprobs=[0.0], finish_reason="length", policy_step=self.policy_step)
                 for _ in range(n)] for p in prompts]


class PushSampler(EchoSampler):
    weight_sync = "push"

    def receive_weights(self, update: WeightUpdate) -> None:
        self.updates.append(update)


class FakePolicy:
    """What a push sampler reads of a model: ``get_state_dict`` (counted, and by adapter)."""

    def __init__(self) -> None:
        self.calls: list[str | None] = []
        self.weight = torch.zeros(3)

    def get_state_dict(self, *, adapter_name: str | None = None) -> dict[str, Any]:
        self.calls.append(adapter_name)
        return {"model.weight": self.weight.clone()}

    def generation_module(self, **kwargs: Any) -> Any:
        raise AssertionError("a sampler's sync_weights never borrows the network")


def test_a_bad_weight_sync_mode_is_refused():
    class Broken(EchoSampler):
        weight_sync = "broadcast"

    with pytest.raises(ConfigError, match=r"Broken\.weight_sync must be one of \('in_process', 'push'\), "
                                          r"got 'broadcast'"):
        Broken()

    class ChosenByOptions(EchoSampler):  # a sampler whose mode depends on its options sets it before __init__
        def __init__(self, *, copy_weights: bool = False, **options: Any) -> None:
            self.weight_sync = "push" if copy_weights else "in_process"
            super().__init__(**options)

    assert ChosenByOptions(copy_weights=True).weight_sync == "push"
    assert ChosenByOptions(temperature=1).options == {"temperature": 1}


def test_push_sync_hands_the_policys_state_dict_to_receive_weights():
    policy, sampler = FakePolicy(), PushSampler()
    sampler.bind(policy, tokenizer="tok", adapter_name="default")  # type: ignore[arg-type]
    assert (sampler.model, sampler.tokenizer, sampler.adapter_name) == (policy, "tok", "default")
    policy.weight += 1.5  # an optimizer step
    sampler.sync_weights(policy, step=3)  # type: ignore[arg-type]
    (update,) = sampler.updates
    assert (update.step, update.adapter_name) == (3, "default")
    torch.testing.assert_close(update.state_dict["model.weight"], torch.full((3,), 1.5))
    assert policy.calls == ["default"], "the adapter's weights only, gathered once"
    assert sampler.policy_step == 3
    out = sampler.sample([[1, 2]], n=2, params=SamplingParams(), seeds=[[0, 1]])
    assert [c.policy_step for c in out[0]] == [3, 3], "completions report the weights they were drawn with"


def test_push_sync_of_a_sampler_that_cannot_receive_is_an_error():
    class NoReceiver(EchoSampler):
        weight_sync = "push"

    with pytest.raises(NotImplementedError, match="NoReceiver declares weight_sync='push'"):
        NoReceiver().sync_weights(FakePolicy(), step=1)  # type: ignore[arg-type]


def test_in_process_sync_only_records_the_step():
    policy, sampler = FakePolicy(), EchoSampler()
    sampler.bind(policy, tokenizer=None)  # type: ignore[arg-type]
    assert sampler.policy_step == 0 and sampler.adapter_name is None
    sampler.sync_weights(policy, step=5)  # type: ignore[arg-type]
    assert sampler.policy_step == 5 and sampler.updates == [] and policy.calls == [], "nothing moves in process"
    sampler.close()  # the base class holds nothing


# ---------------------------------------------------------------------- rewards
def polite(prompts: list[str], completions: list[str], **fields: list[Any]) -> list[float]:
    return [1.0 if c.endswith("please") else 0.0 for c in completions]


class MaxLength(Reward):
    name = "max_length"

    def __init__(self, limit: int = 5) -> None:
        self.limit = limit

    def __call__(self, prompts, completions, **fields):
        return [0.0 if len(c) > self.limit else 1.0 for c in completions]


class NotAReward:
    def __call__(self, prompts, completions, **fields):
        return [0.0 for _ in completions]


NOT_CALLABLE = 42


@hookimpl
def twinkle_register_rewards():
    yield RewardRecord("polite", f"{FAKES}:polite", "ends with please (test fixture)")
    yield RewardRecord("max_length", f"{FAKES}:MaxLength", "short completions (test fixture)")


def _plugins() -> TwinklePlugins:
    return TwinklePlugins(autoload=False, disabled=[], extra_modules=[FAKES])


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A user's own reward module on ``sys.path``, as a recipe's ``module:function`` names it."""
    name = "twinkle_user_rewards_for_test"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        from twinkle_core.rewards import Reward

        def has_answer(prompts, completions, *, answer, **fields):
            return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]

        class Weighted(Reward):
            def __init__(self, weight=1.0):
                self.weight = weight

            def __call__(self, prompts, completions, **fields):
                return [self.weight * len(c) for c in completions]

        class Plain:
            pass

        VALUE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    yield name
    sys.modules.pop(name, None)


def test_module_function_reward_receives_row_fields(user_module):
    reward = load_reward(f"{user_module}:has_answer")
    assert reward(["q1", "q2"], ["it is 4", "no idea"], answer=["4", "7"]) == [1.0, 0.0]


def test_reward_subclass_is_built_with_its_options(user_module):
    reward = load_reward(f"{user_module}:Weighted", {"weight": 0.5})
    assert isinstance(reward, Reward) and reward([""], ["abcd"]) == [2.0]
    assert load_reward(f"{user_module}:Weighted")([""], ["ab"]) == [2.0]  # no options: its defaults
    with pytest.raises(ConfigError, match=r"reward '.*:Weighted': bad options \['wieght'\]"):
        load_reward(f"{user_module}:Weighted", {"wieght": 0.5})


def test_options_given_to_a_plain_function_are_refused(user_module):
    # a misspelt option of a function would otherwise be dropped silently
    with pytest.raises(ConfigError, match=r"reward '.*:has_answer' is a plain function and takes no options, "
                                          r"got \['weight'\]; write a twinkle_core.rewards.Reward subclass"):
        load_reward(f"{user_module}:has_answer", {"weight": 1.0})


def test_non_callables_and_foreign_classes_are_refused(user_module):
    with pytest.raises(ConfigError, match=r"reward '.*:VALUE' is not callable"):
        load_reward(f"{user_module}:VALUE")
    with pytest.raises(ConfigError, match=r"reward '.*:Plain' is a class but not a twinkle_core\.rewards\.Reward"):
        load_reward(f"{user_module}:Plain")


def test_an_unimportable_reference_says_what_to_give(user_module):
    with pytest.raises(ConfigError, match=r"reward 'no_such_module_xyz:f': cannot import it .*'package\.module:"
                                          r"function'"):
        load_reward("no_such_module_xyz:f")
    with pytest.raises(ConfigError, match=r"reward '.*:missing': cannot import it"):
        load_reward(f"{user_module}:missing")


def test_registered_rewards_by_name():
    plugins = _plugins()
    assert load_reward("polite", plugins=plugins)(["q"], ["thanks please", "no"]) == [1.0, 0.0]
    capped = load_reward("max_length", {"limit": 2}, plugins=plugins)
    assert isinstance(capped, MaxLength) and capped(["q", "q"], ["ab", "abc"]) == [1.0, 0.0]
    with pytest.raises(ConfigError, match="is a plain function and takes no options"):
        load_reward("polite", {"limit": 2}, plugins=plugins)


def test_an_unknown_registered_name_lists_the_installed_rewards():
    with pytest.raises(PluginNotFoundError) as info:
        load_reward("no_such_reward", plugins=_plugins())
    assert str(info.value).startswith("no reward named 'no_such_reward' is installed. Available rewards: "
                                      "max_length, polite.")
    assert info.value.available and sorted(info.value.available) == ["max_length", "polite"]


def test_a_catalogued_reward_that_is_not_installed_says_what_to_install():
    # exact_match ships with twinkle-rl, which this registry does not load
    with pytest.raises(PluginNotFoundError, match="no reward named 'exact_match' is installed.*twinkle-rl"):
        load_reward("exact_match", plugins=_plugins())
