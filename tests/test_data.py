"""The data layer: formats, chat template masking, loading, packing, collation, loader, causal_lm task."""

from __future__ import annotations

import json

import pytest

from twinkle_core.data import (
    IGNORE_INDEX,
    DataLoader,
    InputFeature,
    RowError,
    Template,
    TemplateError,
    Trajectory,
    collate_causal_lm,
    load_records,
    load_rows,
    pack_features,
    sequence_lengths_from_position_ids,
)
from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer

torch = pytest.importorskip("torch")

CONVERSATION = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "It is 6."},
    ]
}


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("transformers")
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_model(tok):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                                      max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    return model


class ForwardOnly:
    """The slice of TwinkleModel that evaluation uses."""

    def __init__(self, model):
        self.model = model
        self.calls = 0

    def forward_only(self, *, inputs, adapter_name=None, **kwargs):
        self.calls += 1
        with torch.no_grad():
            return {"logits": self.model(**inputs, use_cache=False).logits}


def labelled_spans(feature):
    spans, current = [], []
    for token, label in zip(feature.input_ids, feature.labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return spans


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------- tokenizer
def test_tiny_tokenizer_round_trip_and_reload(tok, tmp_path):
    from transformers import AutoTokenizer

    text = "Hello, World! 0123456789 +-*/=()[]{}<>?!.,;:'\"~`@#$%^&_|\\ \n\ttabs  double"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.chat_template == tok.chat_template
    assert again.convert_tokens_to_ids("<|im_end|>") == tok.convert_tokens_to_ids("<|im_end|>")


# ---------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize(("row", "reason"), [
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user"}]}, "has no 'content'"),
    ({"messages": [{"role": "user", "content": 3}]}, "content must be a string"),
    ({"messages": []}, "is empty"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "last message must be from the assistant"),
    ({"prompt": "x"}, "neither 'messages' nor 'conversations'"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown 'from'"),
])
def test_trajectory_validation(row, reason):
    with pytest.raises(ValueError, match=reason):
        Trajectory.from_dict(row)


def test_input_feature_validation():
    with pytest.raises(RowError, match="labels has 1 entries"):
        InputFeature(input_ids=[1, 2], labels=[1])
    feature = InputFeature.from_dict({"input_ids": [1, 2, 3], "weight": 0.5})
    assert feature.labels == [1, 2, 3] and feature.extra == {"weight": 0.5}
    with pytest.raises(RowError, match="integers"):
        InputFeature.from_dict({"input_ids": [1, "a"]})


# ---------------------------------------------------------------------------------------- template
def test_multi_turn_masking_trains_only_assistant_turns(tok):
    feature = Template(tok).encode(CONVERSATION)
    decoded = [tok.decode(span) for span in labelled_spans(feature)]
    assert decoded == ["4<|im_end|>", "It is 6.<|im_end|>"]
    assert feature.labels[0] == IGNORE_INDEX
    assert tok.decode(feature.input_ids) == tok.apply_chat_template(CONVERSATION["messages"], tokenize=False)
    # the prompt tokens equal the tokens the model sees at inference time
    prompt = Template(tok).encode_prompt(CONVERSATION["messages"][:2])
    assert feature.input_ids[: len(prompt)] == prompt
    assert feature.labels[len(prompt)] != IGNORE_INDEX and feature.labels[len(prompt) - 1] == IGNORE_INDEX


def test_sharegpt_is_normalised(tok):
    sharegpt = {
        "system": "Be brief.",
        "conversations": [
            {"from": "human", "value": "What is 2+2?"},
            {"from": "gpt", "value": "4"},
            {"from": "human", "value": "And 3+3?"},
            {"from": "gpt", "value": "It is 6."},
        ],
    }
    template = Template(tok)
    assert template.encode(sharegpt) == template.encode(CONVERSATION)
    assert [m.role for m in Trajectory.from_dict(sharegpt).messages] == ["system", "user", "assistant", "user",
                                                                         "assistant"]


def test_template_not_prefix_stable_is_reported(tok):
    tok2 = build_tiny_tokenizer()
    # announces the number of messages up front: earlier renderings are not prefixes of later ones
    tok2.chat_template = ("{{ messages|length }}:{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                          "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="not prefix-stable"):
        Template(tok2).encode(CONVERSATION)


