"""Per-token sampling math of the ``hf_generate`` sampler: the behaviour distribution and the draw from it.

The distribution of a decoding step is built from the model's last-position logits, in float32, in this
order: drop the suppressed tokens (``suppress_token_ids``: never drawn, at any temperature), divide by the
temperature, keep the ``top_k`` largest, keep the nucleus of probability ``top_p``,
renormalise (:func:`process_logits`). ``temperature == 0`` is greedy decoding; its log-probs are the
untempered ``log_softmax`` of the logits (less the suppressed tokens), without filtering (filters never remove
the arg-max).

Every row draws its noise from its own ``torch.Generator`` (:func:`choose_tokens`), consuming the same
number of random numbers per step whatever else is in the batch, so a completion depends on its seed
only, never on its neighbours, the batch size or the number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twinkle_core.sampling import SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities ``[rows, vocab]`` (float32) of the distribution tokens are drawn from;
    tokens filtered out by top-k / top-p get ``-inf``."""
    logits = logits.float()
    if params.suppress_token_ids:
        logits = logits.index_fill(-1, torch.tensor(params.suppress_token_ids, device=logits.device), float("-inf"))
    if params.temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    scores = logits / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        # ties with the k-th score are kept: which of two equal scores to drop has no principled answer
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = _nucleus(scores, params.top_p)
    return torch.log_softmax(scores, dim=-1)


def _nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of highest-probability tokens whose total probability reaches ``top_p``."""
    ordered, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_ordered = mass_before >= top_p
    drop_ordered[..., 0] = False  # the most likely token always stays, even when it alone exceeds top_p
    drop = torch.zeros_like(drop_ordered).scatter(-1, order, drop_ordered)
    return scores.masked_fill(drop, float("-inf"))


def choose_tokens(logprobs: torch.Tensor, generators: Sequence[torch.Generator], *,
                  greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The token of every row (``[rows]``) and its log-probability under ``logprobs`` (``[rows]``, float32).

    Sampling is Gumbel-max: ``argmax(logprobs + Gumbel noise)`` is an exact draw from ``softmax(logprobs)``
    and needs one uniform per vocabulary entry, drawn from the row's own generator.
    """
    if greedy:
        chosen = torch.argmax(logprobs, dim=-1)
    else:
        vocab = logprobs.shape[-1]
        uniforms = torch.stack([torch.rand(vocab, generator=g, device=logprobs.device, dtype=torch.float32)
                                for g in generators])
        # -log(-log(u)); u == 0 gives -inf, which can never win: no NaN on any path
        gumbel = -torch.log(-torch.log(uniforms))
        chosen = torch.argmax(logprobs + gumbel, dim=-1)
    return chosen, logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
