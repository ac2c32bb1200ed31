"""The infonce loss: equality with sentence-transformers' MultipleNegativesRankingLoss, a naive reference
for variable hard negatives, masking, and its contract with the core (sum over queries, num_tokens)."""

from __future__ import annotations

import math

import pytest
import torch
from twinkle_embedding.data import ROLE_NEGATIVE, ROLE_POSITIVE, ROLE_QUERY
from twinkle_embedding.loss import InfoNCELoss

from twinkle_core.errors import ConfigError


def layout(num_negatives):
    """role/owner for queries first, then positive + negatives per query."""
    roles = [ROLE_QUERY] * len(num_negatives)
    owners = list(range(len(num_negatives)))
    for i, n in enumerate(num_negatives):
        roles += [ROLE_POSITIVE] + [ROLE_NEGATIVE] * n
        owners += [i] * (n + 1)
    return torch.tensor(roles), torch.tensor(owners)


def mnrl(queries, docs, **kwargs):
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    return MultipleNegativesRankingLoss(model=None, **kwargs).compute_loss_from_embeddings([queries, *docs], None)


DIRECTIONS = [
    ("query_to_doc",),
    ("query_to_doc", "query_to_query"),
    ("query_to_doc", "doc_to_query"),
    ("query_to_doc", "doc_to_doc"),
    ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
]


@pytest.mark.parametrize("directions", DIRECTIONS, ids=["+".join(d) for d in DIRECTIONS])
@pytest.mark.parametrize("num_negatives", [0, 2])
def test_equals_multiple_negatives_ranking_loss(directions, num_negatives):
    torch.manual_seed(0)
    batch, dim, scale = 5, 8, 20.0
    q = torch.randn(batch, dim, dtype=torch.float64, requires_grad=True)
    columns = [torch.randn(batch, dim, dtype=torch.float64, requires_grad=True) for _ in range(1 + num_negatives)]
    theirs = mnrl(q, columns, scale=scale, directions=directions, partition_mode="joint")
    theirs.backward()
    their_grads = [q.grad.clone()] + [c.grad.clone() for c in columns]
    q.grad = None
    for c in columns:
        c.grad = None
    # our layout: queries, then per query its positive and negatives
    rows = [q] + [torch.stack([col[i] for col in columns]) for i in range(batch)]
    emb = torch.cat(rows, dim=0)
    role, owner = layout([num_negatives] * batch)
    loss = InfoNCELoss(temperature=1 / scale, query_to_query="query_to_query" in directions,
                       doc_to_query="doc_to_query" in directions, doc_to_doc="doc_to_doc" in directions)
    out = loss({"embeddings": emb}, {"embedding_role": role, "embedding_owner": owner})
    assert out.num_tokens == batch
    assert abs(float(out.mean.detach()) - float(theirs.detach())) < 1e-10
    out.mean.backward()
    assert torch.allclose(q.grad, their_grads[0], atol=1e-10)
    for c, expected in zip(columns, their_grads[1:]):
        assert torch.allclose(c.grad, expected, atol=1e-10)


def naive(queries, docs, doc_owner, positive_of, temperature, *, qq=False, dq=False, dd=False, margin=None,
          query_texts=None, doc_texts=None):
    """Per-query loop over explicit candidate lists (the definition in twinkle_embedding.loss)."""
    cos = torch.nn.functional.cosine_similarity
    total = 0.0
    for i, q in enumerate(queries):
        p = docs[positive_of[i]]
        pos = float(cos(q, p, dim=0))
        cands = []
        for j, d in enumerate(docs):
            s = float(cos(q, d, dim=0))
            if j != positive_of[i]:
                if margin is not None and s > pos + margin:
                    continue
                if doc_texts is not None and doc_texts[j] == doc_texts[positive_of[i]]:
                    continue
            cands.append(s)
        if qq:
            for k, other in enumerate(queries):
                s = float(cos(q, other, dim=0))
                if k == i or (margin is not None and s > pos + margin):
                    continue
                if query_texts is not None and query_texts[k] == query_texts[i]:
                    continue
                cands.append(s)
        if dq:
            for k, other in enumerate(queries):
                s = float(cos(p, other, dim=0))
                if k != i:
                    if margin is not None and s > pos + margin:
                        continue
                    if query_texts is not None and query_texts[k] == query_texts[i]:
                        continue
                cands.append(s)
        if dd:
            for j, d in enumerate(docs):
                s = float(cos(p, d, dim=0))
                if doc_owner[j] == i or (margin is not None and s > pos + margin):
                    continue
                if doc_texts is not None and doc_texts[j] == doc_texts[positive_of[i]]:
                    continue
                cands.append(s)
        z = math.log(sum(math.exp(s / temperature) for s in cands))
        total += z - pos / temperature
    return total


