"""Run under torchrun (2 ranks, gloo): write what each rank computes for the equality tests.

1. loss level: each rank holds its shard of a global batch of embeddings (uneven: 3 and 2 queries,
   variable hard negatives); the infonce loss (several configurations) and the gradient of the summed
   loss with respect to the local embeddings are saved;
2. model level: a tiny BERT under the HF backend's ``ddp`` strategy, prepared by the embedding task,
   runs forward_backward on its shard; the normalised parameter gradients are saved.

The test compares both with one process on the concatenated batch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from embedding_helpers import ROWS, TINY_BERT, make_model, minilm_tokenizer  # noqa: E402
from twinkle_embedding.loss import InfoNCELoss  # noqa: E402
from twinkle_embedding.task import EmbeddingTask  # noqa: E402

from twinkle_core.loss.base import LossContext  # noqa: E402

LOSS_CONFIGS = [
    {},
    {"query_to_query": True, "doc_to_query": True, "doc_to_doc": True},
    {"false_negative_margin": 0.0, "mask_duplicates": True, "query_to_query": True, "doc_to_doc": True},
]
SHARDS = [[0, 1, 2], [3, 4]]  # query indices of the global batch held by each rank


def global_batch(seed: int = 0):
    """(embeddings, role, owner, hash) of a global batch of 5 queries with 2, 0, 1, 3, 1 negatives."""
    from twinkle_embedding.data import ROLE_NEGATIVE, ROLE_POSITIVE, ROLE_QUERY

    negatives = [2, 0, 1, 3, 1]
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(len(negatives), 8, generator=g, dtype=torch.float64)
    docs = [torch.randn(1 + n, 8, generator=g, dtype=torch.float64) for n in negatives]
    docs[4][1] = docs[1][0]  # a duplicate of query 1's positive, as a negative of query 4 (other rank)
    hashes_docs = [[1000 + 10 * i + j for j in range(1 + n)] for i, n in enumerate(negatives)]
    hashes_docs[4][1] = hashes_docs[1][0]
    return queries, docs, hashes_docs, negatives, (ROLE_QUERY, ROLE_POSITIVE, ROLE_NEGATIVE)


def shard_layout(indices, seed: int = 0):
    queries, docs, hashes_docs, negatives, (rq, rp, rn) = global_batch(seed)
    rows = [queries[i] for i in indices]
    role = [rq] * len(indices)
    owner = list(range(len(indices)))
    hashes = [i for i in indices]
    for local, i in enumerate(indices):
        rows += list(docs[i])
        role += [rp] + [rn] * negatives[i]
        owner += [local] * (1 + negatives[i])
        hashes += hashes_docs[i]
    return torch.stack(rows), torch.tensor(role), torch.tensor(owner), torch.tensor(hashes)


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {"loss": []}
    emb, role, owner, hashes = shard_layout(SHARDS[rank])
    for config in LOSS_CONFIGS:
        leaf = emb.clone().requires_grad_(True)
        out = InfoNCELoss(temperature=0.07, **config)(
            {"embeddings": leaf},
            {"embedding_role": role, "embedding_owner": owner, "embedding_hash": hashes},
            context=LossContext(dp_group=None, dp_size=2, dp_rank=rank))
        out.loss.backward()
        results["loss"].append({"loss": float(out.loss), "num_tokens": out.num_tokens, "grad": leaf.grad.clone()})

    # model level: the HF backend's DDP with the task's pooling
    task = EmbeddingTask(pooling="mean", normalize=True)
    features = task.load_dataset(ROWS, minilm_tokenizer())
    mine = features[:3] if rank == 0 else features[3:]
    model = make_model(task, config=TINY_BERT, tokenizer=minilm_tokenizer(), strategy="ddp")
    model.set_loss("infonce", temperature=0.05, query_to_query=True, doc_to_doc=True)
    model.set_optimizer("AdamW", lr=1e-3)
    outputs = model.forward_backward(inputs=task.collate(mine))
    model.clip_grad_norm(float("inf"))
    module = model.strategy.unwrap_module(model.wrapped)
    results["model"] = {
        "loss_mean": float(outputs["loss"]),
        "num_tokens": int(outputs["num_tokens"]),
        "grads": {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None},
    }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
