"""Completions for the native API's ``sample`` call: the core's ``hf_generate`` sampler bound to a model that lends
its network (``TwinkleModel.generation_module``), with one adapter active, seeded per completion. Each kind of host
calls it with the model that samples for it (``native_sample``): its own, or the sampling twin of a base that cannot
lend its network, or rank 0's model of a worker group."""

from __future__ import annotations

from typing import Any

__all__ = ["generate"]


def generate(model: Any, tokenizer: Any, adapter_name: str | None, prompts: list[list[int]], n: int, params: Any,
             seeds: list[list[int]]) -> list[list[dict[str, Any]]]:
    """``n`` completions of each prompt as plain values: ``token_ids``, ``logprobs``, ``finish_reason``, ``text``."""
    from twinkle_core.plugins import get_plugins

    sampler = get_plugins().load("sampler", "hf_generate")()
    sampler.bind(model, tokenizer, adapter_name=adapter_name)
    groups = sampler.sample(prompts, n=n, params=params, seeds=seeds)
    return [[{"token_ids": list(c.token_ids), "logprobs": [float(x) for x in c.logprobs],
              "finish_reason": c.finish_reason, "text": c.text} for c in group] for group in groups]
