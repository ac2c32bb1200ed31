"""The built-in rewards and RewardSet: scores, weights, ``module:function`` loading and every bad input."""

from __future__ import annotations

import math
import textwrap

import pytest
from twinkle_rl.rewards import (
    ExactMatch,
    LengthPenalty,
    NumericAnswer,
    RegexReward,
    RewardError,
    RewardScores,
    RewardSet,
    extract_answer_number,
)

from twinkle_core.errors import ConfigError, TwinkleError

BUILTINS = {cls.name: cls for cls in (ExactMatch, RegexReward, NumericAnswer, LengthPenalty)}


class FakePlugins:
    """The plugin manager's ``load`` for rewards, without installed distributions."""

    def load(self, kind: str, name: str):
        assert kind == "reward"
        return BUILTINS[name]


def score_one(reward, completion, **fields):
    return reward([""], [completion], **{k: [v] for k, v in fields.items()})[0]


# --------------------------------------------------------------------------- exact_match


def test_exact_match_normalises_whitespace_and_case():
    reward = ExactMatch()
    completions = ["  Paris ", "paris\n", "PARIS  france", "Lyon", ""]
    assert reward([""] * 5, completions, answer=["Paris"] * 4 + [""]) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert score_one(ExactMatch(normalize=False), "paris", answer="Paris") == 0.0
    assert score_one(reward, "New   York", answer="new york") == 1.0


def test_exact_match_last_line_and_other_field():
    reward = ExactMatch(field="label", extract="last_line")
    assert score_one(reward, "Let me think.\nIt is big.\n  42 \n\n", label=42) == 1.0
    assert score_one(reward, "42\nactually 43", label="42") == 0.0
    assert score_one(reward, "", label="") == 1.0
    assert score_one(ExactMatch(), "anything", answer=None) == 0.0


def test_exact_match_rejects_unknown_extract():
    with pytest.raises(ConfigError, match="extract"):
        ExactMatch(extract="first_line")


# --------------------------------------------------------------------------- regex


def test_regex_search_and_fullmatch_span_lines():
    think = r"<think>.+</think>\s*<answer>.+</answer>"
    good = "<think>step 1\nstep 2</think>\n<answer>4</answer>"
    assert score_one(RegexReward(think, mode="fullmatch"), good) == 1.0
    assert score_one(RegexReward(think, mode="fullmatch"), good + " trailing") == 0.0
    assert score_one(RegexReward(think), "preamble " + good + " trailing") == 1.0
    assert score_one(RegexReward(think), "<answer>4</answer>") == 0.0
    assert score_one(RegexReward(think), "") == 0.0


def test_regex_rejects_bad_pattern_and_mode():
    with pytest.raises(ConfigError, match="does not compile"):
        RegexReward("(unclosed")
    with pytest.raises(ConfigError, match="mode"):
        RegexReward("a", mode="match")


# --------------------------------------------------------------------------- numeric_answer


@pytest.mark.parametrize("text,number", [
    ("so \\boxed{1,234} it is", 1234.0),
    ("The answer is 12.", 12.0),
    ("It costs $12.50 in total", 12.5),
    ("12.0", 12.0),
    ("the drop is -3 degrees", -3.0),
    ("half: 1/2", 0.5),
    ("\\boxed{\\frac{3}{4}}", 0.75),
    ("\\boxed{-\\dfrac{1}{2}}", -0.5),
    ("about 50% of them", 50.0),
    ("1{,}000{,}000 grains", 1_000_000.0),
    ("first 7, then \\boxed{x = 5} and 9 more", 5.0),
    ("\\boxed{\\text{{nested}} 8}", 8.0),
    ("x-3 is not negative three", 3.0),
    ("1e3 items", 1000.0),
    ("\u22124", -4.0),
])
def test_extract_answer_number(text, number):
    assert extract_answer_number(text) == pytest.approx(number, rel=1e-12)


@pytest.mark.parametrize("text", ["no digits here", "", "\\boxed{none} but 3 later", "1/0"])
def test_extract_answer_number_none(text):
    assert extract_answer_number(text) is None


