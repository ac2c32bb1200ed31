"""(a) Twinkle's training step vs a hand-written PyTorch/Transformers loop on the same model.

Both contenders train their own copy of the same Qwen2-architecture model (built from a config with
the same seed, so identical initial weights) on the same batches, in the same process, with the same
torch threads. One step is, in both:

    forward -> cross entropy summed over label tokens / number of label tokens -> backward
    -> clip_grad_norm_(1.0) -> fused AdamW step (lr 1e-3, weight_decay 0.01; Twinkle's default kernel)
    -> zero_grad (grads set to None)

Twinkle runs it as ``model.forward_backward(inputs=batch)`` + ``model.clip_grad_and_step(1.0)``
(``TransformersModel``, strategy ``single``, precision ``no``, loss ``cross_entropy``). The hand loop
writes it out with the same label shift as Twinkle (labels shifted left, last position ignored), so
both compute exactly the same numbers; the script checks that the losses of both agree step by step.

Timing: steps are interleaved pair by pair (A B, then B A, ...) so a change in machine load hits both
contenders alike; each step is timed with ``perf_counter`` around the full step. Reported: median
ms/step of each, the median of the per-pair ratios Twinkle/hand (with its quartiles) and the ratio of
the medians. A second, much smaller model ("overhead probe") makes the framework's fixed per-step
cost visible in absolute milliseconds, split into the forward/backward and the clip/step halves.

    python bench/step_time.py            # default (~1-2 min)
    python bench/step_time.py --quick    # smoke run (< 20 s)
    python bench/step_time.py --profile  # also cProfile Twinkle's step on the overhead probe
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common as C

LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 0.01, 1.0
PROMPT_FRACTION = 0.25  # the first quarter of every row is "prompt" (label -100), like SFT data


# ---------------------------------------------------------------------- data
def make_batches(spec: dict[str, Any], batch_size: int, seq_len: int, count: int, seed: int) -> list[dict]:
    """``count`` full-length batches of random tokens; labels -100 on the prompt part and position 0."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, spec["vocab_size"], (batch_size, seq_len), generator=g)
        labels = ids.clone()
        labels[:, : max(1, int(seq_len * PROMPT_FRACTION))] = -100
        batches.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)})
    return batches


# ---------------------------------------------------------------------- contenders
class TwinkleStep:
    name = "twinkle"

    def __init__(self, spec: dict[str, Any], seed: int) -> None:
        from twinkle_backend_hf.model import TransformersModel

        from twinkle_core.tasks.causal_lm import CausalLMTask

        self.model = TransformersModel(config=dict(spec), seed=seed, task=CausalLMTask())
        self.model.set_loss("cross_entropy")
        self.model.set_optimizer("AdamW", lr=LR, weight_decay=WEIGHT_DECAY)
        self.split = [0.0, 0.0]

    def __call__(self, batch: dict) -> float:
        t0 = time.perf_counter()
        out = self.model.forward_backward(inputs=batch)
        t1 = time.perf_counter()
        self.model.clip_grad_and_step(max_grad_norm=MAX_GRAD_NORM)
        t2 = time.perf_counter()
        self.split = [t1 - t0, t2 - t1]
        return float(out["loss"])

    def parameters(self) -> list:
        return list(self.model.module.parameters())


class HandStep:
    """What one would write by hand: the same model, loss normalisation, clipping and optimizer."""

    name = "hand"

    def __init__(self, spec: dict[str, Any], seed: int) -> None:
        import torch

        self.torch = torch
        self.F = torch.nn.functional
        self.module = C.build_hf_model(spec, seed)
        self.module.train()
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        # the kernel set_optimizer("AdamW") picks by default, so both sides run the same optimizer
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        self.split = [0.0, 0.0]

    def __call__(self, batch: dict) -> float:
        torch, F = self.torch, self.F
        t0 = time.perf_counter()
        logits = self.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             use_cache=False).logits
        labels = batch["labels"]
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1).reshape(-1)
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted, ignore_index=-100,
                                   reduction="sum")
        loss = loss_sum / (shifted != -100).sum()
        loss.backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        self.split = [t1 - t0, t2 - t1]
        return float(loss.detach())

    def parameters(self) -> list:
        return list(self.module.parameters())


