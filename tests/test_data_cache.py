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


# ---------------------------------------------------------------------- ranks of a multi-process job
def _features(n: int = 3):
    from twinkle_core.data.formats import InputFeature

    return [InputFeature(input_ids=[1, 2, i], labels=[-100, 2, i]) for i in range(n)]


@pytest.fixture()
def second_rank(monkeypatch):
    """This process is rank 1 of 2 (torchrun's environment); ``group`` says whether the process group exists."""
    from twinkle_core import distributed

    state = {"group": False, "broadcasts": 0}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(distributed, "has_process_group", lambda: state["group"])
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(distributed, "is_main_process", lambda: False)

    def broadcast_object(obj, src=0):
        state["broadcasts"] += 1
        return None  # the main process reports success

    monkeypatch.setattr(distributed, "broadcast_object", broadcast_object)
    return state


def test_a_rank_before_the_process_group_exists_builds_and_writes_without_a_warning(tmp_path, second_rank, caplog):
    """The trainer loads its data before the model's strategy joins the process group: the ranks cannot wait for
    the main process then, and a missing entry is no sign of an unshared file system."""
    from twinkle_core.data.cache import cached_features

    with caplog.at_level("WARNING", logger="twinkle_core.data.cache"):
        got = cached_features(str(tmp_path), "key", _features)
    assert _as_tuples(got) == _as_tuples(_features()) and isinstance(got, CachedFeatures)
    assert second_rank["broadcasts"] == 0  # no collective without a group
    assert "not a shared file system" not in caplog.text
    # the entry it wrote is the one every later reader (the main process included) reads
    assert _as_tuples(cached_features(str(tmp_path), "key", lambda: pytest.fail("built again"))) == _as_tuples(got)


def test_a_rank_that_cannot_see_the_main_processs_entry_warns(tmp_path, second_rank, caplog):
    from twinkle_core.data.cache import cached_features

    second_rank["group"] = True
    with caplog.at_level("WARNING", logger="twinkle_core.data.cache"):
        got = cached_features(str(tmp_path), "key", _features)
    assert second_rank["broadcasts"] == 1  # it waited for the main process
    assert "is not visible on this rank (not a shared file system?)" in caplog.text
    assert _as_tuples(got) == _as_tuples(_features()) and not (tmp_path / "key").exists()


def test_two_writers_of_one_entry_keep_the_first(tmp_path):
    from twinkle_core.data.cache import cached_features, write_features

    write_features(str(tmp_path / "key"), _features(2))
    write_features(str(tmp_path / "key"), _features(5))  # a rank that built it meanwhile: its copy is dropped
    assert len(cached_features(str(tmp_path), "key", lambda: pytest.fail("built again"))) == 2
    assert os.listdir(tmp_path) == ["key"]  # no staging directory left behind
