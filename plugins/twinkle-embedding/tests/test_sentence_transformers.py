"""Interoperability with sentence-transformers, both ways.

* A model Twinkle saves loads with plain ``SentenceTransformer(path)`` and encodes like Twinkle does
  (atol 1e-5): encoders (mean / cls, normalised or not), decoders (last_token, left and right
  padding), prompts, LoRA adapters.
* A sentence-transformers directory (the real all-MiniLM-L6-v2, and one written by
  sentence-transformers itself) loads into Twinkle with its pooling, normalisation, length and prompts.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from embedding_helpers import (
    ROWS,
    TINY_BERT,
    TINY_QWEN3,
    make_model,
    minilm_path,
    minilm_tokenizer,
    tiny_tokenizer,
)
from twinkle_embedding.st_format import read_sentence_transformers_config
from twinkle_embedding.task import EmbeddingTask

from twinkle_core.errors import ConfigError

ATOL = 1e-5
TEXTS = ["how cold are winters in velmora", "Velmora has snowy winters and frozen lakes", "a",
         "a much longer sentence, with punctuation, that makes the others in its batch padded"]


def load_st(path):
    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SentenceTransformer(str(path), device="cpu")


def train_step(model, task, steps=1):
    features = task.load_dataset(ROWS, task.tokenizer) if task.tokenizer is not None else None
    model.set_loss("infonce")
    model.set_optimizer("AdamW", lr=1e-2)
    for _ in range(steps):
        model.forward_backward(inputs=task.collate(features))
        model.clip_grad_and_step()


def assert_same(st_embeddings, ours):
    delta = float((torch.as_tensor(st_embeddings) - ours).abs().max())
    assert delta < ATOL, delta
    return delta


@pytest.mark.parametrize(("pooling", "normalize"), [("mean", True), ("cls", False)])
def test_encoder_round_trip(tmp_path, pooling, normalize):
    tok = minilm_tokenizer()
    task = EmbeddingTask(pooling=pooling, normalize=normalize, query_prefix="query: ", document_prefix="doc: ",
                         max_length=48)
    task.load_dataset(ROWS, tok)
    model = make_model(task, config=TINY_BERT, tokenizer=tok)
    train_step(model, task)
    path = model.save("saved", output_dir=str(tmp_path), save_optimizer=False)
    modules = json.loads(open(os.path.join(path, "modules.json")).read())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling"] + (["Normalize"] * normalize)
    st = load_st(path)
    assert st.max_seq_length == 48
    assert_same(st.encode(TEXTS, convert_to_tensor=True), task.encode(model, TEXTS))
    assert_same(st.encode(TEXTS, prompt_name="query", convert_to_tensor=True), task.encode_queries(model, TEXTS))
    assert_same(st.encode(TEXTS, prompt_name="document", convert_to_tensor=True),
                task.encode_documents(model, TEXTS))
    norms = task.encode(model, TEXTS).norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5) == normalize


@pytest.mark.parametrize("side", ["left", "right"])
def test_decoder_last_token_round_trip(tmp_path, side):
    tok = tiny_tokenizer(padding_side=side)
    task = EmbeddingTask(instruction="Find the passage about the town")
    task.load_dataset(ROWS, tok)
    model = make_model(task, config=TINY_QWEN3, tokenizer=tok)
    assert task.pooling == "last_token" and task.normalize is True  # auto, for a decoder without ST config
    train_step(model, task)
    path = model.save("saved", output_dir=str(tmp_path), save_optimizer=False)
    st = load_st(path)
    assert st.tokenizer.padding_side == side
    assert_same(st.encode(TEXTS, convert_to_tensor=True), task.encode(model, TEXTS))
    prompts = json.loads(open(os.path.join(path, "config_sentence_transformers.json")).read())["prompts"]
    assert prompts == {"query": "Instruct: Find the passage about the town\nQuery: "}
    assert_same(st.encode(TEXTS, prompt_name="query", convert_to_tensor=True), task.encode_queries(model, TEXTS))


def test_decoder_as_causal_lm_pools_the_same_hidden_states():
    tok = tiny_tokenizer()
    encoder_task, lm_task = EmbeddingTask(), EmbeddingTask(model_kind="causal_lm")
    for task in (encoder_task, lm_task):
        task.load_dataset(ROWS, tok)
    base = make_model(encoder_task, config=TINY_QWEN3, tokenizer=tok)
    lm = make_model(lm_task, config=TINY_QWEN3, tokenizer=tok)
    assert type(lm.module).__name__ == "Qwen3ForCausalLM" and type(base.module).__name__ == "Qwen3Model"
    lm.module.model.load_state_dict(base.module.state_dict())
    assert torch.allclose(encoder_task.encode(base, TEXTS), lm_task.encode(lm, TEXTS), atol=1e-6)
    # training through the LM head's model works (its logits are unused but must not break backward)
    lm.set_loss("infonce")
    lm.set_optimizer("AdamW", lr=1e-3)
    out = lm.forward_backward(inputs=lm_task.collate(lm_task.load_dataset(ROWS, tok)))
    assert torch.isfinite(out["loss"])


def test_minilm_directory_loads_with_its_pooling_and_trains_with_lora(tmp_path):
    tok = minilm_tokenizer()
    task = EmbeddingTask()
    task.load_dataset(ROWS, tok)
    model = make_model(task, model_id=minilm_path(), tokenizer=tok,
                       adapter={"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": ["query", "value"]})
    assert (task.pooling, task.normalize, task.max_length) == ("mean", True, 256)  # from modules.json & co.
    original = load_st(minilm_path())
    before = task.encode(model, TEXTS)
    assert_same(original.encode(TEXTS, convert_to_tensor=True), before)
    train_step(model, task, steps=2)
    after = task.encode(model, TEXTS)
    assert float((after - before).abs().max()) > 1e-4  # it trained
    path = model.save("lora", output_dir=str(tmp_path), save_optimizer=False)
    assert os.path.exists(os.path.join(path, "adapter_config.json"))
    assert_same(load_st(path).encode(TEXTS, convert_to_tensor=True), after)


def test_directory_written_by_sentence_transformers_loads_into_twinkle(tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoConfig, AutoModel

    tok = minilm_tokenizer()
    config = dict(TINY_BERT)
    network = AutoModel.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    network.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformer = Transformer(str(tmp_path / "hf"))
        st = SentenceTransformer(modules=[transformer, Pooling(32, pooling_mode="cls")], device="cpu",
                                 prompts={"query": "query: ", "document": ""})
        st.save(str(tmp_path / "st"))
    found = read_sentence_transformers_config(tmp_path / "st")
    assert (found.pooling, found.normalize, found.prompts) == ("cls", False, {"query": "query: "})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "st")
    task = EmbeddingTask()
    task.load_dataset(ROWS, tok)
    assert task.query_prefix == "query: "
    model = make_model(task, model_id=str(tmp_path / "st"), tokenizer=tok)
    assert (task.pooling, task.normalize) == ("cls", False)
    assert_same(st.encode(TEXTS, prompt_name="query", convert_to_tensor=True), task.encode_queries(model, TEXTS))


def test_unsupported_pipelines_are_refused(tmp_path):
    def directory(name, modules, pooling=None):
        path = tmp_path / name
        path.mkdir()
        (path / "modules.json").write_text(json.dumps(modules))
        if pooling is not None:
            (path / "1_Pooling").mkdir()
            (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        return path

    base = [{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    dense = directory("dense", [*base, {"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}],
                      {"pooling_mode": "mean"})
    with pytest.raises(ConfigError, match="Dense"):
        read_sentence_transformers_config(dense)
    several = directory("several", base, {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True})
    with pytest.raises(ConfigError, match="several modes"):
        read_sentence_transformers_config(several)
    maximum = directory("max", base, {"pooling_mode": "max"})
    with pytest.raises(ConfigError, match="not supported"):
        read_sentence_transformers_config(maximum)
    nested = directory("nested", [{"idx": 0, "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"}])
    with pytest.raises(ConfigError, match="0_Transformer"):
        read_sentence_transformers_config(nested)
    assert read_sentence_transformers_config(tmp_path) is None  # no modules.json: not a sentence-transformers dir
