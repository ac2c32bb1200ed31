"""VLM loss-parity run: the tiny VLM with the ``vlm`` task (default plan: vision frozen, projector full, LoRA on the
language model) under any strategy; per-step global losses to JSON.

    python vlm_parity.py OUT.json MODEL_DIR ROWS.json                       # one process, the reference
    torchrun --nproc-per-node 2 vlm_parity.py OUT.json MODEL_DIR ROWS.json --strategy ddp

Every step trains on all rows of ROWS.json; data-parallel rank r encodes its own share (rows r, r + world, ...),
because a VLM batch's vision tensors cannot be split by row after collation. SGD without clipping, so each step's
update is exactly the gradient of the global token-mean loss. Rank 0 writes ``{"losses": [...], ...}``.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("model_dir")
    parser.add_argument("rows")
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--strategy-options", type=json.loads, default=None)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    from twinkle_vlm.testing import build_vlm_model, vlm_batch

    from twinkle_core import distributed

    model, task = build_vlm_model(args.model_dir, adapter={"type": "lora", "r": 4, "lora_alpha": 8},
                                  strategy=args.strategy, strategy_options=args.strategy_options)
    with open(args.rows) as fh:
        rows = json.load(fh)
    cfg = model.get_train_configs()
    rank, size = cfg["dp_rank"] or 0, cfg["dp_size"] or 1
    batch = vlm_batch(task, model, rows[rank::size])
    losses = []
    for _ in range(args.steps):
        model.forward_backward(inputs=batch, adapter_name="default")
        model.clip_grad_and_step(None, adapter_name="default")
        losses.append(float(model.calculate_metric(adapter_name="default")["loss"]))
    from torch.distributed.fsdp import FSDPModule

    result = {"losses": losses, "world_size": distributed.world_size(), "dp_size": size,
              "wrapped_class": type(model.wrapped).__name__,
              # the module classes FSDP2 made units of (empty under other strategies)
              "fsdp_units": sorted({type(m).__name__ for m in model.wrapped.modules() if isinstance(m, FSDPModule)})}
    if distributed.is_main_process():
        with open(args.out + ".tmp", "w") as fh:
            json.dump(result, fh)
        os.replace(args.out + ".tmp", args.out)
    distributed.barrier()


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