# ---------------------------------------------------------------------- measurement
def run_interleaved(contenders: list[Any], batches: list[dict], warmup: int, pairs: int) -> dict[str, Any]:
    """Alternate the contenders step by step (order swapped every pair); per-step wall times."""
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    splits: dict[str, list[list[float]]] = {c.name: [] for c in contenders}
    losses: dict[str, list[float]] = {c.name: [] for c in contenders}
    step = 0
    for i in range(warmup + pairs):
        order = contenders if i % 2 == 0 else contenders[::-1]
        batch = batches[i % len(batches)]
        for c in order:
            t0 = time.perf_counter()
            loss = c(batch)
            dt = time.perf_counter() - t0
            losses[c.name].append(loss)
            if i >= warmup:
                times[c.name].append(dt)
                splits[c.name].append(list(c.split))
        step += 1
    return {"times": times, "splits": splits, "losses": losses}


def compare(contenders: list[Any], batches: list[dict], warmup: int, pairs: int) -> dict[str, Any]:
    raw = run_interleaved(contenders, batches, warmup, pairs)
    tw, hd = raw["times"]["twinkle"], raw["times"]["hand"]
    ratios = [a / b for a, b in zip(tw, hd)]
    loss_diff = max(abs(a - b) for a, b in zip(raw["losses"]["twinkle"], raw["losses"]["hand"]))
    import torch

    with torch.no_grad():
        param_diff = max(float((p - q).abs().max()) for p, q in zip(contenders[0].parameters(),
                                                                     contenders[1].parameters()))
    result = {
        "twinkle_ms": C.stats([t * 1e3 for t in tw]),
        "hand_ms": C.stats([t * 1e3 for t in hd]),
        "paired_ratio": C.stats(ratios),
        "ratio_of_medians": C.stats(tw)["median"] / C.stats(hd)["median"],
        "split_ms": {name: {"forward_backward": C.stats([s[0] * 1e3 for s in sp])["median"],
                            "clip_step_zero": C.stats([s[1] * 1e3 for s in sp])["median"]}
                     for name, sp in raw["splits"].items()},
        "max_abs_loss_diff": loss_diff,
        "max_abs_param_diff_after": param_diff,
        "losses_first_last": {k: [v[0], v[-1]] for k, v in raw["losses"].items()},
        "steps_per_contender": warmup + pairs,
        "warmup_steps": warmup,
    }
    result["overhead_ms"] = result["twinkle_ms"]["median"] - result["hand_ms"]["median"]
    return result


def bookkeeping_costs(spec: dict[str, Any], seed: int, batch: dict, repeats: int) -> dict[str, float]:
    """Isolated cost (ms, best of ``repeats``) of the per-step work Twinkle adds around the math.

    * ``parameter_walk``: ``TorchTwinkleModel._parameters("")`` (a walk of the module tree), called 3x
      per optimizer step (``_normalise_gradients``, ``clip_grad_norm``, ``zero_grad``);
    * ``module_train``: ``self.wrapped.train()``, called by every ``forward`` (walks all modules);
    * ``scale_gradients_by_1``: ``Strategy.scale_gradients`` - one ``p.grad.mul_(factor)`` per parameter;
      with one micro-batch on one rank the factor is ``loss_divisor / tokens`` = 1.0, so this full
      read+write pass over every gradient changes nothing.
    """
    tw = TwinkleStep(spec, seed)
    tw(batch)
    m = tw.model

    def best(fn: Any, inner: int) -> float:
        fn()
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - t0) / inner * 1e3)
        return min(out)

    costs = {"parameter_walk": best(lambda: m._parameters(""), 50),
             "module_train": best(lambda: m.wrapped.train(), 50)}
    m.forward_backward(inputs=batch)
    handle = m.train_state().handle
    costs["scale_gradients_by_1"] = best(lambda: m.strategy.scale_gradients(m.wrapped, handle, 1.0), 5)
    m.zero_grad()
    costs["per_step_total"] = 3 * costs["parameter_walk"] + costs["module_train"] + costs["scale_gradients_by_1"]
    return costs


