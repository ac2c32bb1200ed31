"""``calculator``: an agent environment with one tool, for arithmetic the model cannot do in its head.

The tool is ``calculator`` with the argument ``expression``: numbers, ``+ - * /`` and parentheses, evaluated by
walking the parsed syntax tree (never ``eval``). Its value is the observation. The episode ends when the model
answers without a tool call; the reward is 1.0 when that answer equals the row's ``answer`` field (as numbers
when both parse as numbers, else as stripped text). A malformed or unknown tool call gets an error message as
its observation, so the model can try again within the turn budget.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from twinkle_core.environments import AgentMessage, Environment, StepResult

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_SIGNS = {ast.USub: operator.neg, ast.UAdd: operator.pos}
#: longest expression the tool reads (a model could otherwise make it multiply huge numbers for a long time)
MAX_EXPRESSION_CHARS = 200


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate (the message is the tool's observation)."""


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _SIGNS:
        return _SIGNS[type(node.op)](_value(node.operand))
    raise CalculatorError(f"unsupported: {ast.dump(node)[:40]}; only numbers, + - * / and parentheses")


def evaluate(expression: str) -> float:
    """The value of an arithmetic ``expression`` (``+ - * /``, parentheses, numbers); :class:`CalculatorError`
    for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {expression!r}: {exc.msg}") from None
    value = _value(tree.body)
    if not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def format_number(value: float) -> str:
    """``408`` for a whole number, else the shortest decimal that round-trips (``0.5``)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def same_answer(answer: str, reference: Any) -> bool:
    answer, reference = answer.strip(), str(reference).strip()
    try:
        return math.isclose(float(answer), float(reference), rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return answer == reference


class CalculatorEnvironment(Environment):
    """Options: ``answer_field`` (``"answer"``), the row field the final answer is compared with."""

    name = "calculator"

    def __init__(self, answer_field: str = "answer") -> None:
        self.answer_field = answer_field
        self.reference: Any = None

    def reset(self, row_fields: dict[str, Any]) -> str:
        self.reference = row_fields.get(self.answer_field)
        return ""

    def step(self, message: AgentMessage) -> StepResult:
        if message.errors:
            return StepResult(observation="error: " + "; ".join(message.errors))
        if not message.tool_calls:
            return StepResult(reward=float(same_answer(message.text, self.reference)), done=True)
        answers = [self._call(call.name, call.arguments) for call in message.tool_calls]
        return StepResult(observation="\n".join(answers))

    @staticmethod
    def _call(name: str, arguments: dict[str, Any]) -> str:
        if name != "calculator":
            return f"error: unknown tool {name!r}; the tool is 'calculator'"
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return "error: calculator needs a string argument 'expression'"
        try:
            return format_number(evaluate(expression))
        except CalculatorError as exc:
            return f"error: {exc}"


__all__ = ["CalculatorEnvironment", "CalculatorError", "evaluate", "format_number", "same_answer"]
