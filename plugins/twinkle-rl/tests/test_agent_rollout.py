"""Multi-turn rollouts with a scripted sampler and the bundled chat tokenizer: which tokens train (the model's,
never the environment's), log-probs aligned with them, seeds per turn, budgets, and environments that hang or
crash (counted, named, and never a hang)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from twinkle_rl.agent_rollout import AgentRolloutEngine, AgentSettings, agent_summary
from twinkle_rl.agent_turns import ChatTurns
from twinkle_rl.prompts import collate_prompts, read_prompts
from twinkle_rl.rollout import RolloutStats

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.environments import Environment, StepResult, load_environment
from twinkle_core.sampling import Completion, Sampler, SamplingParams, sample_seed

N = 2
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


class ScriptedAgent(Sampler):
    """Turn ``k`` of a trajectory (``k`` = tool messages in its prompt so far) is ``turns[k]``, ended by
    ``<|im_end|>``; token ``t`` of a turn gets the log-prob ``-(t + 1) / 100``. Records the seeds."""

    name = "scripted_agent"

    def __init__(self, tokenizer, turns, **options):
        super().__init__(**options)
        self.tok, self.turns, self.seeds = tokenizer, turns, []
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def sample(self, prompts, *, n, params, seeds):
        self.seeds.append(seeds)
        out = []
        for prompt in prompts:
            turn = self.tok.decode(prompt).count("<|im_start|>tool")
            ids = self.tok(self.turns[min(turn, len(self.turns) - 1)], add_special_tokens=False)["input_ids"]
            ids = ids[:params.max_new_tokens - 1] + [self.end]
            out.append([Completion(token_ids=ids, logprobs=[-(t + 1) / 100 for t in range(len(ids))],
                                   finish_reason="stop", policy_step=self.policy_step) for _ in range(n)])
        return out


class Hangs(Environment):
    """Hangs in its first step until ``released`` (a stand-in for a tool that never returns)."""

    released = threading.Event()

    def step(self, message):
        Hangs.released.wait(60)
        return StepResult(done=True)


class Crashes(Environment):
    def step(self, message):
        raise RuntimeError("the sandbox died")


class OpensWithAHint(Environment):
    def reset(self, row_fields):
        return "hint: use the calculator"

    def step(self, message):
        return StepResult(reward=0.5, done=bool(not message.tool_calls))


def make_engine(tokenizer, turns, environment="calculator", **settings):
    sampler = ScriptedAgent(tokenizer, turns)
    spec = {"name": environment, **settings}
    agent = AgentSettings.parse(spec)
    engine = AgentRolloutEngine(
        environment=load_environment(agent.name, agent.options), turns=ChatTurns(tokenizer), settings=agent,
        rewards=None, sampler=sampler, params=SamplingParams(max_new_tokens=96), num_generations=N,
        estimator="grpo", estimator_options={}, seed=7, pad_token_id=0)
    return engine, sampler


def run(engine, tokenizer, rows):
    features, _ = read_prompts(rows, tokenizer)
    stats = RolloutStats()
    rollout = engine.run(lambda: collate_prompts(features), 3, stats)
    return rollout, stats, features


ROWS = [{"prompt": "12*34?", "answer": "408"}, {"prompt": "12*34 again?", "answer": "407"}]


def test_only_the_model_tokens_are_trained_with_their_logprobs(tokenizer):
    engine, _ = make_engine(tokenizer, [CALL, "408"])
    rollout, stats, features = run(engine, tokenizer, ROWS)
    batch = rollout.batch
    for s, completion in enumerate(rollout.completions):
        prompt = len(features[s // N].prompt_ids)
        labels, ids = batch["labels"][s], batch["input_ids"][s]
        trained = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
        # the model's two turns, each ended by its end-of-turn token; nothing of the prompt or the tool message
        assert tokenizer.decode(labels[trained]) == CALL + "<|im_end|>" + "408<|im_end|>"
        assert torch.equal(labels[trained], ids[trained])
        untrained = [t for t in range(prompt, int(batch["attention_mask"][s].sum())) if t not in trained]
        assert tokenizer.decode(ids[untrained]) == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
        assert min(trained) == prompt
        # old_logps[t - 1] is the log-prob of the label at t: the sampler's, per turn; 0 for environment tokens
        first = len(tokenizer(CALL)["input_ids"]) + 1
        expected = [-(t + 1) / 100 for t in range(first)] + [-(t + 1) / 100 for t in range(len(trained) - first)]
        assert batch["old_logps"][s, [t - 1 for t in trained]].tolist() == pytest.approx(expected, abs=1e-7)
        assert batch["old_logps"][s, [t - 1 for t in untrained]].abs().sum() == 0
        assert completion.text == "408" and completion.finish_reason == "stop"
    assert rollout.rewards.tolist() == [[1.0, 1.0], [0.0, 0.0]]  # the calculator's reward for the final answer
    assert stats.sums["env_turns"] == 2 * N * 2 and stats.sums["env_tool_calls"] == 2 * N
    assert agent_summary(stats, engine.dp)["turns_mean"] == 2.0


def test_every_turn_is_seeded_by_rollout_prompt_trajectory_and_turn(tokenizer):
    engine, sampler = make_engine(tokenizer, [CALL, "408"])
    run(engine, tokenizer, ROWS)
    assert sampler.seeds == [[[sample_seed(7, 3, 0, i, j, turn)] for i in range(2) for j in range(N)]
                             for turn in range(2)]


def test_turn_and_token_budgets_cut_the_trajectory(tokenizer):
    engine, _ = make_engine(tokenizer, [CALL], max_turns=3)  # the model never answers
    rollout, stats, _ = run(engine, tokenizer, ROWS)
    assert all(c.finish_reason == "length" and c.extra["turns"] == 3 for c in rollout.completions)
    engine, _ = make_engine(tokenizer, [CALL, "408"], max_total_tokens=100)  # the tool message does not fit
    rollout, _, _ = run(engine, tokenizer, ROWS)
    completion = rollout.completions[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 100
    assert rollout.rewards.abs().sum() == 0


def test_an_opening_observation_is_an_untrained_user_message(tokenizer):
    engine, _ = make_engine(tokenizer, ["408"], environment=f"{__name__}:OpensWithAHint")
    rollout, _, features = run(engine, tokenizer, ROWS[:1])
    batch, prompt = rollout.batch, len(features[0].prompt_ids)
    ids = batch["input_ids"][0, :int(batch["attention_mask"][0].sum())]
    assert tokenizer.decode(ids) == ("<|im_start|>user\n12*34?<|im_end|>\n<|im_start|>user\n"
                                     "hint: use the calculator<|im_end|>\n<|im_start|>assistant\n408<|im_end|>")
    trained = (batch["labels"][0] != IGNORE_INDEX).nonzero().flatten()
    assert tokenizer.decode(batch["labels"][0, trained]) == "408<|im_end|>" and int(trained.min()) > prompt - 3
    assert rollout.rewards[0].tolist() == [0.5, 0.5]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("environment, failure", [("Hangs", "env_timeouts"), ("Crashes", "env_errors")])
def test_a_hung_or_crashing_step_ends_its_trajectory_counted_and_named(tokenizer, caplog, environment, failure):
    engine, _ = make_engine(tokenizer, [CALL, "408"], environment=f"{__name__}:{environment}", step_timeout_s=0.5)
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="twinkle.rl"):
            rollout, stats, _ = run(engine, tokenizer, ROWS)
    finally:
        Hangs.released.set()  # the abandoned threads end, whatever the test found
    assert time.monotonic() - started < 5  # four hung steps share one timeout, then the rollout goes on
    assert stats.sums[failure] == 2 * N and agent_summary(stats, engine.dp)[failure] == 2 * N
    assert engine.runner.failures.counts[("timeout" if environment == "Hangs" else "error",
                                          f"{environment}/calculator")] == 2 * N
    assert f"environment {environment}/calculator" in caplog.text
    # the model's first turn still trains (with reward 0): the failure ends the trajectory after it
    assert rollout.rewards.abs().sum() == 0
    assert all(c.extra["failure"] for c in rollout.completions)


def test_ppo_gae_skips_the_environment_tokens_between_turns():
    from twinkle_rl.advantages import gae
    from twinkle_rl.critic import generalized_advantages

    values = torch.tensor([[0.0, 0.3, 0.5, 9.0, 9.0, 0.7, 0.2, 0.0]], dtype=torch.float64)
    labels = torch.tensor([[-100, 5, 5, -100, -100, 5, 5, -100, -100]])  # two model turns, env tokens between
    advantages, returns = generalized_advantages(torch.tensor([1.0]), values, labels, gamma=0.9, lam=0.8, gae=gae)
    turns = [0, 1, 4, 5]  # the shifted positions of the model's tokens
    compact, compact_returns = gae(torch.tensor([[0.0, 0.0, 0.0, 1.0]], dtype=torch.float64), values[:, turns],
                                   torch.ones(1, 4), gamma=0.9, lam=0.8)
    assert torch.allclose(advantages[:, turns], compact) and torch.allclose(returns[:, turns], compact_returns)
    assert advantages[0, [2, 3, 6, 7]].abs().sum() == 0 and returns[0, [2, 3, 6, 7]].abs().sum() == 0
