"""``infonce``: contrastive loss with in-batch negatives, hard negatives and optional extra terms.

For every query ``q_i`` with positive ``p_i``, over the candidates ``d_j`` (every positive and
every hard negative of the batch, gathered from all data-parallel ranks)::

    loss_i = -log( exp(s(q_i, p_i) / t) / Z_i )
    Z_i    = sum_j exp(s(q_i, d_j) / t)                          # always (includes the positive)
           + sum_{k != i} exp(s(q_i, q_k) / t)                   # query_to_query
           + sum_k exp(s(p_i, q_k) / t)                          # doc_to_query
           + sum_{j not of query i} exp(s(p_i, d_j) / t)         # doc_to_doc

``s`` is the cosine similarity (``similarity: cosine``, default) or the dot product. This is one
joint softmax, the same as sentence-transformers' ``MultipleNegativesRankingLoss(scale=1/t,
directions=(...), partition_mode="joint")``; each row may have any number of hard negatives.

Masking (candidates removed from ``Z_i``; the positive itself never is):

* ``false_negative_margin: m`` removes every candidate whose similarity exceeds the positive's by
  more than ``m`` (``s(q_i, d_j) > s(q_i, p_i) + m``; in the extra terms the candidate's similarity
  to ``q_i`` or ``p_i`` is compared likewise), as in Qwen3-Embedding / GTE training;
* ``mask_duplicates: true`` removes candidates whose text equals the positive's (or, among
  queries, the query's): a passage shared by two queries is not a negative for either.

Data parallelism: the embeddings of every rank of the data-parallel group (``context.dp_group``, the
:class:`~twinkle_core.loss.base.LossContext` the model passes to every loss call) are all-gathered
(``gather: true``, default) with the gradient flowing back to each rank's own rows, so every query
sees the global batch; without a context the loss sees this rank's batch only. The loss is
the *sum* over this rank's queries and ``num_tokens`` is their number, so the model's normalisation
by the global ``num_tokens`` yields the mean over all queries of the global batch.

Inputs: ``outputs["embeddings"]`` (one row per batch row, from the embedding task's pooling) and
the batch layout ``embedding_role`` / ``embedding_owner`` / ``embedding_hash``
(:func:`twinkle_embedding.data.collate_embedding`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import Loss, LossContext, LossOutput
from twinkle_embedding.data import ROLE_POSITIVE, ROLE_QUERY

_NEG_INF = float("-inf")


class InfoNCELoss(Loss):
    name = "infonce"

    def __init__(self, temperature: float = 0.05, *, scale: float | None = None, similarity: str = "cosine",
                 query_to_query: bool = False, doc_to_query: bool = False, doc_to_doc: bool = False,
                 false_negative_margin: float | None = None, mask_duplicates: bool = False,
                 gather: bool = True) -> None:
        if scale is not None:
            if not float(scale) > 0:
                raise ConfigError(f"loss.options.scale must be > 0, got {scale!r}")
            temperature = 1.0 / float(scale)
        if not float(temperature) > 0:
            raise ConfigError(f"loss.options.temperature must be > 0, got {temperature!r}")
        if similarity not in ("cosine", "dot"):
            raise ConfigError(f"loss.options.similarity must be 'cosine' or 'dot', got {similarity!r}")
        self.temperature = float(temperature)
        self.scale = float(scale) if scale is not None else 1.0 / self.temperature
        self.similarity = similarity
        self.query_to_query = bool(query_to_query)
        self.doc_to_query = bool(doc_to_query)
        self.doc_to_doc = bool(doc_to_doc)
        self.false_negative_margin = None if false_negative_margin is None else float(false_negative_margin)
        self.mask_duplicates = bool(mask_duplicates)
        self.gather = bool(gather)

    def __repr__(self) -> str:
        return (f"InfoNCELoss(temperature={self.temperature}, similarity={self.similarity!r}, "
                f"query_to_query={self.query_to_query}, doc_to_query={self.doc_to_query}, "
                f"doc_to_doc={self.doc_to_doc}, false_negative_margin={self.false_negative_margin}, "
                f"mask_duplicates={self.mask_duplicates}, gather={self.gather})")

    # ------------------------------------------------------------------ data parallel
    def _group(self, context: LossContext | None) -> tuple[bool, Any]:
        """``(gather?, process group)``: gather over the data-parallel group when it has > 1 rank."""
        if not self.gather or context is None or context.dp_size <= 1:
            return False, None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(f"infonce: the loss context reports dp_size={context.dp_size} but torch.distributed "
                              f"is not initialised; cannot gather the batch")
        group = context.dp_group  # None: the whole world
        if dist.get_world_size(group) != context.dp_size:
            raise ConfigError(f"infonce: the data-parallel group has {dist.get_world_size(group)} ranks but the "
                              f"loss context reports dp_size={context.dp_size}; cannot gather the batch")
        return True, group

    # ------------------------------------------------------------------ loss
    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        if "embeddings" not in outputs:
            raise ConfigError("infonce needs outputs['embeddings']: train with task: embedding (its process_outputs "
                              f"pools them); the model returned {sorted(outputs)}")
        for key in ("embedding_role", "embedding_owner"):
            if key not in inputs:
                raise ConfigError(f"infonce needs inputs['{key}']: build batches with the embedding task's collate")
        emb = outputs["embeddings"]
        if emb.dtype in (torch.float16, torch.bfloat16):
            emb = emb.float()  # similarities and logsumexp in fp32 under bf16 / fp16
        role = inputs["embedding_role"].to(emb.device)
        owner = inputs["embedding_owner"].to(emb.device)
        hashes = inputs.get("embedding_hash")
        hashes = hashes.to(emb.device) if hashes is not None else torch.arange(len(role), device=emb.device)
        if emb.shape[0] != role.shape[0]:
            raise ValueError(f"infonce: {emb.shape[0]} embeddings for {role.shape[0]} batch rows")

        num_local_queries = int((role == ROLE_QUERY).sum())
        gather, group = self._group(context)
        if gather:
            import torch.distributed as dist

            from twinkle_embedding.gather import all_gather_rows, gather_sizes

            sizes = gather_sizes(emb.shape[0], emb.device, group)
            rank = dist.get_rank(group)  # the position of this rank's rows in the gather
            meta = torch.stack([role, owner, hashes], dim=1)
            emb_all = all_gather_rows(emb, sizes, group)
            meta_all = all_gather_rows(meta, sizes, group)
            role_all, owner_all, hash_all = meta_all.unbind(dim=1)
        else:
            sizes, rank = [emb.shape[0]], 0
            emb_all, role_all, owner_all, hash_all = emb, role, owner, hashes

        # global query ids: queries of rank r come after those of ranks < r
        segment = torch.repeat_interleave(torch.arange(len(sizes), device=emb.device),
                                          torch.tensor(sizes, device=emb.device))
        is_query = role_all == ROLE_QUERY
        per_rank = torch.zeros(len(sizes), dtype=torch.long, device=emb.device)
        per_rank.index_add_(0, segment, is_query.long())
        offsets = torch.cumsum(per_rank, 0) - per_rank
        gid = owner_all + offsets[segment]

        query_rows = torch.nonzero(is_query).squeeze(1)
        total_queries = int(query_rows.numel())
        if not torch.equal(gid[query_rows], torch.arange(total_queries, device=emb.device)):
            raise ValueError("infonce: every batch must list its queries first, in owner order "
                             "(embedding_owner of query i == i)")
        doc_rows = torch.nonzero(~is_query).squeeze(1)
        doc_owner = gid[doc_rows]
        is_positive = role_all[doc_rows] == ROLE_POSITIVE
        positive_of = torch.full((total_queries,), -1, dtype=torch.long, device=emb.device)
        positive_of[doc_owner[is_positive]] = torch.nonzero(is_positive).squeeze(1)
        if total_queries and int((positive_of < 0).sum()):
            raise ValueError("infonce: a query of the batch has no positive")

        queries, docs = emb_all[query_rows], emb_all[doc_rows]
        if self.similarity == "cosine":
            queries, docs = F.normalize(queries, p=2, dim=-1), F.normalize(docs, p=2, dim=-1)
        query_hash, doc_hash = hash_all[query_rows], hash_all[doc_rows]

        lo = int(offsets[rank])
        hi = lo + num_local_queries
        local = torch.arange(lo, hi, device=emb.device)
        rows = torch.arange(hi - lo, device=emb.device)
        mine_q = queries[lo:hi]
        mine_pos = positive_of[lo:hi]
        mine_p = docs[mine_pos]

        qd = mine_q @ docs.T                                     # [n, docs]
        pos_sim = qd[rows, mine_pos]
        blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []   # (scores, removed, protected)
        same_pos_text = doc_hash.unsqueeze(0) == doc_hash[mine_pos].unsqueeze(1)
        same_query_text = query_hash.unsqueeze(0) == query_hash[local].unsqueeze(1)
        if not self.mask_duplicates:
            same_pos_text, same_query_text = torch.zeros_like(same_pos_text), torch.zeros_like(same_query_text)
        protect = torch.zeros_like(qd, dtype=torch.bool)
        protect[rows, mine_pos] = True
        blocks.append((qd, same_pos_text & ~protect, protect))
        if self.query_to_query:
            qq = mine_q @ queries.T
            removed = torch.zeros_like(qq, dtype=torch.bool)
            removed[rows, local] = True
            blocks.append((qq, removed | same_query_text, torch.zeros_like(removed)))
        if self.doc_to_query:
            dq = mine_p @ queries.T
            own = torch.zeros_like(dq, dtype=torch.bool)
            own[rows, local] = True
            blocks.append((dq, same_query_text & ~own, own))
        if self.doc_to_doc:
            dd = mine_p @ docs.T
            removed = doc_owner.unsqueeze(0) == local.unsqueeze(1)
            blocks.append((dd, removed | same_pos_text, torch.zeros_like(removed)))

        logits, masked = [], 0
        for scores, removed, protected in blocks:
            if self.false_negative_margin is not None:
                too_close = scores.detach() > pos_sim.detach().unsqueeze(1) + self.false_negative_margin
                removed = removed | (too_close & ~protected)
            masked += int((removed & ~protected).sum())
            logits.append((scores * self.scale).masked_fill(removed, _NEG_INF))
        all_logits = torch.cat(logits, dim=1)
        per_query = torch.logsumexp(all_logits, dim=1) - pos_sim * self.scale
        loss = per_query.sum() if num_local_queries else emb.sum() * 0.0
        with torch.no_grad():
            first = logits[0]
            hits = (first.argmax(dim=1) == mine_pos).float().sum() if num_local_queries else first.new_zeros(())
        metrics = {
            "infonce_accuracy": float(hits) / max(num_local_queries, 1),
            "infonce_candidates": int(docs.shape[0]),
            "infonce_masked": masked,
        }
        return LossOutput(loss=loss, num_tokens=num_local_queries, metrics=metrics)
