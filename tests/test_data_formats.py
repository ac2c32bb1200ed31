"""Row formats (Alpaca), column mapping, and reading files / directories / hub ids through ``datasets``."""

from __future__ import annotations

import json
import sys

import pytest

from twinkle_core.data.formats import Trajectory
from twinkle_core.data.loading import load_records
from twinkle_core.data.mixing import load_spec, map_columns
from twinkle_core.errors import ConfigError, DataFormatError, SourceError

CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                     {"role": "user", "content": "Add 3\n5"}, {"role": "assistant", "content": "8"}]}
ALPACA = {"system": "Be brief.", "history": [["What is 2+2?", "4"]], "instruction": "Add 3", "input": "5",
          "output": "8"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("transformers")
    from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer()


# ---------------------------------------------------------------------------------------- Alpaca
def test_alpaca_row_becomes_messages(tok):
    trajectory = Trajectory.from_dict(ALPACA)
    assert trajectory.to_dicts() == CHAT["messages"]
    assert Trajectory.from_dict({"instruction": "hi", "input": "", "output": "yo", "id": 3}).to_dicts() == [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert Trajectory.from_dict({"instruction": "hi", "input": None, "output": "yo", "id": 3}).extra == {"id": 3}
    from twinkle_core.data.template import Template

    assert Template(tok).encode(ALPACA) == Template(tok).encode(CHAT)


@pytest.mark.parametrize("row, reason", [
    ({"instruction": "x"}, "has no 'output'"),
    ({"instruction": "x", "output": 3}, "'output' must be a string"),
    ({"instruction": "x", "output": "y", "history": [["a"]]}, "'history' item 0 must be a \\[user, assistant\\]"),
    ({"instruction": "x", "output": "y", "history": "nope"}, "not valid JSON"),
])
def test_alpaca_errors_name_file_and_line(tmp_path, row, reason):
    path = write_jsonl(tmp_path / "a.jsonl", [ALPACA, row])
    with pytest.raises(DataFormatError, match=f"a.jsonl:2: .*{reason}"):
        load_spec(str(path), validate=__import__("twinkle_core.data.loading", fromlist=["x"]).validate_row)


def test_alpaca_through_the_causal_lm_task(tok, tmp_path):
    from twinkle_core.tasks.causal_lm import CausalLMTask

    path = write_jsonl(tmp_path / "a.jsonl", [ALPACA, {"instruction": "x", "input": "y"}])
    with pytest.raises(DataFormatError, match=r"a.jsonl:2: Alpaca row .* has no 'output'"):
        CausalLMTask().load_dataset(str(path), tok)
    write_jsonl(path, [ALPACA])
    assert CausalLMTask().load_dataset(str(path), tok) == CausalLMTask().load_dataset([CHAT], tok)


# ---------------------------------------------------------------------------------------- columns
def test_column_mapping_renames_and_builds_roles():
    assert map_columns({"question": "q", "answer": "a", "id": 1}, {"question": "instruction", "answer": "output"}) == {
        "instruction": "q", "output": "a", "id": 1}
    row = map_columns({"prompt": "q", "response": "a", "sys": "s"}, {"prompt": "user", "response": "assistant",
                                                                     "sys": "system"})
    assert Trajectory.from_dict(row).to_dicts() == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"}]


def test_column_mapping_in_files_and_errors(tok, tmp_path):
    from twinkle_core.tasks.causal_lm import CausalLMTask

    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Add 3\n5", "answer": "8"},
                                               {"question": "Add 1\n1", "reply": "2"}])
    task = CausalLMTask()
    with pytest.raises(DataFormatError, match=r"qa.jsonl:2: column 'answer' \(mapped by columns: answer -> output\) "
                                              r"is missing; the row has the columns 'question', 'reply'"):
        task.load_dataset(str(path), tok, columns={"question": "instruction", "answer": "output"})
    write_jsonl(path, [{"question": "Add 3\n5", "answer": "8"}])
    mapped = task.load_dataset(str(path), tok, columns={"question": "instruction", "answer": "output"})
    assert mapped == task.load_dataset([{"messages": CHAT["messages"][3:]}], tok)
    roles = task.load_dataset(str(path), tok, columns={"question": "user", "answer": "assistant"})
    assert roles == mapped
    with pytest.raises(ConfigError, match="unknown target 'outptu'"):
        task.load_dataset(str(path), tok, columns={"answer": "outptu"})
    with pytest.raises(ConfigError, match="needs one mapped to 'assistant'"):
        task.load_dataset(str(path), tok, columns={"question": "user"})


