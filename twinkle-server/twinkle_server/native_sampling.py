"""The native API's ``sample`` call: completions drawn with the adapter's current weights by the core's
``hf_generate`` sampler on the server (the host's ``native_sample``: :mod:`twinkle_server.native_generate`), seeded
per completion so they do not depend on batching."""

from __future__ import annotations

import uuid
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_server.errors import BadRequest
from twinkle_server.native_args import REQUIRED, Call, integer, number, take
from twinkle_server.native_batch import host_vocab_size


def prepare_sample(call: Call) -> Any:
    from twinkle_core.sampling import SamplingParams, sample_seed

    a = take(call.args, "sample", prompts=REQUIRED, n=1, max_new_tokens=64, temperature=1.0, top_p=1.0, top_k=0,
              stop=[], stop_token_ids=[], seed=None, seeds=None)
    prompts, vocab = a["prompts"], host_vocab_size(call.host)
    if (not isinstance(prompts, list) or not prompts
            or not all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                       for p in prompts)):
        raise BadRequest("sample: prompts must be a non-empty list of non-empty lists of token ids")
    if any(t < 0 or t >= vocab for p in prompts for t in p):
        raise BadRequest(f"sample: prompt token ids must be in [0, {vocab})")
    n = integer(a["n"], "sample: n", low=1)
    limits = call.service.config.limits
    if n * len(prompts) > limits.max_samples_per_request:
        raise BadRequest(f"sample: {len(prompts)} prompts x n={n} completions is over the server's limit of "
                         f"{limits.max_samples_per_request} (limits.max_samples_per_request)")
    max_new = integer(a["max_new_tokens"], "sample: max_new_tokens", low=1)
    longest = max(len(p) for p in prompts) + max_new
    if longest * n * len(prompts) > limits.max_tokens_per_request:
        raise BadRequest(f"sample: up to {longest * n * len(prompts)} tokens, over limits.max_tokens_per_request="
                         f"{limits.max_tokens_per_request}")
    try:
        params = SamplingParams(temperature=number(a["temperature"], "sample: temperature"),
                                top_p=number(a["top_p"], "sample: top_p"),
                                top_k=integer(a["top_k"], "sample: top_k", low=0), max_new_tokens=max_new,
                                stop=tuple(a["stop"] or ()), stop_token_ids=tuple(a["stop_token_ids"] or ()))
    except (ConfigError, TypeError, ValueError) as exc:
        raise BadRequest(f"sample: {exc}") from None
    seeds = a["seeds"]
    if seeds is None:
        base = integer(a["seed"], "sample: seed") if a["seed"] is not None else uuid.uuid4().int & ((1 << 63) - 1)
        seeds = [[sample_seed(base, i, j) for j in range(n)] for i in range(len(prompts))]
    elif (not isinstance(seeds, list) or len(seeds) != len(prompts)
          or not all(isinstance(s, list) and len(s) == n
                     and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63 for x in s)
                     for s in seeds)):
        raise BadRequest(f"sample: seeds must be {len(prompts)} lists of n={n} integers in [0, 2**63) (one per "
                         f"completion)")

    def run() -> Any:
        return call.guard("sample", lambda: call.host.native_sample(call.aid, prompts, n, params, seeds))
    return run
