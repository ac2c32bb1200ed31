"""The data format: validation with file/line errors, tokenisation, instructions, batch layout."""

from __future__ import annotations

import json

import pytest
from embedding_helpers import ROWS, minilm_tokenizer
from twinkle_embedding.data import ROLE_NEGATIVE, ROLE_POSITIVE, ROLE_QUERY, text_hash
from twinkle_embedding.task import EmbeddingTask

from twinkle_core.errors import ConfigError, DataFormatError


def write(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


GOOD = {"query": "q", "positive": "p"}


@pytest.mark.parametrize(("row", "reason"), [
    ({"positive": "p"}, "missing 'query'"),
    ({"query": "q"}, "missing 'positive'"),
    ({"query": "", "positive": "p"}, "'query' is empty"),
    ({"query": "q", "positive": 3}, "'positive' must be a string, got int"),
    ({"query": "q", "positive": "p", "negatives": "n"}, "'negatives' must be a list of strings, got str"),
    ({"query": "q", "positive": "p", "negatives": ["n", 5]}, "'negatives[1]' must be a string, got int"),
    ({"query": "q", "positive": "p", "negatives": ["n", " "]}, "'negatives[1]' is empty"),
    ({"query": "q", "positive": "p", "negative": ["n"]}, "unsupported key 'negative'"),
    ({"query": "q", "positive": "p", "positives": ["a", "b"]}, "one positive per row"),
    ({"querry": "q", "positive": "p"}, "did you mean 'query'"),
    ({"query": "q", "positive": "p", "instruction": 1}, "'instruction' must be a string or null"),
    (["q", "p"], "must be a JSON object"),
])
def test_malformed_rows_name_file_line_and_reason(tmp_path, row, reason):
    path = write(tmp_path, [GOOD, GOOD, row])
    with pytest.raises(DataFormatError) as info:
        EmbeddingTask().load_dataset(path, minilm_tokenizer())
    assert info.value.path == path and info.value.line == 3
    assert reason in info.value.reason
    assert str(info.value).startswith(f"{path}:3: ")


def test_invalid_json_and_empty_file(tmp_path):
    path = write(tmp_path, [GOOD, '{"query": "q", "positive": '])
    with pytest.raises(DataFormatError, match=r"data.jsonl:2: invalid JSON"):
        EmbeddingTask().load_dataset(path, minilm_tokenizer())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataFormatError, match="no rows"):
        EmbeddingTask().load_dataset(str(empty), minilm_tokenizer())


def test_extra_keys_are_ignored_and_unknown_options_rejected(tmp_path):
    path = write(tmp_path, [{**GOOD, "id": 7, "source": "x"}])
    assert len(EmbeddingTask().load_dataset(path, minilm_tokenizer())) == 1
    with pytest.raises(ConfigError, match="did you mean 'pooling'"):
        EmbeddingTask(poolng="mean")
    with pytest.raises(ConfigError, match="unknown option"):
        EmbeddingTask().load_dataset(path, minilm_tokenizer(), packing=True)
    with pytest.raises(ConfigError, match="unknown pooling"):
        EmbeddingTask(pooling="max")


def test_tokenisation_prefixes_and_instructions():
    tok = minilm_tokenizer()
    task = EmbeddingTask(query_prefix="query: ", document_prefix="passage: ", max_length=6)
    rows = [{"query": "Alpha beta", "positive": "gamma delta epsilon zeta eta theta iota", "negatives": ["kappa"]},
            {"query": "lambda", "positive": "mu", "instruction": "Find the passage"}]
    first, second = task.load_dataset(rows, tok)
    assert first.query_text == "query: Alpha beta"
    assert first.positive_text.startswith("passage: ") and first.negative_texts == ["passage: kappa"]
    assert second.query_text == "Instruct: Find the passage\nQuery: lambda"
    assert first.query == tok("query: Alpha beta")["input_ids"]
    assert len(first.positive) == 6  # truncated to max_length, [SEP] kept
    assert first.positive[-1] == tok.sep_token_id
    default = EmbeddingTask(instruction="Retrieve", instruction_template="<{instruction}> {query}")
    (feature,) = default.load_dataset([{"query": "q", "positive": "p"}], tok)
    assert feature.query_text == "<Retrieve> q"


def test_collate_layout_with_variable_negatives():
    task = EmbeddingTask()
    features = task.load_dataset(ROWS[:3], minilm_tokenizer())
    batch = task.collate(features)
    # 3 queries, then (positive + negatives) per query: 1+1, 1+0, 1+2
    assert batch["embedding_role"].tolist() == [ROLE_QUERY] * 3 + [ROLE_POSITIVE, ROLE_NEGATIVE, ROLE_POSITIVE,
                                                                   ROLE_POSITIVE, ROLE_NEGATIVE, ROLE_NEGATIVE]
    assert batch["embedding_owner"].tolist() == [0, 1, 2, 0, 0, 1, 2, 2, 2]
    assert batch["input_ids"].shape[0] == batch["attention_mask"].shape[0] == 9
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths[0] == len(features[0].query) and lengths[3] == len(features[0].positive)
    assert batch["embedding_hash"][3] == text_hash(ROWS[0]["positive"])
    assert text_hash("same text") == text_hash("same text") != text_hash("other text")


def test_left_padding_follows_the_tokenizer():
    from embedding_helpers import tiny_tokenizer

    task = EmbeddingTask()
    features = task.load_dataset(ROWS[:2], tiny_tokenizer(padding_side="left"))
    mask = task.collate(features)["attention_mask"]
    assert (mask[:, -1] == 1).all() and (mask[:, 0] == 0).any()
