"""(e) Generation speed of the ``hf_generate`` RL sampler vs ``model.generate(do_sample=True)``.

The same policy (``TransformersModel`` of ``_common.BENCH_MODEL`` with a 32k vocabulary, fp32, random init),
the same ``--prompts`` prompts (random token ids, lengths 16-64, left-padded into one batch by both), the
same number of new tokens (``--new-tokens``), the same sampling settings. Contenders:

* ``sampler``  - ``HFGenerateSampler.sample(prompts, n=1, ...)`` through ``model.generation_module()``
  (per-completion generators, float32 behaviour log-probs of every token);
* ``generate`` - ``policy.hf_model.generate(input_ids, attention_mask, do_sample=True, ...)`` under
  ``torch.no_grad()`` in eval mode, one call for the batch.

Neither stops early: the model has no EOS id and the sampler is bound without a tokenizer, so both
generate exactly ``prompts x new_tokens`` tokens (counted from the outputs). Each setting (``plain``:
temperature 1; ``nucleus``: temperature 0.7, top-p 0.9) runs ``--repeats`` pairs, alternating which
contender goes first; reported: tokens/s per contender (median over pairs) and the median of the
per-pair ratios sampler / generate (target >= 0.95).

    python bench/sampler.py          # default (~30-60 s on 2 idle cores)
    python bench/sampler.py --quick  # smoke run (< 15 s)
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import _common as C

SAMPLER_MODEL = {**C.BENCH_MODEL, "vocab_size": 32000, "eos_token_id": None, "bos_token_id": None}
SETTINGS = {"plain": {"temperature": 1.0}, "nucleus": {"temperature": 0.7, "top_p": 0.9}}
TARGET = 0.95


def make_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 65, (count,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


class SamplerRun:
    def __init__(self, policy: Any, prompts: list[list[int]], new_tokens: int) -> None:
        from twinkle_rl.samplers import HFGenerateSampler

        self.sampler = HFGenerateSampler()
        self.sampler.bind(policy, None)
        self.prompts, self.new_tokens = prompts, new_tokens
        self.calls = 0

    def __call__(self, setting: dict[str, float]) -> int:
        from twinkle_core.sampling import SamplingParams, sample_seed

        self.calls += 1
        seeds = [[sample_seed(self.calls, i)] for i in range(len(self.prompts))]
        out = self.sampler.sample(self.prompts, n=1, params=SamplingParams(max_new_tokens=self.new_tokens, **setting),
                                  seeds=seeds)
        return sum(len(c.token_ids) for per_prompt in out for c in per_prompt)


class GenerateRun:
    def __init__(self, policy: Any, prompts: list[list[int]], new_tokens: int) -> None:
        import torch

        self.module = policy.hf_model
        width = max(map(len, prompts))
        self.input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
        self.attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, prompt in enumerate(prompts):  # left padding, as generation needs
            self.input_ids[r, width - len(prompt):] = torch.tensor(prompt)
            self.attention_mask[r, width - len(prompt):] = 1
        self.new_tokens = new_tokens

    def __call__(self, setting: dict[str, float]) -> int:
        import torch

        self.module.eval()
        try:
            with torch.no_grad():
                out = self.module.generate(self.input_ids, attention_mask=self.attention_mask, do_sample=True,
                                           max_new_tokens=self.new_tokens, use_cache=True, pad_token_id=0,
                                           top_k=None, top_p=setting.get("top_p", 1.0),
                                           temperature=setting["temperature"])
        finally:
            self.module.train()
        return int(out[:, self.input_ids.shape[1]:].numel())


def measure(contenders: dict[str, Any], setting: dict[str, float], repeats: int) -> dict[str, Any]:
    """``repeats`` pairs, alternating the order; tokens/s per contender and the per-pair ratio."""
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for name in names:  # warm-up (allocator, first-call costs)
        contenders[name](setting)
    for pair in range(repeats):
        for name in names if pair % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            tokens = contenders[name](setting)
            rates[name].append(tokens / (time.perf_counter() - start))
    ratios = [s / g for s, g in zip(rates["sampler"], rates["generate"], strict=True)]
    return {"tokens_per_s": {name: C.stats(values) for name, values in rates.items()}, "ratio": C.stats(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(parser, repeats=5)
    parser.add_argument("--prompts", type=int, default=None, help="prompts per batch (default 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per prompt (default 40)")
    args = parser.parse_args()
    threads = C.set_threads(args.threads)
    warnings.filterwarnings("ignore")
    q = args.quick
    count = args.prompts or (4 if q else 16)
    new_tokens = args.new_tokens or (8 if q else 40)
    repeats = args.repeats or (2 if q else 5)

    from twinkle_backend_hf.model import TransformersModel

    with C.LoadMonitor() as mon:
        policy = TransformersModel(config=dict(SAMPLER_MODEL), seed=args.seed)
        prompts = make_prompts(count, SAMPLER_MODEL["vocab_size"], args.seed)
        contenders = {"sampler": SamplerRun(policy, prompts, new_tokens),
                      "generate": GenerateRun(policy, prompts, new_tokens)}
        results = {name: measure(contenders, setting, repeats) for name, setting in SETTINGS.items()}

    worst = min(r["ratio"]["median"] for r in results.values())
    payload = {
        "question": f"generated tokens/s of the hf_generate sampler vs model.generate(do_sample=True) on the same "
                    f"batch (target ratio >= {TARGET})",
        "settings": {"quick": q, "threads": threads, "prompts": count, "new_tokens": new_tokens, "repeats": repeats,
                     "prompt_lengths": [len(p) for p in prompts], "sampling": SETTINGS, "seed": args.seed},
        "model": {"config": SAMPLER_MODEL, "parameters": C.count_parameters(SAMPLER_MODEL)},
        "result": results,
        "worst_median_ratio": worst,
        "target_ratio_min": TARGET,
        "meets_target": worst >= TARGET,
    }
    path = C.write_result("sampler", payload, mon, args.out_dir)
    for name, r in results.items():
        t = r["tokens_per_s"]
        print(f"sampler {name}: {t['sampler']['median']:.0f} tok/s vs generate {t['generate']['median']:.0f} tok/s, "
              f"ratio {r['ratio']['median']:.3f} [{r['ratio']['min']:.3f}-{r['ratio']['max']:.3f}] "
              f"(target >= {TARGET}: {'yes' if r['ratio']['median'] >= TARGET else 'no'})")
    print(mon.short())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
