"""What the console shows for the RL tasks (``Task.console_keys``, applied by the core's StepReporter): the rollouts'
reward and accuracy on a GRPO step line; the reward accuracy and margin of the pairs, and the evaluation before
training, on a DPO-family run. Two steps of a tiny Qwen2 from a config."""

from __future__ import annotations

import json
import logging
import re

import pytest
from test_online import tiny_recipe

from twinkle_core.train.loop import train

pytest.importorskip("twinkle_backend_hf")

NUMBER = r"-?[0-9.e+-]+"


@pytest.fixture(autouse=True)
def console_lines(monkeypatch):
    monkeypatch.setenv("TWINKLE_NO_PROGRESS", "1")  # the step lines, not a progress bar
    monkeypatch.setenv("TWINKLE_TENSORBOARD", "0")


def step_lines(caplog) -> list[str]:
    """The training step lines (not the ``step N/M eval:`` ones)."""
    return [m for m in (r.getMessage() for r in caplog.records if r.name == "twinkle.train")
            if m.startswith("step ") and " eval: " not in m]


@pytest.mark.timeout(300)
def test_the_grpo_step_line_shows_reward_and_accuracy(tmp_path, write_jsonl, caplog):
    prompts = write_jsonl([{"prompt": f"say: {w}", "answer": "x"} for w in ("abcd", "efgh", "dcba", "hgfe")] * 2,
                          name="prompts.jsonl")
    with caplog.at_level(logging.INFO, logger="twinkle.train"):
        train(tiny_recipe(tmp_path / "run", prompts, steps=2))
    lines = step_lines(caplog)
    assert len(lines) == 2
    for line in lines:
        assert re.search(rf" reward_mean {NUMBER} reward_std {NUMBER} accuracy {NUMBER}", line), line
    # the full metrics stay in the log
    logged = [json.loads(x) for x in (tmp_path / "run" / "logs.jsonl").read_text().splitlines()]
    assert all("completion_length_mean" in r and "entropy" in r for r in logged if r["event"] == "train")


@pytest.mark.timeout(300)
def test_a_dpo_run_shows_its_evaluation_before_training_and_the_pairs_accuracy_and_margin(tmp_path, write_jsonl,
                                                                                        caplog):
    pairs = write_jsonl([{"prompt": f"say: {w}", "chosen": "x", "rejected": "y"} for w in ("ab", "cd", "ef", "gh")])
    recipe = tiny_recipe(tmp_path / "run", pairs, steps=2)
    recipe.update(task="preference", task_options={"reference": "none"}, loss={"name": "simpo"})
    recipe["data"].update(eval=pairs, max_length=32)
    recipe["train"]["eval_before_training"] = True
    with caplog.at_level(logging.INFO, logger="twinkle.train"):
        summary = train(recipe)
    messages = [r.getMessage() for r in caplog.records if r.name == "twinkle.train"]
    [before] = [m for m in messages if m.startswith("eval before training: ")]
    assert re.fullmatch(rf"eval before training: loss {NUMBER}, .*rewards/accuracies {NUMBER}.*", before), before
    assert f"loss {summary['eval_before']['eval_loss']:.2f}," in before
    lines = step_lines(caplog)
    assert len(lines) == 2
    for line in lines:
        assert re.search(rf" rewards/accuracies {NUMBER} rewards/margins {NUMBER}$", line), line
