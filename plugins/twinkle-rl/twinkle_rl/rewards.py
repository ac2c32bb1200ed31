"""Built-in rewards of online RL and :class:`RewardSet`, the weighted combination a recipe asks for.

Every reward follows the core contract (:mod:`twinkle_core.rewards`): ``(prompts, completions, **row_fields)
-> list[float]``, one score per completion, each row field holding one value per completion.

A recipe lists its rewards; :class:`RewardSet` loads them, checks every score they return, and sums them
with their weights::

    rewards:
      - {name: numeric_answer, weight: 1.0, options: {field: answer}}
      - {name: regex, weight: 0.2, options: {pattern: "<answer>.+</answer>"}}
      - mypkg.rewards:politeness           # weight 1
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from twinkle_core.errors import ConfigError, TwinkleError
from twinkle_core.rewards import Reward, RewardFn, load_reward
from twinkle_rl.checks import finite_number


class RewardError(TwinkleError, RuntimeError):
    """A reward failed or returned unusable scores. The message names the reward."""


def _reference_column(reward: str, field: str, fields: Mapping[str, list[Any]]) -> list[Any]:
    if field not in fields:
        available = ", ".join(sorted(fields)) or "(none)"
        raise ConfigError(f"reward {reward!r} needs the row field {field!r}, which the data rows do not have; "
                          f"available fields: {available}. Set the reward's 'field' option to one of them")
    return fields[field]


# --------------------------------------------------------------------------- exact_match


def _normalized(text: str) -> str:
    return " ".join(text.split()).casefold()


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


class ExactMatch(Reward):
    """1.0 when the completion equals the reference row field ``field``, else 0.0.

    ``normalize`` collapses runs of whitespace, strips the ends and ignores case. ``extract="last_line"``
    compares only the completion's last non-empty line (the reference is taken whole). A missing
    (``None``) reference scores 0.0.
    """

    name: ClassVar[str] = "exact_match"

    def __init__(self, field: str = "answer", normalize: bool = True,
                 extract: Literal["none", "last_line"] = "none"):
        if extract not in ("none", "last_line"):
            raise ConfigError(f"exact_match: extract must be 'none' or 'last_line', got {extract!r}")
        self.field, self.normalize, self.extract = field, normalize, extract

    def __call__(self, prompts: list[str], completions: list[str], **fields: list[Any]) -> list[float]:
        references = _reference_column(self.name, self.field, fields)
        return [self._score(completion, reference) for completion, reference in zip(completions, references)]

    def _score(self, completion: str, reference: Any) -> float:
        if reference is None:
            return 0.0
        answer = _last_line(completion) if self.extract == "last_line" else completion
        expected = str(reference)
        if self.normalize:
            answer, expected = _normalized(answer), _normalized(expected)
        return 1.0 if answer == expected else 0.0


# --------------------------------------------------------------------------- regex


class RegexReward(Reward):
    """1.0 when ``pattern`` matches the completion (``mode="search"`` anywhere, ``"fullmatch"`` all of it).

    The pattern is compiled with ``re.DOTALL`` so ``.`` spans lines: completions are multi-line, and a
    format reward like ``<think>.*</think>.*`` should not silently fail on the first newline.
    """

    name: ClassVar[str] = "regex"

    def __init__(self, pattern: str, mode: Literal["search", "fullmatch"] = "search"):
        if mode not in ("search", "fullmatch"):
            raise ConfigError(f"regex: mode must be 'search' or 'fullmatch', got {mode!r}")
        try:
            compiled = re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise ConfigError(f"regex: pattern {pattern!r} does not compile: {exc}") from exc
        self.pattern, self.mode = compiled, mode

    def __call__(self, prompts: list[str], completions: list[str], **fields: list[Any]) -> list[float]:
        match = self.pattern.search if self.mode == "search" else self.pattern.fullmatch
        return [1.0 if match(completion) else 0.0 for completion in completions]


# --------------------------------------------------------------------------- numeric_answer

# A sign only when it does not follow a word or a closing bracket, so the hyphen of "x-3" or "(2)-3"
# is not read as a minus.
_NUMBER = re.compile(r"""
    (?:(?<![\w)\]}])(?P<sign>[-+]))?\s*\$?\s*
    (?P<int>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?P<exp>[eE][-+]?\d+)?
    (?:\s*/\s*(?P<den>\d+(?:\.\d+)?))?
