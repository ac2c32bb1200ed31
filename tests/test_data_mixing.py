"""Several sources in ``data.train``: concatenation, mixing by weight (seeded), recipes, resume, and ``twinkle train``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from twinkle_core.data.loader import DataLoader
from twinkle_core.data.mixing import _largest_remainder, load_spec, mix, parse_sources
from twinkle_core.errors import ConfigError, DataFormatError


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def two_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(30)])
    return a, b


def texts(records):
    return [r.row["text"] for r in records]


def test_a_list_without_weights_concatenates(two_files):
    a, b = two_files
    assert texts(load_spec([a, {"path": b}])) == [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(30)]
    assert texts(load_spec(a)) == [f"a{i}" for i in range(10)]


def test_weights_fix_the_share_of_each_source(two_files):
    a, b = two_files
    records = load_spec([{"path": a, "weight": 0.7}, {"path": b, "weight": 0.3}], seed=1)
    assert len(records) == 40  # N = 10 + 30
    counts = Counter(t[0] for t in texts(records))
    assert counts == {"a": 28, "b": 12}  # 0.7 * 40 and 0.3 * 40
    a_rows = Counter(t for t in texts(records) if t[0] == "a")
    assert sorted(a_rows.values()) == [2] * 2 + [3] * 8  # 2 full copies + 8 distinct extra rows
    b_rows = [t for t in texts(records) if t[0] == "b"]
    assert len(set(b_rows)) == 12 and b_rows == sorted(b_rows, key=lambda t: int(t[1:]))  # a subset, file order
    # the same seed gives the same mixture; another seed another subset
    again = load_spec([{"path": a, "weight": 7}, {"path": b, "weight": 3}], seed=1)
    assert texts(again) == texts(records)
    other = load_spec([{"path": a, "weight": 0.7}, {"path": b, "weight": 0.3}], seed=2)
    assert Counter(t[0] for t in texts(other)) == counts and texts(other) != texts(records)


def test_largest_remainder_rounding_adds_up():
    assert _largest_remainder(10, [1, 1, 1]) == [4, 3, 3]
    assert sum(_largest_remainder(1001, [0.2, 0.5, 0.3])) == 1001
    assert mix([[1, 2], [3]], None, 0) == [1, 2, 3]


@pytest.mark.parametrize("spec, message", [
    ([{"path": "a", "weight": 1}, {"path": "b"}], r"data.train\[1\]: has no weight"),
    ([{"path": "a", "weight": 0}], r"data.train\[0\].weight: must be a number > 0"),
    ([{"path": "a", "wieght": 1}], r"unknown key\(s\) wieght"),
    ([], "empty"),
    ([{"path": "a", "columns": {"q": "nope"}}], r"data.train\[0\].columns.q: unknown target 'nope'"),
])
def test_bad_source_lists(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_sources(spec)


def test_a_bad_row_in_a_mixture_names_its_file_and_line(two_files, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: message 0 has unknown role 'robot'"):
        load_spec([two_files[0], bad], validate=__import__("twinkle_core.data.loading", fromlist=["x"]).validate_row)


def test_mixture_is_the_same_on_every_rank_and_resume_is_exact(two_files):
    a, b = two_files
    spec = [{"path": a, "weight": 0.5}, {"path": b, "weight": 0.5}]

    def batches(rank, loader=None, count=None):
        data = texts(load_spec(spec, seed=3))
        loader = loader or DataLoader(data, 4, shuffle=True, seed=3, dp_rank=rank, dp_size=2)
        out = []
        for batch in loader:
            out.append(batch)
            if count is not None and len(out) == count:
                break
        return out, loader

    rank0, _ = batches(0)
    rank1, _ = batches(1)
    assert len(rank0) == len(rank1) == 5
    first, loader = batches(0, count=2)
    state = loader.state_dict()
    resumed = DataLoader(texts(load_spec(spec, seed=3)), 4, shuffle=True, seed=3, dp_rank=0, dp_size=2)
    resumed.load_state_dict(state)
    assert first + list(resumed) == rank0


# ---------------------------------------------------------------------------------------- recipes
def test_recipe_accepts_source_lists_and_resolves_their_paths(tmp_path, two_files):
    from twinkle_core.train.recipe import check_paths, load_recipe

    (tmp_path / "r.yaml").write_text(
        "model: {config: {model_type: qwen2}, tokenizer: tok}\n"
        "data:\n  train: [{path: a.jsonl, weight: 0.7}, {path: b.jsonl, weight: 0.3}, c.jsonl]\n"
        "  columns: {question: instruction, answer: output}\n  template: qwen3\n")
    recipe = load_recipe(tmp_path / "r.yaml")
    assert recipe.data.train[0] == {"path": str(tmp_path / "a.jsonl"), "weight": 0.7}
    assert recipe.data.columns == {"question": "instruction", "answer": "output"} and recipe.data.template == "qwen3"
    with pytest.raises(ConfigError, match=r"data.train\[2\]: 'c.jsonl' does not exist"):
        check_paths(recipe)
    single = load_recipe(tmp_path / "r.yaml", ["data.train=a.jsonl", "data.columns=null", "data.template=null"])
    assert single.data.train == "a.jsonl"  # an override is relative to the working directory


def test_validate_components_checks_sources_and_template(tmp_path, two_files):
    pytest.importorskip("torch")
    pytest.importorskip("twinkle_backend_hf")  # the recipe's model class
    from twinkle_core.train.recipe import recipe_from_dict, validate_components

    base = {"model": {"config": {"model_type": "qwen2"}, "tokenizer": "tok"}}
    good = recipe_from_dict({**base, "data": {"train": [{"path": two_files[0], "weight": 1}], "template": "glm4"}})
    validate_components(good)
    for data, message in [({"train": [{"path": "a", "weight": 1}, "b"]}, "has no weight"),
                          ({"train": "a", "template": "lama3"}, "did you mean 'llama3'"),
                          ({"train": "a", "columns": {"q": "question"}}, "unknown target 'question'")]:
        with pytest.raises(ConfigError, match=message):
            validate_components(recipe_from_dict({**base, "data": data}))


# ---------------------------------------------------------------------------------------- end to end
def test_twinkle_train_mixes_an_alpaca_file_with_a_parquet_file(tmp_path):
    """``twinkle train`` (one process, a tiny Qwen2 model, the quickstart tokenizer) on Alpaca JSONL + parquet."""
    datasets = pytest.importorskip("datasets")
    pytest.importorskip("twinkle_backend_hf")
    root = Path(__file__).resolve().parents[1]
    write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": "reverse:", "input": w, "output": w[::-1]}
                                           for w in ("abc", "dog", "moon", "star", "sun", "tree")])
    datasets.Dataset.from_list([{"question": f"upper: {w}", "answer": w.upper()} for w in ("cat", "sky", "box")]) \
        .to_parquet(str(tmp_path / "qa.parquet"))
    (tmp_path / "recipe.yaml").write_text(f"""
task: causal_lm
model:
  tokenizer: {root / 'examples' / 'quickstart' / 'tokenizer'}
  config: {{model_type: qwen2, vocab_size: 262, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
           num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 64, tie_word_embeddings: true,
           bos_token_id: 0, eos_token_id: 0, pad_token_id: 0}}
data:
  train:
    - {{path: alpaca.jsonl, weight: 0.5}}
    - {{path: qa.parquet, weight: 0.5, columns: {{question: user, answer: assistant}}}}
  template: chatml
  max_length: 48
  batch_size: 3
train: {{output_dir: out, max_steps: 2, save_every: 1, log_every: 1, seed: 0}}
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWINKLE_") and k not in ("WORLD_SIZE", "RANK")}
    env.update(HF_HUB_OFFLINE="1", TWINKLE_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(tmp_path / "recipe.yaml")],
                            capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "twinkle: done at step 2/2" in result.stdout
    logs = [json.loads(line) for line in (tmp_path / "out" / "logs.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs if r["event"] == "train"] == [1, 2]
    saved = (tmp_path / "out" / "final" / "chat_template.jinja")
    assert not saved.exists() or "<|im_start|>" in saved.read_text()