def test_truncation(tok):
    full = Template(tok).encode(CONVERSATION)
    short = Template(tok, max_length=10).encode(CONVERSATION)
    assert short.input_ids == full.input_ids[:10] and len(short.labels) == 10
    with pytest.raises(RowError, match="more than max_length=10"):
        Template(tok, max_length=10, truncation="error").encode(CONVERSATION)


def test_pretrain_mode(tok):
    template = Template(tok, mode="pretrain")
    feature = template.encode({"text": "The quick brown fox.", "source": "web"})
    assert feature.input_ids[-1] == tok.eos_token_id
    assert tok.decode(feature.input_ids[:-1]) == "The quick brown fox."
    assert feature.labels[0] == IGNORE_INDEX and feature.labels[1:] == feature.input_ids[1:]
    assert feature.extra == {"source": "web"}
    with pytest.raises(RowError, match="mode='chat'"):
        template.encode(CONVERSATION)
    with pytest.raises(RowError, match="mode='pretrain'"):
        Template(tok).encode({"text": "hello"})


# ---------------------------------------------------------------------------------------- loading
def test_jsonl_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(CONVERSATION) + "\n\n{not json}\n", encoding="utf-8")
    with pytest.raises(DataFormatError) as info:
        load_rows(path)
    assert info.value.line == 3 and info.value.path == str(path)
    assert f"{path}:3" in str(info.value) and "invalid JSON" in str(info.value)


def test_bad_role_names_line(tmp_path):
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}
    path = write_jsonl(tmp_path / "train.jsonl", [CONVERSATION, CONVERSATION, bad])
    with pytest.raises(DataFormatError, match=r"train\.jsonl:3: message 1 has unknown role 'bot'"):
        load_rows(path)


def test_unsupported_suffix_and_missing_file(tmp_path):
    with pytest.raises(DataFormatError, match="unsupported file type"):
        load_rows(tmp_path / "data.txt")
    with pytest.raises(DataFormatError, match="no such file"):
        load_rows(tmp_path / "missing.jsonl")


def test_json_parquet_csv_loading(tmp_path):
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [CONVERSATION, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    json_path = tmp_path / "rows.json"
    json_path.write_text(json.dumps(rows), encoding="utf-8")
    assert load_rows(json_path) == rows

    parquet_path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet_path)
    assert load_rows(parquet_path) == rows

    csv_path = tmp_path / "text.csv"
    csv_path.write_text('text,source\n"hello, world",a\nsecond line,b\n', encoding="utf-8")
    assert load_rows(csv_path) == [{"text": "hello, world", "source": "a"}, {"text": "second line", "source": "b"}]

    # a CSV conversation column holds JSON text; a bad row is reported by its row number
    bad = [rows[0], {"messages": [{"role": "wizard", "content": "x"}]}]
    pq.write_table(pa.Table.from_pylist(bad), tmp_path / "bad.parquet")
    with pytest.raises(DataFormatError, match=r"bad\.parquet:2: message 0 has unknown role 'wizard'"):
        load_rows(tmp_path / "bad.parquet")
    records = load_records(parquet_path)
    assert [line for line, _ in records] == [1, 2]


def test_csv_conversations_as_json_text(tok, tmp_path):
    import csv

    path = tmp_path / "chat.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["messages"])
        writer.writerow([json.dumps(CONVERSATION["messages"])])
    from twinkle_core.tasks.causal_lm import CausalLMTask

    features = CausalLMTask().load_dataset(path, tok)
    assert features == [Template(tok).encode(CONVERSATION)]