""", re.VERBOSE)
_LATEX_FRACTION = re.compile(r"\\[dt]?frac\s*\{\s*([-+]?[\d.,]+)\s*\}\s*\{\s*([\d.,]+)\s*\}")
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced; ``None`` without one."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, begin = 1, start + len(_BOXED)
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return text[begin:]  # unclosed (a truncated completion): take what is there


def _last_number(text: str) -> float | None:
    text = text.replace("\u2212", "-").replace("{,}", ",").replace("\\!", "").replace("\\,", "")
    text = _LATEX_FRACTION.sub(r"\1/\2", text)
    for match in reversed(list(_NUMBER.finditer(text))):
        value = float(match["int"].replace(",", "") + (match["exp"] or ""))
        if match["den"] is not None:
            denominator = float(match["den"])
            if denominator == 0:
                continue
            value /= denominator
        if match["sign"] == "-":
            value = -value
        if math.isfinite(value):
            return value
    return None


def extract_answer_number(text: str) -> float | None:
    """The answer number of a completion: the last number inside the last ``\\boxed{}``, else the last
    number of the text; ``None`` when there is none.

    Tolerates thousands separators (``1,234``, LaTeX ``1{,}234``), a currency sign, a trailing period, a
    percent sign (ignored: ``50%`` reads as 50), fractions (``1/2``, ``\\frac{1}{2}``) and exponents. A
    ``\\boxed{}`` is the model's committed answer, so when it holds no number the result is ``None``,
    not some other number of the text.
    """
    boxed = _last_boxed(text)
    return _last_number(boxed if boxed is not None else text)


def _reference_number(reference: Any) -> float | None:
    if isinstance(reference, numbers.Real) and not isinstance(reference, bool):
        return float(reference)
    if reference is None:
        return None
    text = str(reference)
    if "####" in text:  # GSM8K: the worked solution, then "#### <answer>"
        text = text.rsplit("####", 1)[1]
    return extract_answer_number(text)


class NumericAnswer(Reward):
    """1.0 when the completion's answer number (:func:`extract_answer_number`) equals the reference.

    The reference is the row field ``field``: a number, or text whose answer number is read the same way
    (after the last ``####`` when there is one, GSM8K style). Equal means ``math.isclose`` with
    ``tolerance`` as both the relative and the absolute tolerance. A completion without a number scores
    0.0; a reference without one scores ``nan`` ("no score": a data problem the RL task counts).
    """

    name: ClassVar[str] = "numeric_answer"

    def __init__(self, field: str = "answer", tolerance: float = 1e-6):
        self.field, self.tolerance = field, finite_number("numeric_answer: tolerance", tolerance, low=0.0)

    def __call__(self, prompts: list[str], completions: list[str], **fields: list[Any]) -> list[float]:
        references = _reference_column(self.name, self.field, fields)
        return [self._score(completion, reference) for completion, reference in zip(completions, references)]

    def _score(self, completion: str, reference: Any) -> float:
        expected = _reference_number(reference)
        if expected is None:
            return math.nan
        answer = extract_answer_number(completion)
        if answer is None:
            return 0.0
        return 1.0 if math.isclose(answer, expected, rel_tol=self.tolerance, abs_tol=self.tolerance) else 0.0


# --------------------------------------------------------------------------- length_penalty


class LengthPenalty(Reward):
    """``-coefficient * max(0, length - max_length)``: 0 within the budget, linearly negative beyond it.

    ``unit="chars"`` measures the completion text in characters (always available). ``unit="tokens"``
    reads token counts from the row field ``completion_lengths`` (one per completion), which the RL task
    supplies when it knows them. ``coefficient`` defaults to ``1 / max_length``, so a completion twice the
    budget scores -1.
    """

    name: ClassVar[str] = "length_penalty"
    TOKEN_FIELD: ClassVar[str] = "completion_lengths"

    def __init__(self, max_length: int, coefficient: float | None = None,
                 unit: Literal["chars", "tokens"] = "chars"):
        if not (isinstance(max_length, numbers.Integral) and max_length > 0):
            raise ConfigError(f"length_penalty: max_length must be a positive integer, got {max_length!r}")
        if unit not in ("chars", "tokens"):
            raise ConfigError(f"length_penalty: unit must be 'chars' or 'tokens', got {unit!r}")
        if coefficient is None:
            coefficient = 1.0 / max_length
        coefficient = finite_number("length_penalty: coefficient", coefficient, low=0.0)
        self.max_length, self.coefficient, self.unit = int(max_length), coefficient, unit

    def __call__(self, prompts: list[str], completions: list[str], **fields: list[Any]) -> list[float]:
        if self.unit == "tokens":
            lengths = [int(n) for n in _reference_column(self.name, self.TOKEN_FIELD, fields)]
        else:
            lengths = [len(completion) for completion in completions]
        return [-self.coefficient * max(0, length - self.max_length) for length in lengths]


# --------------------------------------------------------------------------- RewardSet


@dataclass
class RewardScores:
    """Scores of one batch: the weighted ``total`` per completion and each reward's raw scores."""

    total: list[float]
    per_reward: dict[str, list[float]]
    nan_count: int


@dataclass(frozen=True)
class _Member:
    display: str
    weight: float
    fn: RewardFn


def _display_name(fn: Any) -> str:
    name = getattr(fn, "name", "")
    if isinstance(fn, Reward) and name:
        return name
    target = fn if inspect.isfunction(fn) or inspect.isclass(fn) else type(fn)
    return f"{target.__module__}:{target.__qualname__}"


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}#{n}", n + 1
    taken.add(candidate)
    return candidate


