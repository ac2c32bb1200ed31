"""Sampling and scoring for :class:`~twinkle_server.host.ModelHost`: KV-cache decoding with a Hugging Face-style causal
LM lent by ``TwinkleModel.generation_module``, and the log-probabilities of a given sequence.

The log-probability returned for every sampled token is the model's own, ``log_softmax(logits)[token]`` at
temperature 1 before any top-k / top-p filtering: the same number ``compute_logprobs`` and a training forward give
for that token, so an importance ratio is exactly 1 on-policy (sampling at temperature 1). ``temperature == 0`` is
greedy decoding. Every sample draws its noise (Gumbel-max) from its own generator, seeded from the request's seed
and the sample's index: the same seed gives the same tokens, whatever else runs.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from twinkle_core.sampling import forward_keywords, sample_seed
from twinkle_server.errors import BadRequest


@dataclass
class SampleParams:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: no limit (Tinker's default is -1)
    seed: int | None = None
    #: None: stop at EOS; []: no stop at all (run to max_tokens); token ids or strings: stop there (kept)
    stop: list[int] | list[str] | None = None


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" or "length"


@dataclass(frozen=True)
class Plan:
    """A validated request: how many tokens at most, which token ids and strings end a sample."""

    max_tokens: int
    stop_ids: frozenset[int]
    stop_strings: tuple[str, ...]


def check_tokens(tokens: list[int], vocab_size: int, what: str) -> None:
    """Refuse tokens that are not integers in ``[0, vocab_size)``."""
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise BadRequest(f"{what}: token {token!r} at position {i} is not a token id of this model (integers "
                             f"0 to {vocab_size - 1}); tokenize with the base model's tokenizer")


def plan(params: SampleParams, prompt_length: int, *, max_positions: int | None, eos_ids: set[int],
         tokenizer: Any) -> Plan:
    """Validate ``params`` for a prompt of ``prompt_length`` tokens; BadRequest names what to change."""
    t = params.temperature
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise BadRequest(f"sampling_params.temperature must be a finite number >= 0 (0: greedy), got {t!r}")
    if not isinstance(params.top_p, (int, float)) or not 0.0 < params.top_p <= 1.0:
        raise BadRequest(f"sampling_params.top_p must be in (0, 1] (1: no nucleus filter), got {params.top_p!r}")
    if not isinstance(params.top_k, int) or isinstance(params.top_k, bool):
        raise BadRequest(f"sampling_params.top_k must be an integer (-1 or 0: no limit), got {params.top_k!r}")
    room = None if max_positions is None else max_positions - prompt_length
    if room is not None and room < 1:
        raise BadRequest(f"the prompt has {prompt_length} tokens, which leaves no room to generate within the "
                         f"model's context of {max_positions} tokens; shorten the prompt")
    limit = params.max_tokens
    if limit is None:
        if room is None:
            raise BadRequest("sampling_params.max_tokens is required: this model reports no context length")
        limit = room
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise BadRequest(f"sampling_params.max_tokens must be a positive integer, got {limit!r}")
    if room is not None and limit > room:
        raise BadRequest(f"prompt ({prompt_length} tokens) + max_tokens ({limit}) exceeds the model's context of "
                         f"{max_positions} tokens; ask for at most {room} tokens or shorten the prompt")
    stop = params.stop
    if stop is None:
        return Plan(limit, frozenset(eos_ids), ())
    stop = [stop] if isinstance(stop, str) else list(stop)
    if all(isinstance(s, str) for s in stop):
        if any(s == "" for s in stop):
            raise BadRequest("sampling_params.stop contains an empty string, which would stop every sample at once")
        if stop and tokenizer is None:
            raise BadRequest("sampling_params.stop strings need a tokenizer, and this base model has none; pass "
                             "stop token ids instead")
        return Plan(limit, frozenset(), tuple(stop))
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return Plan(limit, frozenset(stop), ())
    raise BadRequest(f"sampling_params.stop must be a list of strings or a list of token ids, not a mix: {stop!r}")


def _filtered(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``scores`` [rows, vocab] with tokens outside the top-k / the top-p nucleus set to -inf."""
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[..., 0] = False  # the most likely token always stays
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return scores


def generate(module: Any, device: Any, prompt: list[int], num_samples: int, params: SampleParams, how: Plan,
             tokenizer: Any) -> list[SampledSequence]:
    """``num_samples`` continuations of ``prompt`` decoded together (same length: no padding), with a KV cache."""
    cache_key, keeps_logits = forward_keywords(module)
    extra = {"logits_to_keep": 1} if keeps_logits else {}
    base = params.seed if params.seed is not None else secrets.randbits(62)
    generators = [torch.Generator(device=device).manual_seed(sample_seed(base, j)) for j in range(num_samples)]
    tokens: list[list[int]] = [[] for _ in range(num_samples)]
    logprobs: list[list[float]] = [[] for _ in range(num_samples)]
    reasons: list[str | None] = [None] * num_samples
    ids = torch.tensor([prompt] * num_samples, dtype=torch.long, device=device)
    out = module(input_ids=ids, use_cache=True, **extra)
    greedy = params.temperature == 0
    for _ in range(how.max_tokens):
        logits = out.logits[:, -1, :].float()
        reported = torch.log_softmax(logits, dim=-1)
        if greedy:
            chosen = torch.argmax(logits, dim=-1)
        else:
            scores = torch.log_softmax(_filtered(logits / params.temperature, params.top_k, params.top_p), dim=-1)
            noise = torch.stack([torch.rand(scores.shape[-1], generator=g, device=device, dtype=torch.float32)
                                 for g in generators])
            chosen = torch.argmax(scores - torch.log(-torch.log(noise)), dim=-1)  # Gumbel-max: a draw from scores
        picked = reported.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        for j, (token, logprob) in enumerate(zip(chosen.tolist(), picked.tolist())):
            if reasons[j] is None:
                tokens[j].append(token)
                logprobs[j].append(logprob)
                if token in how.stop_ids or (how.stop_strings and any(
                        s in tokenizer.decode(tokens[j]) for s in how.stop_strings)):
                    reasons[j] = "stop"
                elif len(tokens[j]) >= how.max_tokens:
                    reasons[j] = "length"
        if all(reason is not None for reason in reasons):
            break
        # finished samples are fed their last token and never read again: every row keeps the same length
        out = module(input_ids=chosen.unsqueeze(-1), use_cache=True, **{cache_key: getattr(out, cache_key)}, **extra)
    return [SampledSequence(tokens=t, logprobs=lp, stop_reason=r or "length")
            for t, lp, r in zip(tokens, logprobs, reasons)]


def score(module: Any, device: Any, tokens: list[int]) -> list[float | None]:
    """``[None, log p(t1 | t0), log p(t2 | t0 t1), ...]`` under ``module``."""
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    logits = module(input_ids=ids, use_cache=False).logits[0, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return [None, *picked.tolist()]