def test_numeric_answer_scores():
    reward = NumericAnswer()
    completions = ["\\boxed{1,234}", "The answer is 42.", "I think 41", "no number", "", "0.5", "2/4"]
    references = [1234, "#### 42", "Step: 20 + 22 = 42\n#### 42", 7, "3", "1/2", "\\frac{1}{2}"]
    assert reward([""] * 7, completions, answer=references) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_numeric_answer_tolerance_and_bad_reference():
    assert score_one(NumericAnswer(), "0.3333333333", answer="1/3") == 1.0
    assert score_one(NumericAnswer(), "0.333", answer="1/3") == 0.0
    assert score_one(NumericAnswer(tolerance=1e-2), "0.333", answer="1/3") == 1.0
    assert score_one(NumericAnswer(field="gold"), "12", gold=12.0) == 1.0
    assert math.isnan(score_one(NumericAnswer(), "12", answer="unknown"))
    with pytest.raises(ConfigError, match="tolerance"):
        NumericAnswer(tolerance=-1)


def test_missing_field_names_field_and_available():
    with pytest.raises(ConfigError, match=r"'answer'.*available fields: id, solution"):
        NumericAnswer()([""], ["1"], id=[0], solution=["1"])
    with pytest.raises(ConfigError, match=r"'label'.*\(none\)"):
        ExactMatch(field="label")([""], ["1"])


# --------------------------------------------------------------------------- length_penalty


def test_length_penalty_chars():
    reward = LengthPenalty(max_length=10, coefficient=0.5)
    assert reward([""] * 4, ["", "x" * 10, "x" * 11, "x" * 20]) == [0.0, 0.0, -0.5, -5.0]
    assert score_one(LengthPenalty(max_length=10), "x" * 20) == pytest.approx(-1.0)


def test_length_penalty_tokens_reads_completion_lengths():
    reward = LengthPenalty(max_length=4, coefficient=1.0, unit="tokens")
    assert reward(["", ""], ["short", "s"], completion_lengths=[6, 2]) == [-2.0, 0.0]
    with pytest.raises(ConfigError, match="completion_lengths"):
        reward([""], ["x"])
    with pytest.raises(ConfigError, match="max_length"):
        LengthPenalty(max_length=0)


# --------------------------------------------------------------------------- RewardSet


def write_module(tmp_path, monkeypatch, body: str, name: str = "twinkle_rl_test_user_rewards") -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


USER_REWARDS = """
    import math

    def polite(prompts, completions, **fields):
        return [1.0 if c.endswith("please") else 0.0 for c in completions]

    def by_id(prompts, completions, id, **fields):
        return [float(i) for i in id]

    def boom(prompts, completions, **fields):
        raise KeyError("answer")

    def too_few(prompts, completions, **fields):
        return [1.0] * (len(completions) - 1)

    def words(prompts, completions, **fields):
        return ["good" for _ in completions]

    def nothing(prompts, completions, **fields):
        return None

    def half_nan(prompts, completions, **fields):
        return [math.nan if i % 2 else 1.0 for i in range(len(completions))]

    def infinite(prompts, completions, **fields):
        return [-math.inf for _ in completions]

    def mutate(prompts, completions, **fields):
        fields["answer"].clear()
        return [0.0 for _ in completions]

    def exits(prompts, completions, **fields):
        import sys
        sys.exit("grader gave up")

    def interrupted(prompts, completions, **fields):
        raise KeyboardInterrupt

    def huge(prompts, completions, **fields):
        return [1e308 for _ in completions]
"""


@pytest.fixture
def user(tmp_path, monkeypatch):
    return write_module(tmp_path, monkeypatch, USER_REWARDS)


def test_reward_set_weights_registered_and_module_rewards(user):
    rewards = RewardSet([
        {"name": "exact_match", "weight": 2.0, "options": {"field": "answer"}},
        {"name": f"{user}:polite", "weight": 0.5},
        "numeric_answer",
    ], plugins=FakePlugins())
    result = rewards.score(["q1", "q2", "q3"], ["3", "3 please", ""], {"answer": ["3", "4", "4"]})
    assert isinstance(result, RewardScores)
    assert result.per_reward == {"exact_match": [1.0, 0.0, 0.0], f"{user}:polite": [0.0, 1.0, 0.0],
                                 "numeric_answer": [1.0, 0.0, 0.0]}
    assert result.total == [3.0, 0.5, 0.0]
    assert result.nan_count == 0
    assert rewards.names == ["exact_match", f"{user}:polite", "numeric_answer"]


