"""Loss-parity run: the same tiny model, data and optimizer under any strategy; per-step losses to JSON.

    python parity.py OUT.json                                   # one process, the reference
    torchrun --nproc-per-node 2 parity.py OUT.json --strategy ddp
    torchrun --nproc-per-node 2 parity.py OUT.json --strategy native_fsdp --save-dir DIR
    torchrun ... parity.py OUT.json --strategy deepspeed --strategy-options '{"stage": 3}' --mesh '{"dp": 2}'
    torchrun ... parity.py OUT.json --spec '{"strategy": "native_fsdp", "strategy_options": {}, "mesh": null}'

Every step takes ``--grad-accum`` fixed micro-batches of ``--rows`` global rows (``--cycle``
distinct steps, repeated, so the loss falls); each data-parallel rank takes its share of every
micro-batch (``local_rows``), so any number of ranks sees the same global data. AdamW, gradient clipping at ``--max-grad-norm``.

Rank 0 writes ``{"losses": [...], "grad_norms": [...], ...}``: the step's global loss
(``calculate_metric()["loss"]``, reduced over ranks) and the pre-clip global gradient norm. With
``--save-dir`` the trained model is saved there (``model.save``) and the logits of a fixed
evaluation batch are written to ``OUT.logits.pt``. Also recorded: the strategy class, the mesh and
whether the trainable parameters are ``DTensor`` shards.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="JSON file written by rank 0")
    parser.add_argument("--spec", type=json.loads, default=None,
                        help="JSON object with any of strategy, strategy_options, mesh, precision, model_options")
    parser.add_argument("--strategy", default=None, help="strategy name (default: single)")
    parser.add_argument("--strategy-options", type=json.loads, default=None, help="JSON object")
    parser.add_argument("--mesh", type=json.loads, default=None, help='JSON object, e.g. {"fsdp": 2}')
    parser.add_argument("--precision", default=None)
    parser.add_argument("--model-config", type=json.loads, default=None,
                        help="JSON overrides of the tiny qwen2 config (hidden_size, num_hidden_layers ...)")
    parser.add_argument("--model-options", type=json.loads, default=None,
                        help="JSON object of extra TransformersModel options")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--cycle", type=int, default=2,
                        help="number of distinct step batches, repeated (so the model can memorise them)")
    parser.add_argument("--rows", type=int, default=8, help="global rows per micro-batch")
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", default=None, help="save the trained model here (model.save)")
    parser.add_argument("--reverse-rows", action="store_true",
                        help="reverse every batch's rows: the same mathematics in another summation order (the "
                             "reference's own float spread, see twinkle_core.testing.tolerance)")
    args = parser.parse_args(argv)
    spec = dict(args.spec or {})
    unknown = set(spec) - {"strategy", "strategy_options", "mesh", "precision", "model_options"}
    if unknown:
        parser.error(f"unknown --spec key(s) {sorted(unknown)}")
    args.strategy = args.strategy or spec.get("strategy") or "single"
    args.strategy_options = args.strategy_options if args.strategy_options is not None else spec.get(
        "strategy_options") or {}
    args.mesh = args.mesh if args.mesh is not None else spec.get("mesh")
    args.precision = args.precision or spec.get("precision") or "no"
    args.model_options = args.model_options if args.model_options is not None else spec.get("model_options") or {}
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch
    from twinkle_backend_hf.testing import make_tiny_model, tiny_qwen2_config

    from twinkle_core import distributed
    from twinkle_core.testing.conformance import local_rows, make_batch

    args = parse_args(argv)
    config = tiny_qwen2_config(**(args.model_config or {}))
    model = make_tiny_model(seed=args.seed, config=config, strategy=args.strategy,
                            strategy_options=args.strategy_options, mesh=args.mesh, precision=args.precision,
                            **args.model_options)
    model.set_optimizer("AdamW", lr=args.lr, weight_decay=0.01, gradient_accumulation_steps=args.grad_accum)

    losses, grad_norms = [], []
    for step in range(args.steps):
        for micro in range(args.grad_accum):
            batch = make_batch(1000 + (step % args.cycle) * args.grad_accum + micro, rows=args.rows, length=args.length,
                               vocab=config["vocab_size"])
            if args.reverse_rows:
                batch = {key: value.flip(0) for key, value in batch.items()}
            model.forward_backward(inputs=local_rows(model, batch))
            norm = model.clip_grad_and_step(max_grad_norm=args.max_grad_norm)
        grad_norms.append(float(norm))
        losses.append(float(model.calculate_metric()["loss"]))

    eval_batch = make_batch(7, rows=args.rows, length=args.length, vocab=config["vocab_size"])
    local_eval = local_rows(model, eval_batch)
    logits = model.forward_only(inputs=local_eval)["logits"].detach().float().cpu()
    saved = None
    if args.save_dir:
        saved = model.save("final", output_dir=args.save_dir)

    from torch.distributed.tensor import DTensor

    params = model.trainable_parameters()
    cfg = model.get_train_configs()
    result = {
        "losses": losses,
        "grad_norms": grad_norms,
        "tokens_per_step": args.rows * args.length * args.grad_accum,
        "strategy": args.strategy,
        "strategy_class": f"{type(model.strategy).__module__}:{type(model.strategy).__qualname__}",
        "wrapped_class": type(model.wrapped).__name__,
        "world_size": distributed.world_size(),
        "dp_size": cfg["dp_size"],
        "mesh": cfg["strategy"].get("mesh"),
        "dtensor_parameters": sum(isinstance(p, DTensor) for p in params),
        "parameters": len(params),
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "global_numel": sum(p.numel() for p in params),
        "strategy_config": cfg["strategy"],
        "saved": saved,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    # the evaluation logits of every data-parallel rank, in row order
    gathered = [logits]
    if distributed.world_size() > 1:
        import torch.distributed as dist

        gathered = [None] * distributed.world_size()
        dist.all_gather_object(gathered, (cfg["dp_rank"], logits))
        by_rank = dict(gathered)
        gathered = [by_rank[r] for r in sorted(by_rank)]
    if distributed.is_main_process():
        if args.save_dir:
            torch.save({"input_ids": eval_batch["input_ids"], "logits": torch.cat(gathered)}, args.out + ".logits.pt")
        tmp = args.out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
        os.replace(tmp, args.out)
    distributed.barrier()
    return result


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
