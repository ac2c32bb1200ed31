"""Per-rank peak memory of the loss at Qwen's vocabulary (151,936): whole logits vs the vocabulary-parallel loss.

The loss alone, as Megatron hands it over at tensor parallelism 2 (gloo, CPU), each mode in its own fresh
``torchrun`` job (so ``ru_maxrss`` is that mode's own high-water mark):

* ``tp1``            - one rank: ``cross_entropy`` on the whole ``[tokens, vocab]`` float32 logits;
* ``tp1_chunked``    - one rank: ``chunked_cross_entropy`` (1,024 rows at a time, the arithmetic the
  vocabulary-parallel loss uses per rank), the fair single-rank baseline for it;
* ``tp2_gathered``   - two ranks, each holding its ``[tokens, vocab / 2]`` slice, gathered over the ranks first
  (``vocab_parallel_loss=false``, Megatron's ``parallel_output=False``), then ``cross_entropy``;
* ``tp2_vocab_parallel`` - two ranks, ``cross_entropy`` on each rank's slice with ``LossContext.vocab_shard``
  (the default under TP): no rank ever holds ``[tokens, vocab]``.

Measured per rank: the peak RSS above the RSS before the logits exist (so logits, their gradient and everything
the loss allocates; forward and backward), the max over ranks, and the loss value (all modes must agree).

    python bench/vocab_parallel_memory.py            # 2,048 tokens (~1 min)
    python bench/vocab_parallel_memory.py --quick    # 256 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

VOCAB = 151_936
MODES = {"tp1": 1, "tp1_chunked": 1, "tp2_gathered": 2, "tp2_vocab_parallel": 2}


def gather_function():
    """All-gather along the last dimension; backward: this rank's slice (what megatron-core's
    ``gather_from_tensor_model_parallel_region`` does for ``parallel_output=False``)."""
    import torch
    import torch.distributed as dist

    class GatherLastDim(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, x.contiguous())
            return torch.cat(parts, dim=-1)

        @staticmethod
        def backward(ctx, grad):
            width = grad.shape[-1] // dist.get_world_size()
            start = dist.get_rank() * width
            return grad[..., start:start + width].contiguous()

    return GatherLastDim


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from twinkle_core.loss.base import LossContext
    from twinkle_core.loss.cross_entropy import ChunkedCrossEntropyLoss, CrossEntropyLoss
    from twinkle_core.loss.vocab_parallel import VocabShard

    dist.init_process_group("gloo")
    GatherLastDim = gather_function()  # noqa: N806 - a class
    rank, world = dist.get_rank(), dist.get_world_size()
    padded = -(-VOCAB // world) * world
    width = padded // world
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, VOCAB, (1, args.tokens), generator=g)
    labels[0, : args.tokens // 4] = -100
    dist.barrier()
    before = peak_rss_bytes()
    # this rank's slice of the logits, generated slice by slice so every mode sees the same numbers
    local = torch.empty(1, args.tokens, width)
    for row in range(args.tokens):
        local[0, row] = torch.randn(padded, generator=torch.Generator().manual_seed(row))[rank * width:
                                                                                             (rank + 1) * width]
    local.requires_grad_(True)
    loss_fn = ChunkedCrossEntropyLoss(lm_head="logits") if args.mode == "tp1_chunked" else \
        CrossEntropyLoss(lm_head="logits")
    if args.mode == "tp2_vocab_parallel":
        shard = VocabShard(start=rank * width, end=(rank + 1) * width, vocab_size=VOCAB)
        result = loss_fn({"logits": local}, {"labels": labels}, context=LossContext(vocab_shard=shard))
    else:
        logits = local if world == 1 else GatherLastDim.apply(local)
        result = loss_fn({"logits": logits[..., :VOCAB]}, {"labels": labels})
    (result.loss / float(result.num_tokens)).backward()
    peak = peak_rss_bytes() - before
    out = [None] * world
    dist.all_gather_object(out, {"rank": rank, "peak_bytes": peak, "loss": float(result.loss) / float(result.num_tokens)})
    if rank == 0:
        with open(args.raw_out, "w") as fh:
            json.dump(out, fh)
    dist.barrier()


def run_mode(mode: str, tokens: int, timeout: float) -> list[dict]:
    from twinkle_core.testing.torchrun import free_port, thread_env

    with tempfile.TemporaryDirectory(prefix="twinkle-bench-") as tmp:
        raw = os.path.join(tmp, "raw.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(MODES[mode]), "--nnodes", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), os.path.abspath(__file__),
               "--worker", "--mode", mode, "--tokens", str(tokens), "--raw-out", raw]
        env = {**os.environ, **thread_env(), "PYTHONWARNINGS": "ignore"}
        done = subprocess.run(cmd, env=env, cwd=C.ROOT, timeout=timeout, check=False)
        if done.returncode != 0 or not os.path.exists(raw):
            sys.exit(f"the {mode} job failed (exit {done.returncode})")
        with open(raw) as fh:
            return json.load(fh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the batch (default 2,048)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=tuple(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--raw-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.tokens = args.tokens or (256 if args.quick else 2048)
    if args.worker:
        worker(args)
        from twinkle_core.testing.torchrun import exit_job

        exit_job()
    with C.LoadMonitor() as mon:
        ranks = {mode: run_mode(mode, args.tokens, args.timeout) for mode in MODES}
    result = {mode: {"peak_mb_per_rank": [r["peak_bytes"] / 2**20 for r in rows],
                     "peak_mb_max": max(r["peak_bytes"] for r in rows) / 2**20, "loss": rows[0]["loss"]}
              for mode, rows in ranks.items()}
    for mode in MODES:
        result[mode]["vs_tp1"] = result[mode]["peak_mb_max"] / result["tp1"]["peak_mb_max"]
        result[mode]["vs_tp1_chunked"] = result[mode]["peak_mb_max"] / result["tp1_chunked"]["peak_mb_max"]
    payload = {"question": "per-rank peak memory of the loss (logits, their gradient, the loss's temporaries) at "
                           "vocabulary 151,936: whole logits vs the vocabulary-parallel loss at TP=2",
               "settings": {"tokens": args.tokens, "vocab": VOCAB, "dtype": "float32", "loss": "cross_entropy",
                            "backend": "gloo (CPU)"},
               "result": result}
    path = C.write_result("vocab_parallel_memory", payload, mon, out_dir=args.out_dir)
    rows = [[mode, C.fmt(r["peak_mb_max"]), " / ".join(C.fmt(v) for v in r["peak_mb_per_rank"]),
             f"{r['vs_tp1']:.2f}", f"{r['vs_tp1_chunked']:.2f}", f"{r['loss']:.6f}"] for mode, r in result.items()]
    print(C.markdown_table(["mode", "peak MB (max rank)", "per rank", "vs tp1", "vs tp1_chunked", "loss"], rows))
    print(mon.short())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