def test_reward_set_deduplicates_names_and_takes_built_rewards(user):
    rewards = RewardSet([
        {"name": "regex", "options": {"pattern": "a"}},
        {"name": "regex", "weight": -1.0, "options": {"pattern": "b"}},
        LengthPenalty(max_length=1, coefficient=1.0),
        __import__(user).polite,
    ], plugins=FakePlugins())
    assert rewards.names == ["regex", "regex#2", "length_penalty", f"{user}:polite"]
    result = rewards.score(["", ""], ["ab", "a"], {})
    assert result.per_reward["regex#2"] == [1.0, 0.0]
    assert result.total == [1.0 - 1.0 - 1.0, 1.0]


def test_reward_set_takes_reward_classes():
    rewards = RewardSet([ExactMatch, {"name": "twinkle_rl.rewards:NumericAnswer", "options": {"field": "gold"}}])
    assert rewards.names == ["twinkle_rl.rewards:ExactMatch", "twinkle_rl.rewards:NumericAnswer"]
    result = rewards.score(["p"], ["4"], {"answer": ["4"], "gold": ["#### 4"]})
    assert result.total == [2.0]
    with pytest.raises(ConfigError, match="not a twinkle_core.rewards.Reward"):
        RewardSet([RewardScores])


def test_reward_set_passes_row_fields(user):
    result = RewardSet([f"{user}:by_id"]).score(["p", "p"], ["a", "b"], {"id": [3, 4]})
    assert result.total == [3.0, 4.0]


def test_reward_set_rejects_bad_recipes(user):
    with pytest.raises(ConfigError, match="non-empty"):
        RewardSet([])
    with pytest.raises(ConfigError, match="unknown"):
        RewardSet([{"name": f"{user}:polite", "wieght": 2}])
    with pytest.raises(ConfigError, match="finite"):
        RewardSet([{"name": f"{user}:polite", "weight": "high"}])
    with pytest.raises(ConfigError, match="takes no options"):
        RewardSet([{"name": f"{user}:polite", "options": {"x": 1}}])
    with pytest.raises(ConfigError, match="on_nan"):
        RewardSet([f"{user}:polite"], on_nan="skip")
    with pytest.raises(ConfigError, match="cannot import"):
        RewardSet(["no_such_module_xyz:f"])


def test_raising_reward_is_named_and_chained(user):
    with pytest.raises(RewardError, match=rf"{user}:boom.*KeyError.*'answer'.*available: id") as info:
        RewardSet([f"{user}:boom"]).score(["p"], ["c"], {"id": [1]})
    assert isinstance(info.value.__cause__, KeyError)
    assert isinstance(info.value, TwinkleError) and isinstance(info.value, RuntimeError)


def test_missing_required_argument_lists_fields(user):
    with pytest.raises(RewardError, match=r"by_id.*'id'.*available: answer"):
        RewardSet([f"{user}:by_id"]).score(["p"], ["c"], {"answer": ["x"]})


def test_builtin_missing_field_is_config_error():
    with pytest.raises(ConfigError, match=r"'answer'.*available fields: gold"):
        RewardSet(["numeric_answer"], plugins=FakePlugins()).score(["p"], ["1"], {"gold": ["1"]})


@pytest.mark.parametrize("fn,message", [
    ("too_few", r"too_few.*returned 1 scores for 2 completions"),
    ("words", r"words.*non-numeric score 'good'"),
    ("nothing", r"nothing.*returned NoneType"),
    ("infinite", r"infinite.*-inf.*finite"),
])
def test_unusable_scores_raise(user, fn, message):
    with pytest.raises(RewardError, match=message):
        RewardSet([f"{user}:{fn}"]).score(["p", "p"], ["a", "b"])


