"""The task on the HF backend: training (full and LoRA), evaluation metrics, the training loop, and how
the pooling composes with models."""

from __future__ import annotations

import json
import os

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
from twinkle_embedding.metrics import retrieval_metrics
from twinkle_embedding.task import EmbeddingTask

from twinkle_core.errors import ConfigError


def test_retrieval_metrics_by_hand():
    scores = torch.tensor([[0.9, 0.8, 0.1],    # relevant doc 1 ranked 2nd
                           [0.1, 0.2, 0.95],   # relevant doc 2 ranked 1st
                           [0.5, 0.4, 0.3]])   # relevant {1, 2}: ranks 2 and 3
    metrics = retrieval_metrics(scores, [{1}, {2}, {1, 2}], ks=(1, 2))
    assert metrics["recall@1"] == pytest.approx(1 / 3)
    assert metrics["recall@2"] == pytest.approx((1 + 1 + 0.5) / 3)
    assert metrics["mrr@10"] == pytest.approx((1 / 2 + 1 + 1 / 2) / 3)


@pytest.mark.parametrize("kind", ["bert-full", "bert-lora", "qwen3-full", "qwen3-lora"])
def test_training_lowers_the_loss(kind):
    family, mode = kind.split("-")
    tok = minilm_tokenizer() if family == "bert" else tiny_tokenizer(padding_side="left")
    task = EmbeddingTask()
    features = task.load_dataset(ROWS, tok)
    adapter = ({"type": "lora", "r": 8, "lora_alpha": 16, "target_modules": "all-linear"} if mode == "lora"
               else None)
    model = make_model(task, config=TINY_BERT if family == "bert" else TINY_QWEN3, tokenizer=tok, adapter=adapter)
    model.set_loss("infonce", temperature=0.05)
    model.set_optimizer("AdamW", lr=3e-2 if mode == "lora" else 1e-2)
    batch = task.collate(features)
    losses = []
    for _ in range(8):
        losses.append(float(model.forward_backward(inputs=batch)["loss"]))
        model.clip_grad_and_step(max_grad_norm=1.0)
    assert losses[-1] < losses[0] * 0.7, losses
    if family == "bert":
        frozen = [n for n, p in model.hf_model.named_parameters() if n.startswith("pooler.")]
        assert frozen and not any(p.requires_grad for n, p in model.hf_model.named_parameters()
                                  if n.startswith("pooler.") and "lora" not in n)


def test_evaluate_reports_recall_and_mrr(tmp_path):
    tok = minilm_tokenizer()
    task = EmbeddingTask()
    features = task.load_dataset(ROWS, tok)
    model = make_model(task, model_id=minilm_path(), tokenizer=tok)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Unrelated note number {i} about pottery"}) + "\n" for i in range(4)))
    metrics = task.evaluate(model, features, tok, k=[1, 3], corpus=str(corpus))
    assert set(metrics) == {"recall@1", "recall@3", "mrr@10", "num_queries", "corpus_size"}
    assert metrics["num_queries"] == 6 and metrics["corpus_size"] == 6 + 7 + 4
    # the same numbers from sentence-transformers' own encoding of the same corpus
    import warnings

    from sentence_transformers import SentenceTransformer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        st = SentenceTransformer(minilm_path(), device="cpu")
    docs = []
    for row in ROWS:
        docs += [d for d in [row["positive"], *row["negatives"]] if d not in docs]
    docs += [f"Unrelated note number {i} about pottery" for i in range(4)]
    scores = st.encode([r["query"] for r in ROWS], convert_to_tensor=True) @ st.encode(docs, convert_to_tensor=True).T
    expected = retrieval_metrics(scores, [{docs.index(r["positive"])} for r in ROWS], ks=(1, 3))
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-9), key
    assert 0 < metrics["recall@1"] <= metrics["recall@3"] and metrics["recall@1"] <= metrics["mrr@10"]
    with pytest.raises(ConfigError, match="unknown option"):
        task.evaluate(model, features, tok, top_k=3)


