"""Streaming pre-training data (twinkle_core.data.streaming): packing, sharding, exact resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from twinkle_core.data.streaming import StreamingDataLoader, StreamingPretrainDataset  # noqa: E402
from twinkle_core.data.template import Template  # noqa: E402
from twinkle_core.errors import ConfigError  # noqa: E402
from twinkle_core.tasks.causal_lm import CausalLMTask  # noqa: E402
from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LENGTH = 16


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def texts(n=40, start=0):
    return [{"text": f"document {i} " + "abc " * (i % 7)} for i in range(start, start + n)]


@pytest.fixture()
def files(tmp_path):
    first = tmp_path / "a.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in texts(25)) + "\n")  # a blank line too
    import pyarrow as pa
    import pyarrow.parquet as pq

    second = tmp_path / "b.parquet"
    pq.write_table(pa.Table.from_pylist(texts(20, start=25)), second, row_group_size=7)
    return [str(first), str(second)]


def dataset(tok, files):
    return StreamingPretrainDataset(files, Template(tok, mode="pretrain", max_length=LENGTH))


def expected_rows(tok, rows):
    ids = []
    for row in rows:
        piece = list(tok(row["text"], add_special_tokens=True)["input_ids"])
        if piece[-1] != tok.eos_token_id:
            piece.append(tok.eos_token_id)
        ids += piece
    return [ids[i:i + LENGTH] for i in range(0, len(ids) - LENGTH + 1, LENGTH)]


def rows_of(batch):
    return [list(f.input_ids) for f in batch]


def test_packing_concatenates_and_splits(tok, files):
    data = dataset(tok, files)
    rows = [ids for ids, _ in data.packed_rows()]
    assert rows == expected_rows(tok, texts(45))
    assert all(len(r) == LENGTH for r in rows)
    feature = data.feature(rows[0])
    assert feature.labels[0] == -100 and feature.labels[1:] == rows[0][1:]


def test_two_ranks_cover_the_stream_disjointly(tok, files):
    all_rows = expected_rows(tok, texts(45))
    batch_size, world = 2, 2
    seen = []
    per_rank = []
    for rank in range(world):
        loader = StreamingDataLoader(dataset(tok, files), batch_size, dp_rank=rank, dp_size=world)
        batches = [rows_of(b) for b in loader]
        assert loader.epoch == 1  # the epoch ended
        per_rank.append(len(batches))
        seen += [r for b in batches for r in b]
    assert per_rank[0] == per_rank[1] == len(all_rows) // (batch_size * world)
    used = per_rank[0] * batch_size * world
    assert sorted(seen) == sorted(all_rows[:used])  # each used row exactly once, none twice


def test_resume_mid_epoch_continues_identically(tok, files):
    def make():
        return StreamingDataLoader(dataset(tok, files), 3, dp_rank=1, dp_size=2)

    reference = make()
    uninterrupted = []
    for epoch in range(2):
        reference.set_epoch(epoch)
        uninterrupted += [rows_of(b) for b in reference]
    first = make()
    taken = []
    for batch in first:
        taken.append(rows_of(batch))
        if len(taken) == 2:
            break
    state = json.loads(json.dumps(first.state_dict()))
    assert state["buffer"] or state["offset"]
    second = make()
    second.set_epoch(state["epoch"])
    second.load_state_dict(state)
    resumed = taken + [rows_of(b) for b in second]
    second.set_epoch(1)
    resumed += [rows_of(b) for b in second]
    assert resumed == uninterrupted

    other = StreamingDataLoader(dataset(tok, files), 2, dp_rank=1, dp_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        other.load_state_dict(state)


def test_causal_lm_streaming_options(tok, files):
    data = CausalLMTask().load_dataset(files, tok, mode="pretrain", max_length=LENGTH, streaming=True)
    assert isinstance(data, StreamingPretrainDataset)
    with pytest.raises(ConfigError, match="pretrain"):
        CausalLMTask().load_dataset(files, tok, mode="chat", max_length=LENGTH, streaming=True, template="chatml")
    with pytest.raises(ConfigError, match="max_length"):
        CausalLMTask().load_dataset(files, tok, mode="pretrain", streaming=True)


RECIPE = """
task: causal_lm
model:
  class_name: TransformersModel
  tokenizer: {tokenizer}
  config: {{model_type: qwen2, vocab_size: 262, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
           num_attention_heads: 2, num_key_value_heads: 1, max_position_embeddings: 64, tie_word_embeddings: true,
           bos_token_id: 0, eos_token_id: 0, pad_token_id: 0}}
precision: "no"
data: {{train: {data}, mode: pretrain, max_length: 24, batch_size: 2, streaming: true}}
optimizer: {{name: AdamW, lr: 1.0e-3}}
lr_scheduler: {{name: constant}}
train: {{output_dir: {out}, max_steps: 6, save_every: 3, log_every: 1}}
"""


def _train(recipe: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(recipe), *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))


def _losses(out: Path) -> dict[int, float]:
    logs = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in logs if r.get("event") == "train"}


@pytest.mark.timeout(900)
def test_twinkle_train_streaming_resumes_identically(tmp_path):
    pytest.importorskip("twinkle_backend_hf")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in texts(400)))
    tokenizer = ROOT / "examples" / "quickstart" / "tokenizer"

    def recipe(name):
        path = tmp_path / f"{name}.yaml"
        path.write_text(textwrap.dedent(RECIPE.format(tokenizer=tokenizer, data=data, out=tmp_path / name)))
        return path

    full = _train(recipe("full"))
    assert full.returncode == 0, full.stderr[-3000:]
    expected = _losses(tmp_path / "full")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    split = recipe("split")
    first = _train(split, "train.max_steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    again = _train(split, "--resume", "latest")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    resumed = _losses(tmp_path / "split")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step

    no_steps = _train(split, "train.max_steps=null", "--overwrite")  # (a new run there must say --overwrite)
    assert no_steps.returncode != 0 and "train.max_steps" in no_steps.stderr
