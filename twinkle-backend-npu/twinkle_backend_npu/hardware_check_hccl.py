"""The ``hccl`` hardware check: a 2-rank torchrun job on this host's NPUs.

Each rank checks an ``all_reduce`` and an ``all_gather`` over the accelerator's collective backend (``hccl`` on
Ascend), then trains a tiny Qwen2 ``TransformersModel`` for three steps with strategy ``ddp``, every rank on its
own half of each batch. Passing means: the collectives give the exact expected values, every step's loss is
finite, the global (token-weighted) loss is the same on both ranks and the weights are bit-identical on both
ranks after every step (gradients really were averaged). Run through
``python -m twinkle_backend_npu.hardware_check hccl``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

WORLD_SIZE = 2
STEPS = 3


def check_hccl(args: argparse.Namespace, worker: list[str] | None = None) -> dict[str, Any]:
    """Launch the job (``torchrun``, loopback, a free port), then judge the ranks' reports.

    ``worker``: what torchrun runs on each rank (default this module; the tests wrap it in the CPU fake)."""
    from twinkle_core.testing.torchrun import run_torchrun

    with tempfile.TemporaryDirectory(prefix="twinkle-hccl-check-") as out:
        sizes = [f"--{name}={getattr(args, name)}" for name in ("hidden", "layers", "heads", "vocab", "seq")]
        job = run_torchrun([*(worker or ["-m", __name__]), out, *sizes], nproc=WORLD_SIZE, timeout=args.timeout)
        reports = [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"))]
    result: dict[str, Any] = {"returncode": job.returncode, "seconds": round(job.seconds, 1), "ranks": reports}
    problems = judge(reports)
    if job.returncode != 0:
        problems.insert(0, f"torchrun exited with {job.returncode}; its output ends:\n{job.output[-3000:]}")
    result.update(problems=problems, passed=not problems)
    for line in problems or [f"hccl: {WORLD_SIZE} ranks agree on {STEPS} ddp steps, losses "
                             f"{reports[0]['global_losses']}"]:
        print(f"hccl: {line}")
    return result


def judge(reports: list[dict[str, Any]]) -> list[str]:
    """What is wrong with the ranks' reports (empty: the check passed)."""
    if len(reports) != WORLD_SIZE:
        return [f"{len(reports)} of {WORLD_SIZE} ranks reported"]
    problems = [f"rank {r['rank']}: {what}" for r in reports for what in r["collective_errors"]]
    for report in reports:
        if not all(math.isfinite(loss) for loss in report["local_losses"]):
            problems.append(f"rank {report['rank']}: non-finite loss {report['local_losses']}")
    if len({tuple(r["global_losses"]) for r in reports}) != 1:
        problems.append(f"global losses differ between ranks: {[r['global_losses'] for r in reports]}")
    if len({tuple(r["weight_checksums"]) for r in reports}) != 1:
        problems.append(f"weights differ between ranks after ddp steps: {[r['weight_checksums'] for r in reports]}")
    return problems


# ---------------------------------------------------------------------- one rank (run by torchrun)
def _collective_errors(accelerator: Any) -> list[str]:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    errors = []
    total = torch.tensor([float(rank + 1)], device=accelerator.device())
    dist.all_reduce(total)
    if float(total) != world * (world + 1) / 2:
        errors.append(f"all_reduce of rank+1 gave {float(total)}, expected {world * (world + 1) / 2}")
    gathered = [torch.zeros(3, device=accelerator.device()) for _ in range(world)]
    dist.all_gather(gathered, torch.full((3,), float(rank), device=accelerator.device()))
    if [float(t[0]) for t in gathered] != [float(r) for r in range(world)]:
        errors.append(f"all_gather gave {[t.tolist() for t in gathered]}")
    return errors


def run_rank(out: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from twinkle_backend_hf.model import TransformersModel

    from twinkle_core.accelerator import current_accelerator
    from twinkle_core.testing.conformance import local_rows, make_batch

    config = {"model_type": "qwen2", "vocab_size": args.vocab, "hidden_size": args.hidden,
              "intermediate_size": 2 * args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": args.heads, "num_key_value_heads": max(1, args.heads // 2),
              "max_position_embeddings": max(64, args.seq), "tie_word_embeddings": False}
    model = TransformersModel(config=config, strategy="ddp", seed=0)  # joins the job over accelerator.dist_backend
    accelerator = current_accelerator()
    report: dict[str, Any] = {"rank": dist.get_rank(), "backend": dist.get_backend(),
                              "device": str(accelerator.device()), "collective_errors": _collective_errors(accelerator),
                              "local_losses": [], "global_losses": [], "weight_checksums": []}
    model.set_optimizer("AdamW", lr=1e-3)
    for step in range(STEPS):
        out_step = model.forward_backward(inputs=local_rows(model, make_batch(step, rows=4, length=min(args.seq, 32),
                                                                              vocab=args.vocab)))
        model.clip_grad_and_step(max_grad_norm=1.0)
        loss, tokens = out_step["loss"].double(), torch.as_tensor(float(out_step["num_tokens"]), dtype=torch.float64)
        pair = torch.stack([loss.cpu() * tokens, tokens]).to(accelerator.device())
        dist.all_reduce(pair)
        report["local_losses"].append(float(loss))
        report["global_losses"].append(float(pair[0] / pair[1]))
        report["weight_checksums"].append(float(sum(p.detach().double().sum().cpu()
                                                    for p in model.get_state_dict().values())))
    Path(out, f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    from twinkle_core.testing.torchrun import exit_job

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    for flag in ("--hidden", "--layers", "--heads", "--vocab", "--seq"):
        parser.add_argument(flag, type=int, required=True)
    parsed = parser.parse_args(sys.argv[1:])
    run_rank(parsed.out, parsed)
    exit_job(0)