def test_training_loop_logs_retrieval_metrics_and_saves_a_sentence_transformers_model(tmp_path):
    from twinkle_core.train.loop import train

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = dict(TINY_BERT)
    summary = train({
        "task": "embedding",
        "task_options": {"pooling": "mean"},
        "model": {"config": config, "tokenizer": minilm_path()},
        "data": {"train": str(data), "eval": str(data), "batch_size": 3, "max_length": 32},
        "optimizer": {"lr": 1e-3},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "eval_before_training": True,
                  "evaluate_options": {"k": [1, 2]}},
    })
    for key in ("eval_loss", "eval_recall@1", "eval_recall@2", "eval_mrr@10"):
        assert key in summary["eval_before"] and key in summary["eval_after"]
    logs = [json.loads(line) for line in open(tmp_path / "run" / "logs.jsonl")]
    assert [r["step"] for r in logs if r["event"] == "eval"] == [0, 2]
    final = summary["final_checkpoint"]
    assert json.load(open(os.path.join(final, "1_Pooling", "config.json")))["pooling_mode_mean_tokens"] is True
    assert json.load(open(os.path.join(final, "sentence_bert_config.json")))["max_seq_length"] == 32


class _LogitsOnlyModel:
    """A stand-in for a backend whose network returns logits only (MegatronModel today); like
    TorchTwinkleModel, it hands every forward's outputs to its task."""

    strategy = None

    def __init__(self, task):
        self.task = task

    def run_network(self, module, inputs):
        return self.task.process_outputs({"logits": torch.zeros(2, 3, 5)}, inputs)


def test_backends_without_hidden_states_get_a_clear_error():
    task = EmbeddingTask(pooling="mean", normalize=True)
    model = _LogitsOnlyModel(task)
    task.prepare_model(model)
    with pytest.raises(ConfigError, match="final token states"):
        model.run_network(None, {"attention_mask": torch.ones(2, 3)})


def test_the_task_serves_any_model_that_calls_its_hooks(monkeypatch):
    import twinkle_embedding.task as task_module

    exported = []
    monkeypatch.setattr(task_module, "write_sentence_transformers_config",
                        lambda directory, **config: exported.append(directory))

    class Plain:
        """Not a TorchTwinkleModel, but honours the task contract: process_outputs on every forward,
        on_export after every save."""

        def __init__(self, task):
            self.task = task

        @property
        def embedding_head(self):  # the head serving this model's forwards
            return self.task.head

        def forward(self, *, inputs, **kwargs):
            outputs = {"last_hidden_state": torch.ones(2, 3, 4) * torch.arange(3).view(1, 3, 1)}
            return self.task.process_outputs(outputs, inputs)

        def forward_only(self, *, inputs, **kwargs):
            return self.forward(inputs=inputs)

        def save(self, name, **kwargs):
            path = f"/x/{name}"
            self.task.on_export(self, path, kwargs.get("adapter_name"))
            return path

    task = EmbeddingTask(pooling="last_token", normalize=False)
    model = Plain(task)
    task.prepare_model(model)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = model.forward_only(inputs={"attention_mask": mask})
    assert out["embeddings"][:, 0].tolist() == [1.0, 2.0]
    model.save("final", output_dir="/x")
    assert exported == ["/x/final"]
    task.pooling = "mean"
    task.prepare_model(model)  # preparing again replaces the head
    assert model.embedding_head.pooling == "mean"


def test_a_model_built_without_the_task_is_refused():
    task = EmbeddingTask(pooling="mean")
    model = make_model(EmbeddingTask(pooling="mean"), config=TINY_BERT, tokenizer=minilm_tokenizer(), prepare=False)
    with pytest.raises(ConfigError, match="pass task="):
        task.prepare_model(model)
    with pytest.raises(ConfigError, match="prepare_model"):
        model.task.encode(model, ["a"], tokenizer=minilm_tokenizer())