_ENTRY_KEYS = {"name", "weight", "options"}

RecipeEntry = str | Mapping[str, Any] | Callable[..., Sequence[float]]


class RewardSet:
    """Several rewards summed with weights, every score checked.

    ``recipe`` entries are a spec string (a registered name or ``"module:function"``, weight 1), a mapping
    ``{"name": spec, "weight": w, "options": {...}}``, a :class:`~twinkle_core.rewards.Reward` class (built
    without options) or an already built reward callable (both weight 1).
    ``plugins`` is passed to :func:`twinkle_core.rewards.load_reward` (tests give a fake registry).

    ``on_nan`` says what a ``nan`` score ("no score") does: ``"zero"`` adds nothing to the total (it stays
    ``nan`` in ``per_reward`` and is counted in ``nan_count``); ``"error"`` raises :class:`RewardError`.
    Infinite or non-numeric scores, a wrong number of scores and a reward that raises are always errors.
    """

    def __init__(self, recipe: Sequence[RecipeEntry], *, plugins: Any = None,
                 on_nan: Literal["zero", "error"] = "zero"):
        if on_nan not in ("zero", "error"):
            raise ConfigError(f"rewards: on_nan must be 'zero' or 'error', got {on_nan!r}")
        if isinstance(recipe, (str, Mapping)) or not recipe:
            raise ConfigError(f"rewards: give a non-empty list of rewards, got {recipe!r}")
        self.on_nan = on_nan
        taken: set[str] = set()
        self.members: list[_Member] = [self._member(entry, plugins, taken) for entry in recipe]

    @staticmethod
    def _member(entry: RecipeEntry, plugins: Any, taken: set[str]) -> _Member:
        if isinstance(entry, str):
            return _Member(_unique(entry, taken), 1.0, load_reward(entry, plugins=plugins))
        if isinstance(entry, Mapping):
            unknown = set(entry) - _ENTRY_KEYS
            if unknown or not isinstance(entry.get("name"), str):
                raise ConfigError(f"rewards: entry {dict(entry)!r} must have a string 'name' and only the keys "
                                  f"{sorted(_ENTRY_KEYS)}" + (f"; unknown: {sorted(unknown)}" if unknown else ""))
            spec, weight = entry["name"], entry.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ConfigError(f"rewards: the weight of {spec!r} must be a finite number, got {weight!r}")
            fn = load_reward(spec, entry.get("options"), plugins=plugins)
            return _Member(_unique(spec, taken), float(weight), fn)
        if inspect.isclass(entry):
            if not issubclass(entry, Reward):
                raise ConfigError(f"rewards: class {entry.__qualname__} is not a twinkle_core.rewards.Reward")
            return RewardSet._member({"name": f"{entry.__module__}:{entry.__qualname__}"}, plugins, taken)
        if callable(entry):
            return _Member(_unique(_display_name(entry), taken), 1.0, entry)
        raise ConfigError(f"rewards: entry {entry!r} is neither a spec string, a mapping nor a callable")

    @property
    def names(self) -> list[str]:
        return [member.display for member in self.members]

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              fields: Mapping[str, Sequence[Any]] | None = None) -> RewardScores:
        fields = dict(fields or {})
        expected = len(completions)
        self._check_columns(prompts, fields, expected)
        total = [0.0] * expected
        per_reward: dict[str, list[float]] = {}
        nan_count = 0
        for member in self.members:
            scores = self._call(member, list(prompts), list(completions), fields, expected)
            for i, score in enumerate(scores):
                if math.isnan(score):
                    nan_count += 1
                else:
                    total[i] += member.weight * score
            per_reward[member.display] = scores
        self._check_totals(total, per_reward)
        return RewardScores(total=total, per_reward=per_reward, nan_count=nan_count)

    def _check_totals(self, total: list[float], per_reward: dict[str, list[float]]) -> None:
        """Finite scores can still add up to ``inf`` (``1e308 + 1e308``); the advantages of such a total are
        meaningless, so it is refused, naming the rewards."""
        for i, value in enumerate(total):
            if not math.isfinite(value):
                parts = ", ".join(f"{m.display} = {per_reward[m.display][i]:g} x weight {m.weight:g}"
                                  for m in self.members)
                raise RewardError(f"rewards: the weighted sum for completion {i} overflows to {value} ({parts}); "
                                  f"scale the rewards down (a reward's scores should be of order 1)")

    @staticmethod
    def _check_columns(prompts: Sequence[str], fields: Mapping[str, Sequence[Any]], expected: int) -> None:
        if len(prompts) != expected:
            raise RewardError(f"rewards: got {len(prompts)} prompts for {expected} completions; give one prompt "
                              f"per completion (repeat a prompt for each of its samples)")
        for key, column in fields.items():
            if len(column) != expected:
                raise RewardError(f"rewards: row field {key!r} has {len(column)} values for {expected} "
                                  f"completions; give one value per completion")

    def _call(self, member: _Member, prompts: list[str], completions: list[str],
              fields: dict[str, Sequence[Any]], expected: int) -> list[float]:
        columns = {key: list(column) for key, column in fields.items()}  # a reward may not mutate the batch
        try:
            raw = member.fn(prompts, completions, **columns)
        except ConfigError:
            raise  # already names the reward and what to change (e.g. a missing row field)
        except Exception as exc:
            available = ", ".join(sorted(fields)) or "(none)"
            raise RewardError(f"reward {member.display!r} raised {type(exc).__name__}: {exc} "
                              f"(row fields available: {available})") from exc
        except SystemExit as exc:  # sys.exit() in a grader would end the run silently (exit code 0 even)
            raise RewardError(f"reward {member.display!r} called sys.exit({exc.code!r}): a reward must return one "
                              f"score per completion (nan for 'no score') or raise an exception, never exit the "
                              f"process") from exc
        if hasattr(raw, "tolist"):  # a tensor or an array
            raw = raw.tolist()
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
            raise RewardError(f"reward {member.display!r} returned {type(raw).__name__}, expected a list of "
                              f"{expected} floats")
        if len(raw) != expected:
            raise RewardError(f"reward {member.display!r} returned {len(raw)} scores for {expected} "
                              f"completions; it must return one score per completion")
        return [self._checked(member.display, i, value) for i, value in enumerate(raw)]

    def _checked(self, display: str, index: int, value: Any) -> float:
        if not isinstance(value, numbers.Real):  # bools pass: True/False read as 1.0/0.0
            raise RewardError(f"reward {display!r} returned a non-numeric score {value!r} "
                              f"({type(value).__name__}) for completion {index}")
        score = float(value)
        if math.isnan(score):
            if self.on_nan == "error":
                raise RewardError(f"reward {display!r} returned nan for completion {index} and on_nan='error'")
            return score
        if math.isinf(score):
            raise RewardError(f"reward {display!r} returned {score} for completion {index}; scores must be "
                              f"finite (use nan for 'no score')")
        return score