@pytest.mark.parametrize("options", [
    {},
    {"qq": True, "dq": True, "dd": True},
    {"margin": 0.1},
    {"margin": -0.3, "qq": True, "dq": True, "dd": True},
    {"duplicates": True, "qq": True, "dq": True, "dd": True},
], ids=["plain", "all-terms", "margin", "margin-all-terms", "duplicates"])
def test_variable_negatives_match_the_naive_definition(options):
    torch.manual_seed(3)
    negatives = [0, 3, 1, 2]
    role, owner = layout(negatives)
    n_rows, dim, temperature = len(role), 6, 0.1
    emb = torch.randn(n_rows, dim, dtype=torch.float64)
    # texts: query 3 repeats query 0; query 2's positive also appears as a negative of query 1
    texts = [f"row{i}" for i in range(n_rows)]
    texts[3] = texts[0]
    pos_rows = (role == ROLE_POSITIVE).nonzero().squeeze(1).tolist()
    texts[pos_rows[1] + 1] = texts[pos_rows[2]]
    emb[3] = emb[0]
    emb[pos_rows[1] + 1] = emb[pos_rows[2]]
    duplicates = options.get("duplicates", False)
    from twinkle_embedding.data import text_hash

    hashes = torch.tensor([text_hash(t) for t in texts])
    loss = InfoNCELoss(temperature=temperature, query_to_query=options.get("qq", False),
                       doc_to_query=options.get("dq", False), doc_to_doc=options.get("dd", False),
                       false_negative_margin=options.get("margin"), mask_duplicates=duplicates)
    out = loss({"embeddings": emb}, {"embedding_role": role, "embedding_owner": owner, "embedding_hash": hashes})
    queries = emb[role == ROLE_QUERY]
    doc_idx = (role != ROLE_QUERY).nonzero().squeeze(1)
    docs = emb[doc_idx]
    doc_owner = owner[doc_idx].tolist()
    positive_of = [doc_idx.tolist().index(r) for r in pos_rows]
    expected = naive(queries, docs, doc_owner, positive_of, temperature, qq=options.get("qq", False),
                     dq=options.get("dq", False), dd=options.get("dd", False), margin=options.get("margin"),
                     query_texts=texts[:4] if duplicates else None,
                     doc_texts=[texts[r] for r in doc_idx.tolist()] if duplicates else None)
    assert out.num_tokens == 4
    assert abs(float(out.loss) - expected) < 1e-9
    if options.get("margin") is not None or duplicates:
        assert out.metrics["infonce_masked"] > 0


def test_false_negative_masking_drops_a_candidate_closer_than_the_positive():
    q = torch.tensor([[1.0, 0.0]])
    positive = torch.tensor([[0.8, 0.6]])
    false_negative = torch.tensor([[1.0, 0.05]])  # almost the query itself: a likely unlabelled positive
    emb = torch.cat([q, positive, false_negative])
    role, owner = layout([1])
    unmasked = InfoNCELoss(temperature=0.05)({"embeddings": emb}, {"embedding_role": role, "embedding_owner": owner})
    masked = InfoNCELoss(temperature=0.05, false_negative_margin=0.1)(
        {"embeddings": emb}, {"embedding_role": role, "embedding_owner": owner})
    assert float(masked.loss) == pytest.approx(0.0, abs=1e-6)  # only the positive is left in the softmax
    assert float(unmasked.loss) > 1.0


def test_dot_similarity_scale_and_errors():
    torch.manual_seed(0)
    emb = torch.randn(6, 4)
    role, owner = layout([0, 0, 0])
    inputs = {"embedding_role": role, "embedding_owner": owner}
    a = InfoNCELoss(scale=20.0)({"embeddings": emb}, inputs)
    b = InfoNCELoss(temperature=0.05)({"embeddings": emb}, inputs)
    assert torch.allclose(a.loss, b.loss)
    q, d = emb[:3], emb[3:]
    logits = q @ d.T / 2.0
    expected = torch.nn.functional.cross_entropy(logits, torch.arange(3), reduction="sum")
    dot = InfoNCELoss(temperature=2.0, similarity="dot")({"embeddings": emb}, inputs)
    assert torch.allclose(dot.loss, expected)
    with pytest.raises(ConfigError, match="temperature"):
        InfoNCELoss(temperature=0)
    with pytest.raises(ConfigError, match="similarity"):
        InfoNCELoss(similarity="l2")
    with pytest.raises(ConfigError, match="embeddings"):
        InfoNCELoss()({"logits": emb}, inputs)
    with pytest.raises(ConfigError, match="embedding_role"):
        InfoNCELoss()({"embeddings": emb}, {})


def test_registered_and_default_loss_of_the_task():
    from twinkle_core.plugins import get_plugins

    plugins = get_plugins()
    assert plugins.load("loss", "infonce") is InfoNCELoss
    task = plugins.load("task", "embedding")()
    assert task.default_loss == "infonce" and task.model_kind == "encoder"


def test_half_precision_embeddings_are_scored_in_float32():
    torch.manual_seed(0)
    emb = torch.randn(9, 16)
    role, owner = layout([1, 0, 2])
    inputs = {"embedding_role": role, "embedding_owner": owner}
    full = InfoNCELoss()({"embeddings": emb}, inputs)
    half = InfoNCELoss()({"embeddings": emb.bfloat16()}, inputs)
    assert half.loss.dtype == torch.float32
    assert abs(float(half.loss) - float(full.loss)) < 0.05 * float(full.loss)