def profile_twinkle(spec: dict[str, Any], seed: int, batches: list[dict], steps: int) -> str:
    import cProfile
    import io
    import pstats

    tw = TwinkleStep(spec, seed)
    for b in batches[:3]:
        tw(b)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(steps):
        tw(batches[i % len(batches)])
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    C.add_common_args(parser, repeats=20)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--probe-pairs", type=int, default=None, help="pairs of the overhead probe")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    threads = C.set_threads(args.threads)
    q = args.quick
    batch_size = args.batch_size or (2 if q else 8)
    seq_len = args.seq_len or (64 if q else 128)
    pairs = args.repeats or (3 if q else 20)
    warmup = args.warmup if args.warmup is not None else (1 if q else 3)
    probe_pairs = args.probe_pairs or (10 if q else 200)

    with C.LoadMonitor() as mon:
        batches = make_batches(C.BENCH_MODEL, batch_size, seq_len, 4, args.seed)
        main_cmp = compare([TwinkleStep(C.BENCH_MODEL, args.seed), HandStep(C.BENCH_MODEL, args.seed)],
                           batches, warmup, pairs)
        probe_batches = make_batches(C.OVERHEAD_MODEL, batch_size, seq_len, 4, args.seed)
        probe = compare([TwinkleStep(C.OVERHEAD_MODEL, args.seed), HandStep(C.OVERHEAD_MODEL, args.seed)],
                        probe_batches, max(warmup, 5), probe_pairs)
        costs = bookkeeping_costs(C.BENCH_MODEL, args.seed, batches[0], 3 if q else 7)
        profile = profile_twinkle(C.OVERHEAD_MODEL, args.seed, probe_batches, 50 if q else 200) \
            if args.profile else None

    payload = {
        "question": "Twinkle step time vs a hand-written PyTorch/Transformers loop (target ratio <= 1.03)",
        "settings": {"quick": q, "threads": threads, "batch_size": batch_size, "seq_len": seq_len,
                     "tokens_per_step": batch_size * seq_len, "pairs": pairs, "warmup": warmup,
                     "lr": LR, "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM,
                     "prompt_fraction_masked": PROMPT_FRACTION, "seed": args.seed},
        "model": {"config": C.BENCH_MODEL, "parameters": C.count_parameters(C.BENCH_MODEL)},
        "result": main_cmp,
        "overhead_probe": {"config": C.OVERHEAD_MODEL, "parameters": C.count_parameters(C.OVERHEAD_MODEL),
                           "pairs": probe_pairs, **probe},
        "bookkeeping_ms": costs,
        "bookkeeping_share_of_twinkle_step": costs["per_step_total"] / main_cmp["twinkle_ms"]["median"],
        "target_ratio_max": 1.03,
        "meets_target": main_cmp["paired_ratio"]["median"] <= 1.03,
    }
    path = C.write_result("step_time", payload, mon, out_dir=args.out_dir)

    rows = []
    for label, r in (("bench model", main_cmp), ("overhead probe", probe)):
        rows.append([label, C.fmt(r["twinkle_ms"]["median"]), C.fmt(r["hand_ms"]["median"]),
                     f"{r['paired_ratio']['median']:.3f} [{r['paired_ratio']['p25']:.3f}, "
                     f"{r['paired_ratio']['p75']:.3f}]", f"{r['ratio_of_medians']:.3f}",
                     f"{r['overhead_ms']:+.2f}", f"{r['max_abs_loss_diff']:.1e}"])
    print(C.markdown_table(["model", "Twinkle ms/step", "hand ms/step", "ratio (median [p25, p75])",
                            "ratio of medians", "overhead ms", "max |loss diff|"], rows))
    for label, r in (("bench model", main_cmp), ("overhead probe", probe)):
        s = r["split_ms"]
        print(f"{label}: forward+backward ms twinkle {s['twinkle']['forward_backward']:.2f} / hand "
              f"{s['hand']['forward_backward']:.2f}; clip+step+zero ms twinkle {s['twinkle']['clip_step_zero']:.2f}"
              f" / hand {s['hand']['clip_step_zero']:.2f}")
    print("Twinkle bookkeeping per step on the bench model (ms, isolated): "
          + ", ".join(f"{k} {v:.2f}" for k, v in costs.items())
          + f" = {100 * payload['bookkeeping_share_of_twinkle_step']:.1f}% of the Twinkle step")
    if profile:
        print(profile)
    print(mon.short())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
