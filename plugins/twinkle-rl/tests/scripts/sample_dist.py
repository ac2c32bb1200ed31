"""Sample with ``hf_generate`` on every rank of a torchrun job; rank 0 writes every rank's completions.

    torchrun --nproc-per-node 2 sample_dist.py --out OUT.json --strategies ddp native_fsdp zero3
    python sample_dist.py --out OUT.json                       # the single-process reference

Every strategy builds the tiny policy from the same seed (:data:`SEED`) and samples the prompts of
:func:`requests` with seeds from ``sample_seed``: each rank takes prompts ``[rank::world]``, one sequence per
decoding batch, so the ranks decode different numbers of batches and steps (the lockstep case under
FSDP2 and ZeRO-3). A last request gives rank 0 all prompts and the other ranks none. The output maps strategy ->
request -> ``{prompt index: [[token ids], [log-probs], finish reason] per sample}``; the single-process run
(strategy ``single``) samples all prompts in one process.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
TOKENIZER_DIR = os.path.join(REPO, "examples", "quickstart", "tokenizer")
SEED = 3
SAMPLES = 2
#: short names of strategies with options (DeepSpeed ZeRO-3: each forward gathers partitions, like FSDP2)
STRATEGIES = {"zero3": ("deepspeed", {"stage": 3})}
TEXTS = ["hello", "the quick brown fox", "x", "what is 2 + 2?", "one two three four five six", "ok"]


def requests() -> list[dict[str, Any]]:
    """(name, sampling parameters, which ranks get prompts) of each call to ``sample``."""
    return [{"name": "sampled", "params": {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 9}, "split": "strided"},
            {"name": "greedy", "params": {"temperature": 0.0, "max_new_tokens": 5}, "split": "strided"},
            {"name": "rank0_only", "params": {"temperature": 0.7, "top_k": 20, "max_new_tokens": 6},
             "split": "rank0"}]


def run(strategy: str, tokenizer: Any) -> dict[str, Any]:
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_backend_hf.testing import tiny_qwen2_config
    from twinkle_rl.samplers import HFGenerateSampler

    from twinkle_core import distributed
    from twinkle_core.sampling import SamplingParams, sample_seed

    name, options = STRATEGIES.get(strategy, (strategy, {}))
    model = TransformersModel(config=tiny_qwen2_config(vocab_size=len(tokenizer)), seed=SEED, strategy=name,
                              strategy_options=options, tokenizer=tokenizer)
    sampler = HFGenerateSampler(batch_size=1)
    sampler.bind(model, tokenizer)
    rank, world = distributed.rank(), distributed.world_size()
    prompts = [tokenizer(text)["input_ids"] for text in TEXTS]
    results: dict[str, Any] = {}
    for number, request in enumerate(requests()):
        if request["split"] == "rank0":
            mine = list(range(len(prompts))) if rank == 0 else []
        else:
            mine = list(range(len(prompts)))[rank::world]
        seeds = [[sample_seed(number, i, j) for j in range(SAMPLES)] for i in mine]
        completions = sampler.sample([prompts[i] for i in mine], n=SAMPLES, params=SamplingParams(**request["params"]),
                                     seeds=seeds)
        results[request["name"]] = {str(i): [[c.token_ids, c.logprobs, c.finish_reason] for c in per_prompt]
                                    for i, per_prompt in zip(mine, completions, strict=True)}
    gathered = [results]
    if world > 1:
        import torch.distributed as dist

        gathered = [None] * world
        dist.all_gather_object(gathered, results)
    merged: dict[str, Any] = {}
    for part in gathered:
        for name, by_prompt in part.items():
            merged.setdefault(name, {}).update(by_prompt)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategies", nargs="*", default=["single"])
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from twinkle_core import distributed

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    output = {strategy: run(strategy, tokenizer) for strategy in args.strategies}
    if distributed.is_main_process():
        with open(args.out + ".tmp", "w") as fh:
            json.dump(output, fh)
        os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
