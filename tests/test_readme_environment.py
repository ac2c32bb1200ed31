"""The README's agent environment example runs as printed: loaded by ``module:Class`` as a recipe would name it,
it plays an episode from parsed tool calls, and its hook yields the record that registers it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from twinkle_core.environments import load_environment, parse_tool_calls
from twinkle_core.records import EnvironmentRecord

ROOT = Path(__file__).resolve().parents[1]


def _readme_block() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Post-training: what has run where\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("\n```\n", 1)[0]


@pytest.fixture
def guess_module(tmp_path, monkeypatch):
    (tmp_path / "readme_guess_env.py").write_text(_readme_block(), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "readme_guess_env"
    sys.modules.pop("readme_guess_env", None)


def test_the_readme_environment_plays_an_episode(guess_module):
    make = load_environment(f"{guess_module}:Guess", {"max_probes": 2})
    episode = make()
    assert episode.reset({"answer": "7"}) == ""
    low = episode.step(parse_tool_calls('<tool_call>{"name": "probe", "arguments": {"guess": 3}}</tool_call>'))
    assert (low.observation, low.reward, low.done) == ("higher", -0.05, False)
    high = episode.step(parse_tool_calls('<tool_call>{"name": "probe", "arguments": {"guess": 9}}</tool_call>'))
    assert (high.observation, high.done) == ("lower", False)
    answer = episode.step(parse_tool_calls("7"))
    assert (answer.reward, answer.done) == (1.0, True)


def test_the_readme_hook_registers_the_environment(guess_module):
    module = __import__(guess_module)
    (record,) = list(module.twinkle_register_environments())
    assert isinstance(record, EnvironmentRecord) and record.name == "guess"
