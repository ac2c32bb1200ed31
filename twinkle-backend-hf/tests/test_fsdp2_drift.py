"""FSDP2 (``native_fsdp``, 2 CPU ranks) computes the single process's updates, pinned in float64.

In float32 an FSDP2 run leaves the one-process run after a few dozen steps of the quickstart recipe
(``examples/fsdp2_full/README.md``, ``bench/fsdp2_drift.py``): the two add the same numbers in another order,
and AdamW turns that ~1e-7 rounding into growing differences (chaos). A defect (clipping by the local shard's
norm, weight decay or the fused AdamW kernel acting differently on DTensor shards, gradients divided by the
wrong token count) changes the update itself, far above rounding. In float64 rounding is 1e-16, so FSDP2 must
follow the one-process run over every step to the float64 reference's own noise; the tolerance is
``twinkle_core.testing.tolerance``'s: 10x the distance between the reference and the reference with its batch
rows reversed (the same mathematics in another summation order), never less than the float64 rounding bound.
(Before ``grad_norm`` kept float64, FSDP2 clipped by a float32-rounded norm: losses 5.8e-9 off, tolerance 1.5e-13.)
The run is short on purpose: even in float64 AdamW amplifies rounding once a gradient entry is a near-cancelling
sum (on the recipe's model two one-process runs differing only in the AdamW kernel separate after ~10 steps).

The file is also the training script (``python test_fsdp2_drift.py OUT.json --strategy native_fsdp``, under
torchrun for 2 ranks): float64 weights, AdamW with weight decay, a warm-up + cosine schedule, 2 accumulated
micro-batches per step and clipping at 1.0 (some steps clipped, some not).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

STEPS = 20
GRAD_ACCUM = 2
ROWS = 8
LENGTH = 16
MAX_GRAD_NORM = 1.0


# ---------------------------------------------------------------------- the training script
def train_float64(out: str, strategy: str, reverse_rows: bool) -> None:
    import torch
    from twinkle_backend_hf.testing import make_tiny_model, tiny_qwen2_config

    from twinkle_core import distributed
    from twinkle_core.testing.conformance import local_rows, make_batch

    config = tiny_qwen2_config()
    model = make_tiny_model(seed=0, config=config, strategy=strategy)
    model.module.to(torch.float64)  # before the first use: FSDP2 then shards float64 parameters
    model.set_optimizer("AdamW", lr=1e-2, weight_decay=0.01, gradient_accumulation_steps=GRAD_ACCUM)
    model.set_lr_scheduler("cosine", num_training_steps=STEPS, num_warmup_steps=5)
    losses, grad_norms = [], []
    for step in range(STEPS):
        for micro in range(GRAD_ACCUM):
            batch = make_batch(2000 + (step % 4) * GRAD_ACCUM + micro, rows=ROWS, length=LENGTH,
                               vocab=config["vocab_size"])
            if reverse_rows:
                batch = {key: value.flip(0) for key, value in batch.items()}
            model.forward_backward(inputs=local_rows(model, batch))
            norm = model.clip_grad_and_step(max_grad_norm=MAX_GRAD_NORM)
        grad_norms.append(float(norm))
        losses.append(float(model.calculate_metric()["loss"]))
    params = model.trainable_parameters()
    result = {"losses": losses, "grad_norms": grad_norms, "world_size": distributed.world_size(),
              "dtypes": sorted({str(p.dtype) for p in params}),
              "dtensor_parameters": sum(type(p).__name__ == "DTensor" for p in params),
              "global_numel": sum(p.numel() for p in params), "optimizer": model.get_train_configs()["optimizer"]}
    if distributed.is_main_process():
        Path(out).write_text(json.dumps(result, default=str))
    distributed.barrier()


# ---------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    from distributed import run_torchrun
    from parity_helpers import run_python

    root = tmp_path_factory.mktemp("fsdp2-drift")
    script = str(Path(__file__).resolve())
    results: dict[str, dict[str, Any]] = {}
    for key, args, nproc in (("single", ["--strategy", "single"], 1),
                             ("reversed", ["--strategy", "single", "--reverse-rows"], 1),
                             ("fsdp", ["--strategy", "native_fsdp"], 2)):
        out = root / f"{key}.json"
        if nproc == 1:
            result = run_python([script, str(out), *args], timeout=240)
        else:
            result = run_torchrun([script, str(out), *args], nproc=2, timeout=240)
        assert result.returncode == 0, result.output
        results[key] = json.loads(out.read_text())
    return results


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(780)
def test_fsdp2_follows_one_process_in_float64(runs):
    import torch

    from twinkle_core.testing.tolerance import assert_within_spread, sum_tolerance

    single, reversed_rows, fsdp = runs["single"], runs["reversed"], runs["fsdp"]
    assert fsdp["world_size"] == 2 and fsdp["dtensor_parameters"] > 0, fsdp
    assert single["dtypes"] == fsdp["dtypes"] == ["torch.float64"], (single["dtypes"], fsdp["dtypes"])
    norms = single["grad_norms"]
    assert min(norms) < MAX_GRAD_NORM < max(norms), f"the run must clip some steps and not others: {norms}"
    assert single["losses"][-1] < single["losses"][0] - 0.5, f"the model did not learn: {single['losses']}"
    # floors: the float64 rounding bound of a step's loss (a mean over its tokens) and of the squared norm (a sum
    # over every parameter); the spread of the float64 reference decides unless it is below them
    tokens = ROWS * LENGTH * GRAD_ACCUM
    loss_floor = sum_tolerance(tokens, max(map(abs, single["losses"])), torch.float64)
    norm_floor = sum_tolerance(single["global_numel"], max(norms), torch.float64)
    loss_delta = assert_within_spread("float64 FSDP2 losses", fsdp["losses"], single["losses"],
                                      reversed_rows["losses"], floor=loss_floor)
    norm_delta = assert_within_spread("float64 FSDP2 pre-clip grad norms", fsdp["grad_norms"], norms,
                                      reversed_rows["grad_norms"], floor=norm_floor)
    print(f"float64, {STEPS} steps: max |loss - single| = {loss_delta:.3g}, max |grad norm - single| = "
          f"{norm_delta:.3g} (reversed-rows spread: losses "
          f"{max(abs(a - b) for a, b in zip(single['losses'], reversed_rows['losses'])):.3g})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one float64 run of the FSDP2 drift test")
    parser.add_argument("out")
    parser.add_argument("--strategy", default="single")
    parser.add_argument("--reverse-rows", action="store_true")
    cli = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    train_float64(cli.out, cli.strategy, cli.reverse_rows)
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
