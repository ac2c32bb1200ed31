"""Retrieval metrics: recall@k and MRR@k of queries against a corpus."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def retrieval_metrics(scores: Any, relevant: Sequence[set[int]], ks: Sequence[int] = (1, 5, 10),
                      mrr_at: int = 10) -> dict[str, float]:
    """``scores``: ``[queries, corpus]`` similarities; ``relevant[i]``: corpus indices relevant to query ``i``.

    ``recall@k`` is the mean over queries of the fraction of their relevant documents ranked in the top
    ``k`` (with one relevant document: the hit rate); ``mrr@k`` the mean reciprocal rank of the first
    relevant document when it is in the top ``k`` (else 0).
    """
    import torch

    scores = torch.as_tensor(scores, dtype=torch.float32)
    if scores.dim() != 2 or scores.shape[0] != len(relevant):
        raise ValueError(f"scores {tuple(scores.shape)} do not match {len(relevant)} queries")
    if scores.shape[0] == 0:
        raise ValueError("no queries to evaluate")
    depth = min(max([*ks, mrr_at]), scores.shape[1])
    # ties are broken by corpus order (stable), so the metrics are deterministic
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :depth].tolist()
    result: dict[str, float] = {}
    for k in ks:
        total = 0.0
        for ranked, rel in zip(order, relevant):
            total += len(rel.intersection(ranked[:k])) / max(len(rel), 1)
        result[f"recall@{k}"] = total / len(relevant)
    reciprocal = 0.0
    for ranked, rel in zip(order, relevant):
        for position, doc in enumerate(ranked[:mrr_at], start=1):
            if doc in rel:
                reciprocal += 1.0 / position
                break
    result[f"mrr@{mrr_at}"] = reciprocal / len(relevant)
    return result
