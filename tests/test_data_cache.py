"""The on-disk cache of tokenised features (twinkle_core.data.cache)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")

from twinkle_core.data.cache import CachedFeatures, tokenizer_fingerprint  # noqa: E402
from twinkle_core.tasks.causal_lm import CausalLMTask  # noqa: E402
from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402


@pytest.fixture()
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(i):
    return {"messages": [{"role": "user", "content": f"reverse abc{i}"}, {"role": "assistant", "content": f"{i}cba"}]}


def _as_tuples(features):
    return [(list(f.input_ids), list(f.labels), f.position_ids and list(f.position_ids), dict(f.extra))
            for f in features]


def _forbid_tokenizing(monkeypatch, tok):
    def boom(*args, **kwargs):
        raise AssertionError("the tokenizer was called although the data is cached")

    monkeypatch.setattr(type(tok), "__call__", boom)
    monkeypatch.setattr(type(tok), "apply_chat_template", boom)
    monkeypatch.setattr(type(tok), "encode", boom)


@pytest.mark.parametrize(("mode", "packing"), [("chat", False), ("pretrain", False), ("pretrain", True)])
def test_second_load_reads_the_cache(tmp_path, tok, monkeypatch, mode, packing):
    rows = [_chat(i) for i in range(6)] if mode == "chat" else [{"text": f"hello world {i} " * (i + 1)}
                                                                   for i in range(6)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    cache = tmp_path / "cache"
    options = dict(mode=mode, max_length=48, packing=packing)
    uncached = CausalLMTask().load_dataset(str(data), tok, **options)
    first = CausalLMTask().load_dataset(str(data), tok, cache_dir=str(cache), **options)
    assert isinstance(first, CachedFeatures)
    assert _as_tuples(first) == _as_tuples(uncached)
    entries = os.listdir(cache)
    assert len(entries) == 1 and not entries[0].startswith(".")
    assert sorted(os.listdir(cache / entries[0]))[:2] == ["input_ids.bin", "labels.bin"]

    _forbid_tokenizing(monkeypatch, tok)
    task = CausalLMTask()
    second = task.load_dataset(str(data), tok, cache_dir=str(cache), **options)
    assert _as_tuples(second) == _as_tuples(uncached)
    assert task.pad_token_id is not None  # collate works after a cache hit
    batch = task.collate([second[0], second[1]])
    assert batch["input_ids"].shape[0] == 2


def test_changed_file_or_option_makes_a_new_entry(tmp_path, tok):
    data = write_jsonl(tmp_path / "train.jsonl", [{"text": "one two"}, {"text": "three"}])
    cache = tmp_path / "cache"
    first = CausalLMTask().load_dataset(str(data), tok, mode="pretrain", cache_dir=str(cache))
    assert len(first) == 2
    write_jsonl(data, [{"text": "one two"}, {"text": "three"}, {"text": "four five six"}])
    os.utime(data, ns=(os.stat(data).st_atime_ns, os.stat(data).st_mtime_ns + 10**9))
    second = CausalLMTask().load_dataset(str(data), tok, mode="pretrain", cache_dir=str(cache))
    assert len(second) == 3
    assert len(os.listdir(cache)) == 2
    CausalLMTask().load_dataset(str(data), tok, mode="pretrain", max_length=2, cache_dir=str(cache))
    assert len(os.listdir(cache)) == 3  # another option: another entry
    CausalLMTask().load_dataset(str(data), tok, mode="pretrain", cache_dir=str(cache))
    assert len(os.listdir(cache)) == 3  # same as before: reused


def test_tokenizer_fingerprint_changes_with_the_vocabulary(tok):
    other = build_tiny_tokenizer()
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(other)
    other.add_tokens(["<new_token>"])
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(other)


def test_rows_in_memory_are_not_cached(tmp_path, tok):
    features = CausalLMTask().load_dataset([{"text": "abc"}], tok, mode="pretrain", cache_dir=str(tmp_path / "c"))
    assert isinstance(features, list) and not (tmp_path / "c").exists()