# ---------------------------------------------------------------------------------------- causal_lm task
def test_causal_lm_task_load_and_errors(tok, tmp_path):
    from twinkle_core.lazy import import_object

    task_cls = import_object("twinkle_core.tasks.causal_lm:CausalLMTask")  # the builtins' reference
    task = task_cls(max_length=64)
    assert task.name == "causal_lm" and task.default_loss == "cross_entropy"
    path = write_jsonl(tmp_path / "train.jsonl", [CONVERSATION] * 5)
    features = task.load_dataset(path, tok)
    assert len(features) == 5 and all(len(f) <= 64 for f in features)
    batch = task.collate(features[:2])
    assert set(batch) == {"input_ids", "labels", "attention_mask"}

    packed = task.load_dataset(path, tok, packing=True, max_length=128)
    assert sum(f.extra["num_sequences"] for f in packed) == 5 and all(len(f) <= 128 for f in packed)
    assert "attention_mask" not in task.collate(packed)

    not_sft = {"messages": [{"role": "user", "content": "hi"}]}
    path = write_jsonl(tmp_path / "bad.jsonl", [CONVERSATION, not_sft])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: the last message must be from the assistant"):
        task.load_dataset(path, tok)
    with pytest.raises(ConfigError, match="packing=True needs max_length"):
        task_cls().load_dataset([CONVERSATION], tok, packing=True)
    with pytest.raises(RuntimeError, match="call load_dataset first"):
        task_cls().collate(features)


# ---------------------------------------------------------------------------------------- packing
def _features(lengths):
    out = []
    for n, length in enumerate(lengths):
        ids = [100 + n] * length
        labels = [IGNORE_INDEX] + ids[1:]
        out.append(InputFeature(input_ids=ids, labels=labels))
    return out


@pytest.mark.parametrize("strategy", ["first_fit_decreasing", "sequential"])
def test_packing(strategy):
    lengths = [5, 9, 3, 7, 2, 8, 1, 4, 6, 10, 3]
    features = _features(lengths)
    packed = pack_features(features, 12, strategy=strategy)
    assert packed == pack_features(features, 12, strategy=strategy)  # deterministic
    recovered = []
    for row in packed:
        assert len(row.input_ids) <= 12
        assert len(row.position_ids) == len(row.labels) == len(row.input_ids)
        starts = [i for i, p in enumerate(row.position_ids) if p == 0]
        assert starts[0] == 0 and len(starts) == row.extra["num_sequences"]
        for start, end in zip(starts, starts[1:] + [len(row.input_ids)], strict=True):
            assert row.position_ids[start:end] == list(range(end - start))
            assert row.labels[start] == IGNORE_INDEX  # no loss across a boundary
            assert row.labels[start + 1:end] == row.input_ids[start + 1:end]
            assert len(set(row.input_ids[start:end])) == 1
            recovered.append(row.input_ids[start:end])
    assert sorted(map(tuple, recovered)) == sorted(tuple(f.input_ids) for f in features)  # nothing lost
    if strategy == "first_fit_decreasing":
        assert len(packed) == -(-sum(lengths) // 12)  # optimal here: 58 tokens in 5 rows
    with pytest.raises(ValueError, match="more than the packing max_length"):
        pack_features(features, 8)


def test_packing_many_is_fast():
    import random

    rng = random.Random(0)
    features = _features([rng.randint(1, 200) for _ in range(3000)])
    packed = pack_features(features, 512)
    assert sum(f.extra["num_sequences"] for f in packed) == 3000
    assert sum(len(f) for f in packed) == sum(len(f) for f in features)


# ---------------------------------------------------------------------------------------- collate
def test_collate_padded():
    features = [InputFeature([5, 6, 7], [IGNORE_INDEX, 6, 7]), InputFeature([8], [IGNORE_INDEX])]
    batch = collate_causal_lm(features, pad_token_id=0)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [-100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["input_ids"].dtype == torch.long
    assert collate_causal_lm(features, 0, pad_to_multiple_of=4)["input_ids"].shape == (2, 4)
    as_dicts = collate_causal_lm([f.to_dict() for f in features], 0)
    assert all(torch.equal(as_dicts[k], batch[k]) for k in batch)


def test_collate_packed():
    packed = pack_features(_features([3, 2, 4]), 6, strategy="sequential")
    batch = collate_causal_lm(packed, pad_token_id=0, pad_to_multiple_of=8)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].shape == (2, 8)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert batch["labels"][0, 5:].tolist() == [IGNORE_INDEX] * 3
    assert sequence_lengths_from_position_ids(batch["position_ids"]) == [[3, 5], [8]]


def test_packed_batch_matches_separate_sequences(tiny_model):
    """The backend contract: position_ids without attention_mask = block-diagonal causal attention."""
    torch.manual_seed(1)
    seqs = [torch.randint(3, 400, (n,)).tolist() for n in (5, 7, 3)]
    features = [InputFeature(s, s) for s in seqs]
    batch = collate_causal_lm(pack_features(features, 20, strategy="sequential"), 0, pad_to_multiple_of=8)
    with torch.no_grad():
        packed = tiny_model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                            use_cache=False).logits[0]
        offset = 0
        for s in seqs:
            alone = tiny_model(input_ids=torch.tensor([s]), use_cache=False).logits[0]
            assert torch.allclose(packed[offset:offset + len(s)], alone, atol=1e-5)
            offset += len(s)