def test_nan_scores_are_counted_and_zeroed(user):
    rewards = RewardSet([f"{user}:half_nan", {"name": f"{user}:polite", "weight": 2.0}])
    result = rewards.score(["p"] * 3, ["x", "y please", "z"])
    assert result.nan_count == 1
    assert math.isnan(result.per_reward[f"{user}:half_nan"][1])
    assert result.total == [1.0, 2.0, 1.0]


def test_nan_scores_error_when_asked(user):
    with pytest.raises(RewardError, match=r"half_nan.*nan.*completion 1"):
        RewardSet([f"{user}:half_nan"], on_nan="error").score(["p"] * 2, ["x", "y"])


def test_empty_completions_are_scored(user):
    rewards = RewardSet([
        "exact_match", "numeric_answer", {"name": "regex", "options": {"pattern": ".*", "mode": "fullmatch"}},
        {"name": "length_penalty", "options": {"max_length": 5}}, f"{user}:polite",
    ], plugins=FakePlugins())
    result = rewards.score(["p", "p"], ["", ""], {"answer": ["", "7"]})
    numeric = result.per_reward.pop("numeric_answer")
    assert result.per_reward == {"exact_match": [1.0, 0.0], "regex": [1.0, 1.0], "length_penalty": [0.0, 0.0],
                                 f"{user}:polite": [0.0, 0.0]}
    assert math.isnan(numeric[0]) and numeric[1] == 0.0  # an empty reference has no number: no score
    assert result.total == [2.0, 1.0] and result.nan_count == 1


def test_mismatched_columns_raise(user):
    rewards = RewardSet([f"{user}:polite"])
    with pytest.raises(RewardError, match="2 prompts for 3 completions"):
        rewards.score(["p", "p"], ["a", "b", "c"])
    with pytest.raises(RewardError, match="'answer' has 1 values for 2"):
        rewards.score(["p", "p"], ["a", "b"], {"answer": ["x"]})


def test_reward_cannot_mutate_the_batch(user):
    fields = {"answer": ["x"]}
    RewardSet([f"{user}:mutate"]).score(["p"], ["c"], fields)
    assert fields == {"answer": ["x"]}


def test_tensor_scores_are_accepted():
    torch = pytest.importorskip("torch")

    def as_tensor(prompts, completions, **fields):
        return torch.tensor([0.25] * len(completions))

    assert RewardSet([as_tensor]).score(["p"], ["c"]).total == [0.25]


def test_sys_exit_in_a_reward_is_one_error_naming_it(user):
    """A grader calling sys.exit would end the run silently (even with exit code 0): it is a RewardError instead."""
    with pytest.raises(RewardError, match=rf"{user}:exits.*called sys.exit\('grader gave up'\).*never exit") as info:
        RewardSet([f"{user}:exits"]).score(["p"], ["c"])
    assert isinstance(info.value.__cause__, SystemExit)


def test_ctrl_c_inside_a_reward_is_not_swallowed(user):
    with pytest.raises(KeyboardInterrupt):
        RewardSet([f"{user}:interrupted"]).score(["p"], ["c"])


def test_finite_scores_whose_weighted_sum_overflows_are_refused(user):
    RewardSet([f"{user}:huge"]).score(["p"], ["c"])  # 1e308 alone is finite
    with pytest.raises(RewardError, match=rf"weighted sum for completion 0 overflows to inf .*{user}:huge = 1e\+308 "
                                          rf"x weight 2"):
        RewardSet([{"name": f"{user}:huge", "weight": 2.0}]).score(["p"], ["c"])


@pytest.mark.parametrize("options, match", [
    ({"name": "numeric_answer", "options": {"tolerance": math.inf}}, "numeric_answer: tolerance must be a finite"),
    ({"name": "numeric_answer", "options": {"tolerance": math.nan}}, "numeric_answer: tolerance must be a finite"),
    ({"name": "length_penalty", "options": {"max_length": 4, "coefficient": math.inf}}, "coefficient must be a finite"),
    ({"name": "regex", "weight": math.nan, "options": {"pattern": "a"}}, "must be a finite number"),
])
def test_non_finite_reward_options_are_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        RewardSet([options], plugins=FakePlugins())
