"""Data parallelism: 2 CPU ranks (torchrun, gloo) give the loss and gradients of one process on the
concatenated batch, at the loss level and through the HF backend's DDP strategy."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from embedding_helpers import HERE, ROWS, TINY_BERT, make_model, minilm_tokenizer, run_torchrun

from twinkle_core.testing.tolerance import forward_tolerance

sys.path.insert(0, os.path.join(HERE, "scripts"))

pytestmark = [pytest.mark.distributed, pytest.mark.parity]
#: one InfoNCE evaluation of the same embeddings in another order: a similarity is a dot product of unit vectors
#: over the hidden width, divided by the temperature (0.05 at the lowest), and the loss and its gradients inherit
#: that rounding; through DDP the embeddings themselves come from the tiny BERT's layers as well
LOSS_TOLERANCE = forward_tolerance(1 / 0.05, width=TINY_BERT["hidden_size"], depth=0)
MODEL_TOLERANCE = forward_tolerance(1 / 0.05, width=TINY_BERT["intermediate_size"], depth=TINY_BERT["num_hidden_layers"])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    result = run_torchrun([os.path.join(HERE, "scripts", "dist_equality.py"), str(out)], nproc=2, timeout=240)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_gathered_loss_and_gradients_equal_one_process(ranks):
    import dist_equality as job
    from twinkle_embedding.loss import InfoNCELoss

    everything = job.SHARDS[0] + job.SHARDS[1]
    emb, role, owner, hashes = job.shard_layout(everything)
    split = int(ranks[0]["loss"][0]["grad"].shape[0])
    worst = 0.0
    for index, config in enumerate(job.LOSS_CONFIGS):
        leaf = emb.clone().requires_grad_(True)
        out = InfoNCELoss(temperature=0.07, **config)(
            {"embeddings": leaf}, {"embedding_role": role, "embedding_owner": owner, "embedding_hash": hashes})
        out.loss.backward()
        per_rank = [r["loss"][index] for r in ranks]
        assert per_rank[0]["num_tokens"] == 3 and per_rank[1]["num_tokens"] == 2
        total = per_rank[0]["loss"] + per_rank[1]["loss"]
        single_loss = float(out.loss.detach())
        assert abs(total - single_loss) <= LOSS_TOLERANCE, (config, total, single_loss)
        # rank r's shard = its queries then its documents; rebuild the single-process row order
        local0 = job.shard_layout(job.SHARDS[0])[0].shape[0]
        assert split == local0
        q0, q1 = len(job.SHARDS[0]), len(job.SHARDS[1])
        single = leaf.grad
        docs0 = local0 - q0
        expected0 = torch.cat([single[:q0], single[q0 + q1:q0 + q1 + docs0]])
        expected1 = torch.cat([single[q0:q0 + q1], single[q0 + q1 + docs0:]])
        for got, expected in ((per_rank[0]["grad"], expected0), (per_rank[1]["grad"], expected1)):
            delta = float((got - expected).abs().max())
            worst = max(worst, delta)
            assert delta <= LOSS_TOLERANCE, (config, delta)
    print(f"max |grad delta| at the loss level: {worst:.3g}")


def test_ddp_model_gradients_equal_one_process(ranks):
    from twinkle_embedding.task import EmbeddingTask

    task = EmbeddingTask(pooling="mean", normalize=True)
    features = task.load_dataset(ROWS, minilm_tokenizer())
    model = make_model(task, config=TINY_BERT, tokenizer=minilm_tokenizer())
    model.set_loss("infonce", temperature=0.05, query_to_query=True, doc_to_doc=True)
    model.set_optimizer("AdamW", lr=1e-3)
    outputs = model.forward_backward(inputs=task.collate(features))
    model.clip_grad_norm(float("inf"))
    grads = {n: p.grad for n, p in model.module.named_parameters() if p.grad is not None}
    r0, r1 = ranks[0]["model"], ranks[1]["model"]
    assert r0["num_tokens"] == 3 and r1["num_tokens"] == 3
    global_mean = (r0["loss_mean"] * 3 + r1["loss_mean"] * 3) / 6
    assert abs(global_mean - float(outputs["loss"])) <= MODEL_TOLERANCE
    assert set(r0["grads"]) == set(grads) == set(r1["grads"])
    assert not any(n.startswith("pooler.") for n in grads)  # frozen: not part of the sentence embedding
    worst = max(float((r["grads"][n] - g).abs().max()) for r in (r0, r1) for n, g in grads.items())
    print(f"max |param grad delta| through DDP: {worst:.3g}")
    assert worst <= MODEL_TOLERANCE


def test_twinkle_train_with_ddp_on_two_ranks(tmp_path):
    """The whole loop under torchrun: gathered loss, every rank evaluating, rank 0 saving a sentence-transformers dir."""
    import json

    import yaml
    from embedding_helpers import minilm_path

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    recipe = {
        "task": "embedding",
        "model": {"config": dict(TINY_BERT), "tokenizer": minilm_path()},
        "strategy": {"name": "ddp"},
        "data": {"train": str(data), "eval": str(data), "batch_size": 3, "shuffle": False},
        "loss": {"name": "infonce", "options": {"temperature": 0.05}},
        "optimizer": {"lr": 1e-3},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "eval_before_training": True,
                  "evaluate_options": {"k": [1]}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = run_torchrun(["-m", "twinkle_core.cli", "train", str(path)], nproc=2, timeout=240)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 2 and "eval_recall@1" in summary["eval_after"]
    assert (tmp_path / "run" / "final" / "modules.json").exists()