# ---------------------------------------------------------------------------------------- datasets-backed files
datasets = pytest.importorskip("datasets")


def rows_of(records):
    return [row for _, row in records]


def test_parquet_arrow_csv_json_and_saved_directories(tmp_path):
    rows = [{"instruction": f"say {i}", "input": "", "output": f"n{i}"} for i in range(5)]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    table.to_json(str(tmp_path / "d.json"), lines=True)
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / "dict"))
    import pyarrow as pa

    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as sink:
        arrow = pa.Table.from_pylist(rows)
        with pa.ipc.new_stream(sink, arrow.schema) as writer:
            writer.write_table(arrow)
    for name in ("d.parquet", "d.json", "d.arrow", "saved", "dict"):
        records = load_records(tmp_path / name)
        assert [line for line, _ in records] == [1, 2, 3, 4, 5], name
        assert rows_of(records) == rows, name
    csv = rows_of(load_records(tmp_path / "d.csv"))  # an empty CSV cell reads as null
    assert [r["output"] for r in csv] == ["n0", "n1", "n2", "n3", "n4"]
    assert rows_of(load_records(tmp_path / "dict", split="test")) == rows[:1]
    with pytest.raises(DataFormatError, match="no split 'dev'; it has 'train', 'test'"):
        load_records(tmp_path / "dict", split="dev")


def test_bad_row_in_parquet_names_the_row(tok, tmp_path):
    from twinkle_core.tasks.causal_lm import CausalLMTask

    datasets.Dataset.from_list([{"instruction": "a", "output": "b"}, {"instruction": "c", "output": None}]).to_parquet(
        str(tmp_path / "bad.parquet"))
    with pytest.raises(DataFormatError, match=r"bad.parquet:2: Alpaca row .* has no 'output'"):
        CausalLMTask().load_dataset(str(tmp_path / "bad.parquet"), tok)


def test_without_datasets_the_error_names_pip_install(tmp_path, monkeypatch):
    datasets.Dataset.from_list([{"text": "x"}]).to_parquet(str(tmp_path / "d.parquet"))
    write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}])
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataFormatError, match="pip install datasets"):
        load_records(tmp_path / "d.parquet")
    assert rows_of(load_records(tmp_path / "d.jsonl")) == [{"text": "x"}]  # JSONL never needs it


@pytest.mark.parametrize("uri", ["hf://nobody-here/no-such-dataset-xyz", "hf://nobody-here/no-such-dataset-xyz@main"])
def test_hub_dataset_offline_is_a_clear_error(tmp_path, monkeypatch, uri):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    start = time.monotonic()
    with pytest.raises(SourceError) as info:
        load_records(uri)
    message = str(info.value)
    assert "hf://nobody-here/no-such-dataset-xyz" in message and "offline" in message
    assert "hf download nobody-here/no-such-dataset-xyz --repo-type dataset" in message and "local path" in message
    assert time.monotonic() - start < 20


def test_hub_dataset_from_the_local_cache(tmp_path, monkeypatch):
    """An ``hf://`` data set already in the cache is read offline (a snapshot laid out as the hub does)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    import importlib

    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "cache" / "datasets--org--data"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit / "data"
    snapshot.mkdir(parents=True)
    datasets.Dataset.from_list([{"instruction": "a", "output": "b"}]).to_parquet(str(snapshot / "train.parquet"))
    importlib.import_module("twinkle_core.data.hub")
    assert rows_of(load_records("hf://org/data")) == [{"instruction": "a", "output": "b"}]