# ---------------------------------------------------------------------------------------- loader
def _ident(items):
    return list(items)


def _all_batches(loader):
    return [b for b in loader]


@pytest.mark.parametrize("drop_last", [False, True])
def test_loader_sharding_is_disjoint(drop_last):
    data = list(range(23))
    loaders = [DataLoader(data, 4, _ident, seed=3, drop_last=drop_last, dp_rank=r, dp_size=2) for r in range(2)]
    per_rank = [_all_batches(lo) for lo in loaders]
    assert len(per_rank[0]) == len(per_rank[1]) == len(loaders[0]) == (2 if drop_last else 3)
    seen = [sum(batches, []) for batches in per_rank]
    assert not set(seen[0]) & set(seen[1])
    assert len(seen[0]) == len(seen[1]) == (8 if drop_last else 11)
    assert [len(b) for b in per_rank[0]] == [len(b) for b in per_rank[1]]
    # next epoch: a different order, still disjoint
    again = [sum(_all_batches(lo), []) for lo in loaders]
    assert again[0] != seen[0] and not set(again[0]) & set(again[1])


def test_loader_rank_from_env(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = DataLoader(list(range(8)), 2, _ident, shuffle=False)
    assert (loader.dp_rank, loader.dp_size) == (1, 2)
    assert _all_batches(loader) == [[1, 3], [5, 7]]
    with pytest.raises(ValueError, match="not enough for one batch"):
        DataLoader([1], 2, _ident, drop_last=True, dp_rank=0, dp_size=1)


def test_loader_epochs_and_set_epoch():
    loader = DataLoader(list(range(10)), 3, _ident, seed=0, dp_rank=0, dp_size=1)
    first = _all_batches(loader)
    assert loader.epoch == 1 and sorted(sum(first, [])) == list(range(10))
    loader.set_epoch(0)
    assert _all_batches(loader) == first  # deterministic per (seed, epoch)
    unshuffled = DataLoader(list(range(5)), 2, _ident, shuffle=False, dp_rank=0, dp_size=1)
    assert _all_batches(unshuffled) == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("stop_after", [1, 3, 4, 8])
def test_loader_resume_is_exact(stop_after):
    def make():
        return DataLoader(list(range(17)), 3, _ident, seed=5, dp_rank=1, dp_size=2)

    reference = make()
    expected = []
    for epoch in range(3):
        reference.set_epoch(epoch)
        expected += [(epoch, b) for b in reference]

    # interrupted run: stop after `stop_after` batches, checkpoint the loader state
    loader = make()
    got = []
    state = None
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:
            got.append((epoch, batch))
            if len(got) == stop_after:
                state = json.loads(json.dumps(loader.state_dict()))
                break
        if state is not None:
            break
    resumed = make()
    resumed.load_state_dict(state)
    for epoch in range(state["epoch"], 3):
        resumed.set_epoch(epoch)
        got += [(epoch, b) for b in resumed]
    assert got == expected


def test_loader_state_mismatch():
    state = DataLoader(list(range(10)), 2, _ident, dp_rank=0, dp_size=1).state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(list(range(10)), 3, _ident, dp_rank=0, dp_size=1).load_state_dict(state)


# ---------------------------------------------------------------------------------------- generation / evaluate
def test_left_padded_generation_equals_unpadded(tiny_model, tok):
    from twinkle_core.tasks.causal_lm import greedy_generate

    model = ForwardOnly(tiny_model)
    template = Template(tok)
    prompts = [
        template.encode_prompt([{"role": "user", "content": "What is 2+2?"}]),
        template.encode_prompt([{"role": "user", "content": "hi"}]),
        template.encode_prompt([{"role": "system", "content": "Be brief and kind."},
                                {"role": "user", "content": "Translate good morning to French, please."}]),
    ]
    assert len({len(p) for p in prompts}) == 3
    batched = greedy_generate(model, prompts, max_new_tokens=8, pad_token_id=tok.pad_token_id)
    singles = [greedy_generate(model, [p], max_new_tokens=8, pad_token_id=tok.pad_token_id)[0] for p in prompts]
    assert batched == singles
    assert all(len(out) == 8 for out in batched)


class MemorisingModel:
    """Fake model: continues a known prompt with its memorised answer (then <|im_end|>)."""

    def __init__(self, answers, vocab_size, stop_id):
        self.answers = {tuple(p): list(a) + [stop_id] for p, a in answers}
        self.vocab_size = vocab_size
        self.calls = 0

    def forward_only(self, *, inputs, adapter_name=None, **kwargs):
        self.calls += 1
        ids, mask = inputs["input_ids"], inputs["attention_mask"]
        logits = torch.zeros(ids.shape[0], ids.shape[1], self.vocab_size)
        for row in range(ids.shape[0]):
            real = ids[row][mask[row].bool()].tolist()
            assert inputs["position_ids"][row, -1].item() == len(real) - 1
            for prompt, answer in self.answers.items():
                if tuple(real[: len(prompt)]) == prompt:
                    done = len(real) - len(prompt)
                    logits[row, -1, answer[min(done, len(answer) - 1)]] = 1.0
                    break
            else:
                logits[row, -1, 5] = 1.0
        return {"logits": logits}


def test_evaluate_exact_match(tok, tmp_path):
    from twinkle_core.tasks.causal_lm import CausalLMTask

    rows = [
        {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]},
        {"messages": [{"role": "user", "content": "Capital of France?"},
                      {"role": "assistant", "content": "Paris"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there"}]},
    ]
    template = Template(tok)
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    known = [(template.encode_prompt(Trajectory.from_dict(r).to_dicts()[:-1]), enc(a))
             for r, a in zip(rows, ["4", " Paris ", "wrong"], strict=True)]
    model = MemorisingModel(known, len(tok), im_end)
    task = CausalLMTask()
    path = write_jsonl(tmp_path / "eval.jsonl", rows)
    result = task.evaluate(model, str(path), tok, max_new_tokens=16, batch_size=2)
    assert result == {"exact_match": pytest.approx(2 / 3), "num_examples": 3}
    assert task.evaluate(model, rows, tok, limit=2) == {"exact_match": 1.0, "num_examples": 2}
    # features from load_dataset work too (prompt = tokens before the last trained span)
    features = task.load_dataset(rows, tok)
    assert task.evaluate(model, features, tok)["exact_match"] == pytest.approx(2 / 3)
    # early stop: the batch of two finished answers ends long before max_new_tokens
    model.calls = 0
    task.evaluate(model, rows[:2], tok, max_new_tokens=30, batch_size=2)
    assert model.calls <= 6
    with pytest.raises(ConfigError, match="unknown evaluate option"):
        task.evaluate(model, rows, tok, temperature=0.5)


def test_evaluate_with_tiny_qwen2(tiny_model, tok):
    """End to end with a real (random) model: its greedy output is its own reference, so it must match."""
    from twinkle_core.tasks.causal_lm import CausalLMTask, greedy_generate

    model = ForwardOnly(tiny_model)
    template = Template(tok)
    rows = []
    for question in ("What is 2+2?", "hi", "Tell me about Paris."):
        messages = [{"role": "user", "content": question}]
        out = greedy_generate(model, [template.encode_prompt(messages)], max_new_tokens=6,
                              pad_token_id=tok.pad_token_id, stop_token_ids=sorted(template.end_of_turn_ids))[0]
        answer = tok.decode(out, skip_special_tokens=True)
        rows.append({"messages": messages + [{"role": "assistant", "content": answer}]})
    result = CausalLMTask().evaluate(model, rows, tok, max_new_tokens=6, batch_size=3)
    assert result["num_examples"] == 3
    # answers that decode to whitespace-stripped-equal text count; the random model must reproduce itself
    assert result["exact_match"] == 1.0
