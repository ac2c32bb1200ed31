"""The environment contract: tool calls parsed from the Qwen/Hermes format, environments loaded by name or
``module:Class``, the bundled calculator, and the ``task_options.environment`` settings."""

from __future__ import annotations

import pytest
from twinkle_rl.agent_rollout import AgentSettings
from twinkle_rl.calculator_env import CalculatorEnvironment, CalculatorError, evaluate

from twinkle_core.environments import (
    AgentMessage,
    Environment,
    StepResult,
    ToolCall,
    load_environment,
    parse_tool_calls,
)
from twinkle_core.errors import ConfigError, PluginNotFoundError


class Echo(Environment):
    name = "echo"

    def __init__(self, answer_field="answer"):
        self.answer_field = answer_field

    def reset(self, row_fields):
        self.answer = str(row_fields[self.answer_field])
        return ""

    def step(self, message):
        return StepResult(reward=float(message.text.strip() == self.answer), done=True)


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


@pytest.mark.parametrize("text, calls, errors", [
    ("408", [], 0),
    (CALL, [ToolCall("calculator", {"expression": "12*34"})], 0),
    ("let me compute\n" + CALL + "\n" + CALL.replace("12*34", "1+1"),
     [ToolCall("calculator", {"expression": "12*34"}), ToolCall("calculator", {"expression": "1+1"})], 0),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', [ToolCall("f", {"x": 1})], 0),
    ('<tool_call>\n{"name": "f"}\n</tool_call>', [ToolCall("f", {})], 0),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', [], 1),  # not JSON
    ('<tool_call>{"arguments": {}}</tool_call>', [], 1),  # no name
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [], 1),  # arguments not an object
    ('<tool_call>{"name": "f"', [], 1),  # never closed
    (CALL + '<tool_call>nope</tool_call>', [ToolCall("calculator", {"expression": "12*34"})], 1),
])
def test_tool_calls_are_parsed_and_malformed_ones_reported(text, calls, errors):
    message = parse_tool_calls(text)
    assert message.text == text
    assert list(message.tool_calls) == calls
    assert len(message.errors) == errors


@pytest.mark.parametrize("expression, value", [("12*34", 408), ("(1 + 2) * -3", -9), ("7/2", 3.5), ("2.5*4", 10)])
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "2**100000", "1/0", "x", "1 +", "[1]", "9" * 300])
def test_the_calculator_refuses_anything_else(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)


def test_the_calculator_episode():
    env = CalculatorEnvironment()
    assert env.reset({"answer": "408"}) == ""
    assert env.step(parse_tool_calls(CALL)) == StepResult(observation="408")
    assert "unknown tool" in env.step(AgentMessage("", (ToolCall("python", {}),))).observation
    assert env.step(parse_tool_calls("<tool_call>{</tool_call>")).observation.startswith("error:")
    assert env.step(parse_tool_calls(" 408.0 ")) == StepResult(reward=1.0, done=True)
    assert env.step(parse_tool_calls("407")) == StepResult(reward=0.0, done=True)


def test_environments_load_by_registered_name_or_module_path():
    factory = load_environment("calculator")
    assert isinstance(factory(), CalculatorEnvironment) and factory() is not factory()
    echo = load_environment(f"{__name__}:Echo", {"answer_field": "y"})()
    echo.reset({"y": "ok"})
    assert echo.step(parse_tool_calls("ok")).reward == 1.0


@pytest.mark.parametrize("spec, options, error, match", [
    ("calculator", {"answer_fild": "x"}, ConfigError, "bad options"),
    (f"{__name__}:NotThere", {}, ConfigError, "cannot import"),
    (f"{__name__}:CALL", {}, ConfigError, "Environment subclass"),
    ("no_such_environment", {}, PluginNotFoundError, "Available environments: .*calculator"),
])
def test_bad_environments_are_refused_by_name(spec, options, error, match):
    with pytest.raises(error, match=match):
        load_environment(spec, options)


@pytest.mark.parametrize("spec, match", [
    ({"options": {}}, "name"),
    ({"name": "calculator", "max_turn": 3}, "unknown key"),
    ({"name": "calculator", "step_timeout_s": 0}, "step_timeout_s"),
    ({"name": "calculator", "max_turns": 0}, "max_turns"),
    ({"name": "calculator", "options": [1]}, "options"),
])
def test_bad_environment_settings_are_refused(spec, match):
    with pytest.raises(ConfigError, match=match):
        AgentSettings.parse(spec)
