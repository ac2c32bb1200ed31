"""VLM data formats and their validation before training (no model, no processor)."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image
from twinkle_vlm.data import MAX_REPORTED, VLMDataError, load_samples


def _png(path, colour=(255, 0, 0), size=(32, 24)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


def _jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def _user(content):
    return {"role": "user", "content": content}


def _assistant(content):
    return {"role": "assistant", "content": content}


def test_typed_parts_with_paths_relative_to_the_data_file(tmp_path, monkeypatch):
    _png(tmp_path / "data" / "imgs" / "cat.png")
    path = _jsonl(tmp_path / "data" / "train.jsonl", [
        {"messages": [_user([{"type": "image", "image": "imgs/cat.png"}, {"type": "text", "text": "What is it?"}]),
                      _assistant("A cat.")]}])
    monkeypatch.chdir(tmp_path)  # the working directory must not matter
    [sample] = load_samples(path)
    assert sample.images == [str(tmp_path / "data" / "imgs" / "cat.png")]
    assert sample.messages == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]
    assert (sample.source, sample.line) == (path, 1)


def test_placeholder_format_multi_image_multi_turn(tmp_path):
    for name in ("a", "b", "c"):
        _png(tmp_path / f"{name}.png")
    path = _jsonl(tmp_path / "train.jsonl", [
        {"messages": [_user("<image>left, <image>right: same?"), _assistant("No."),
                      _user("And this one? <image>"), _assistant("Yes.")],
         "images": ["a.png", "b.png", "c.png"]}])
    [sample] = load_samples(path)
    assert sample.images == [str(tmp_path / n) for n in ("a.png", "b.png", "c.png")]
    assert sample.messages[0]["content"] == [{"type": "image"}, {"type": "text", "text": "left, "},
                                             {"type": "image"}, {"type": "text", "text": "right: same?"}]
    assert sample.messages[2]["content"] == [{"type": "text", "text": "And this one? "}, {"type": "image"}]
    assert [m["role"] for m in sample.messages] == ["user", "assistant", "user", "assistant"]


def test_sharegpt_rows_system_prompt_and_text_only_rows(tmp_path):
    _png(tmp_path / "x.png")
    path = _jsonl(tmp_path / "train.jsonl", [
        {"conversations": [{"from": "human", "value": "<image>Colour?"}, {"from": "gpt", "value": "Red."}],
         "images": ["x.png"], "system": "Be brief."},
        {"messages": [_user("Hi"), _assistant("Hello.")]}])
    with_image, text_only = load_samples(path)
    assert [m["role"] for m in with_image.messages] == ["system", "user", "assistant"]
    assert with_image.images == [str(tmp_path / "x.png")]
    assert text_only.images == [] and text_only.messages[0]["content"] == [{"type": "text", "text": "Hi"}]


def test_mixed_sources_resolve_paths_against_their_own_file(tmp_path):
    _png(tmp_path / "one" / "img.png", colour=(1, 2, 3))
    _png(tmp_path / "two" / "img.png", colour=(4, 5, 6))
    row = {"messages": [_user("<image>?"), _assistant("ok")], "images": ["img.png"]}
    first = _jsonl(tmp_path / "one" / "d.jsonl", [row])
    second = _jsonl(tmp_path / "two" / "d.jsonl", [row])
    samples = load_samples([{"path": first}, {"path": second}])
    assert [s.images[0] for s in samples] == [str(tmp_path / "one" / "img.png"), str(tmp_path / "two" / "img.png")]


def test_rows_given_in_code_are_relative_to_the_working_directory(tmp_path, monkeypatch):
    _png(tmp_path / "pic.png")
    monkeypatch.chdir(tmp_path)
    [sample] = load_samples([{"messages": [_user("<image>"), _assistant("x")], "images": ["pic.png"]}])
    assert sample.images == [str(tmp_path / "pic.png")]


def test_every_bad_row_is_reported_with_file_line_and_reason(tmp_path):
    good = _png(tmp_path / "good.png")
    with open(good, "rb") as f:
        data = f.read()
    with open(tmp_path / "truncated.png", "wb") as f:  # a PNG cut in the middle of its pixel data
        f.write(data[: len(data) // 2])
    (tmp_path / "notes.png").write_text("this is text, not an image")
    (tmp_path / "folder.png").mkdir()

    def one(path):
        return {"messages": [_user("<image>?"), _assistant("ok")], "images": [path]}

    rows = [
        one("good.png"),                                                    # 1: fine
        one("missing.png"),                                                 # 2
        one("truncated.png"),                                               # 3
        one("notes.png"),                                                   # 4
        {"messages": [_user("<image><image>?"), _assistant("ok")], "images": ["good.png"]},  # 5
        {"messages": [_user("?"), _assistant("ok")], "images": ["good.png"]},                # 6
        {"messages": [_user([{"type": "image", "image": "good.png"}]), _assistant("ok")],
         "images": ["good.png"]},                                           # 7: both formats
        {"messages": [_user("?"), _assistant([{"type": "image", "image": "good.png"}])]},    # 8
        {"messages": [_user("<image>?")], "images": ["good.png"]},         # 9: no answer
        {"messages": [_user([{"type": "audio", "audio": "a.wav"}]), _assistant("ok")]},      # 10
        one("folder.png"),                                                  # 11
    ]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(VLMDataError) as info:
        load_samples(path)
    problems = {line: reason for _, line, reason in info.value.problems}
    assert sorted(problems) == list(range(2, 12))
    assert "not found" in problems[2] and "missing.png" in problems[2]
    assert "corrupt" in problems[3] and "truncated.png" in problems[3]
    assert "not a readable image" in problems[4]
    assert "2 <image> placeholder(s)" in problems[5] and "1 image(s)" in problems[5]
    assert "0 <image> placeholder(s)" in problems[6]
    assert "use one of the two formats" in problems[7]
    assert "assistant" in problems[8] and "image" in problems[8]
    assert "last message must be from the assistant" in problems[9]
    assert "unknown type 'audio'" in problems[10] and "expected 'text', 'image' or 'video'" in problems[10]
    assert "not a file" in problems[11]
    message = str(info.value)
    assert message.startswith("10 problem(s) in the VLM data")
    for line in range(2, 12):
        assert f"{path}:{line}: " in message


def test_the_report_lists_the_first_problems_and_counts_the_rest(tmp_path):
    rows = [{"messages": [_user("<image>"), _assistant("x")], "images": [f"gone{i}.png"]}
            for i in range(MAX_REPORTED + 5)]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(VLMDataError) as info:
        load_samples(path)
    assert len(info.value.problems) == MAX_REPORTED + 5
    assert str(info.value).count("image file not found") == MAX_REPORTED
    assert str(info.value).endswith("... and 5 more")
    assert (info.value.path, info.value.line) == (path, 1)  # a DataFormatError naming the first problem
