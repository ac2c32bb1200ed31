"""Preference rows: validation with file:line errors, the accepted layouts, skipped identical pairs."""

from __future__ import annotations

import logging

import pytest
from twinkle_rl.rows import ROWS_SOURCE, parse_row, read_preference_rows

from twinkle_core.errors import DataFormatError

USER = [{"role": "user", "content": "reverse: kdoq"}]
GOOD = {"messages": USER, "chosen": "qodk", "rejected": "kdoq"}
_DROP = object()  # a key to remove from GOOD


def _with(**changes):
    row = {**GOOD, **changes}
    return {k: v for k, v in row.items() if v is not _DROP}


@pytest.mark.parametrize(("row", "reason"), [
    ('{"messages": [', "invalid JSON"),
    ('["a", "b"]', "must be a JSON object, got list"),
    (_with(chosen=_DROP), "row has no 'chosen'"),
    ({"messages": USER, "choosen": "a", "rejected": "b"}, "row has no 'chosen' (did you mean 'choosen'?)"),
    (_with(rejected=_DROP), "row has no 'rejected'"),
    (_with(rejected=None), "row has no 'rejected'"),
    (_with(messages=_DROP), "neither 'messages' nor 'prompt'"),
    (_with(prompt="hi"), "both 'prompt' and 'messages'"),
    (_with(chosen=""), "'chosen' is empty"),
    (_with(rejected="  \n"), "'rejected' is empty"),
    (_with(chosen=3), "'chosen' must be a string or a list of messages, got int"),
    (_with(rejected={"role": "assistant", "content": "x"}), "'rejected' must be a string or a list of messages"),
    (_with(chosen=[]), "'chosen' is an empty list"),
    (_with(chosen=["qodk"]), "'chosen': message 0 must be an object"),
    (_with(chosen=[{"role": "user", "content": "x"}]), "'chosen' message 0 is from 'user'"),
    (_with(chosen=[{"role": "assistant", "content": 5}]), "content must be a string, got int"),
    (_with(chosen=[{"role": "tool", "content": "r"}, {"role": "assistant", "content": "x"}]),
     "'chosen' must start with an assistant turn"),
    (_with(rejected=[{"role": "assistant", "content": "x"}, {"role": "tool", "content": "r"}]),
     "'rejected' must end with an assistant turn"),
    (_with(chosen=[{"role": "assistant", "content": " "}]), "'chosen' is empty (no assistant turn has content)"),
    (_with(messages=_DROP, prompt=["hi"]), "'prompt' must be a string (one user turn), got list"),
    (_with(messages=_DROP, prompt=""), "'prompt' is empty"),
    (_with(system=1), "'system' must be a string, got int"),
    (_with(messages=[{"role": "system", "content": "s"}, *USER], system="s"), "give it once"),
    (_with(messages=[*USER, {"role": "assistant", "content": "a"}]),
     "must end with a user turn (the answers continue it), its last message is from 'assistant'"),
    (_with(messages=[]), "'messages' is empty"),
    (_with(messages="not json"), "not valid JSON"),
    (_with(messages=[{"role": "robot", "content": "x"}]), "unknown role 'robot'"),
])
def test_malformed_rows_name_file_line_and_reason(write_jsonl, row, reason):
    path = write_jsonl([GOOD, GOOD, row, GOOD])
    with pytest.raises(DataFormatError) as info:
        read_preference_rows(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert reason in str(info.value)
    assert (info.value.path, info.value.line) == (path, 3)


def test_malformed_row_in_a_python_list_names_its_row_number():
    with pytest.raises(DataFormatError, match=r"^<rows>:2: row has no 'rejected'"):
        read_preference_rows([GOOD, {"messages": USER, "chosen": "a"}])


def test_empty_file_and_empty_list_are_errors(write_jsonl, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataFormatError, match="empty.jsonl: the file is empty"):
        read_preference_rows(str(path))
    with pytest.raises(DataFormatError, match=f"^{ROWS_SOURCE}: no rows"):
        read_preference_rows([])


def test_string_answer_is_one_assistant_turn_and_lists_are_kept():
    as_string = parse_row(GOOD, 1)
    as_list = parse_row(_with(chosen=[{"role": "assistant", "content": "qodk"}],
                              rejected=[{"role": "assistant", "content": "k"}, {"role": "tool", "content": "r"},
                                        {"role": "assistant", "content": "doq"}]), 1)
    assert as_string.chosen == as_list.chosen == [{"role": "assistant", "content": "qodk"}]
    assert [m["role"] for m in as_list.rejected] == ["assistant", "tool", "assistant"]
    assert as_string.prompt == USER


def test_prompt_string_with_system_and_sharegpt_conversations():
    row = parse_row({"prompt": "reverse: ab", "system": "be brief", "chosen": "ba", "rejected": "ab"}, 1)
    assert row.prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse: ab"}]
    row = parse_row({"conversations": [{"from": "human", "value": "hi"}], "system": "s", "chosen": "a",
                     "rejected": "b"}, 1)
    assert row.prompt == [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]


def test_prompt_may_end_with_a_tool_result():
    row = parse_row(_with(messages=[*USER, {"role": "assistant", "content": "calling"},
                                    {"role": "tool", "content": "42"}]), 1)
    assert row.prompt[-1]["role"] == "tool"


def test_identical_answers_are_skipped_with_one_warning(write_jsonl, caplog):
    same = _with(rejected="qodk")
    same_as_list = _with(rejected=[{"role": "assistant", "content": "qodk"}])
    path = write_jsonl([GOOD, same, GOOD, same_as_list])
    with caplog.at_level(logging.WARNING, logger="twinkle.rl"):
        source, pairs, identical = read_preference_rows(path)
    assert (source, len(pairs), identical) == (path, 2, 2)
    assert [p.line for p in pairs] == [1, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 2 of 4 pairs" in warnings[0]


def test_only_identical_pairs_is_an_error():
    with pytest.raises(DataFormatError, match="no usable pair"):
        read_preference_rows([_with(rejected="qodk")])


def test_extra_keys_are_ignored():
    assert parse_row({**GOOD, "id": 7, "score": 0.5}, 1).chosen == [{"role": "assistant", "content": "qodk"}]
