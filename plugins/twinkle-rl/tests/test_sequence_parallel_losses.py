"""Per-sequence losses (DPO family, GRPO / GSPO / Dr. GRPO) under sequence parallelism equal whole sequences.

``scripts/sp_losses.py`` on 2 ranks (gloo): every preference and policy loss on float64 logits sliced as the HF
backend's ``ulysses`` strategy slices them (contiguous for Ulysses, zig-zag for ring attention), with the sequence
group in the ``LossContext``; and one ``forward_backward`` of a tiny Qwen2 under strategy ``ulysses`` (mesh
``sp=2``, and ``cp_impl: ring``) against the single process.

Tolerances (``twinkle_core.testing.tolerance``): the sliced float64 losses differ from the whole ones only in how
the per-sequence sums of at most ``ROWS * LENGTH`` terms are split over the ranks: the float64 bound of such a sum
at the quantity's magnitude. The model runs (float32) within one forward (the loss) or forward and backward (the
gradients) of the 2-layer, 64-wide model, as the backend's own Ulysses / ring parity tests take them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from script_runs import job_output, run_single_process, script_env, script_module

from twinkle_core.testing.tolerance import forward_tolerance, sum_tolerance
from twinkle_core.testing.torchrun import run_torchrun

SCRIPT = Path(__file__).resolve().parent / "scripts" / "sp_losses.py"
SP = script_module(SCRIPT, "sp_losses_constants")
ROWS, LENGTH = 4, 15  # the script's batch
#: tiny_qwen2_config: 2 layers whose widest reduction is the 64-wide MLP; a gradient passes them twice
LAYERS, WIDTH = 2, 64


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("sp-losses")
    single = run_single_process(SCRIPT, ["reference", str(out)], timeout=120)
    assert single.returncode == 0, job_output(single)
    job = run_torchrun([str(SCRIPT), "sp", str(out)], nproc=2, timeout=180, env=script_env())
    assert job.returncode == 0, job.output
    print(f"single-process job {single.seconds:.1f} s, torchrun job {job.seconds:.1f} s")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def float64_bound(magnitude: float) -> float:
    return sum_tolerance(ROWS * LENGTH, max(magnitude, 1.0), torch.float64)


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sliced_losses_and_gradients_are_the_whole_sequences(results):
    for rank, result in enumerate(results):
        assert sorted(result["losses"]) == sorted(f"{key}/{layout}" for key in SP.LOSSES
                                                  for layout in ("contiguous", "zigzag"))
        for case, stats in result["losses"].items():
            # every sequence (pair) counted once over the group, not once per rank
            assert stats["num_tokens"] == pytest.approx(stats["reference_num_tokens"], abs=1e-12), (rank, case)
            assert abs(stats["loss"] - stats["reference_loss"]) <= float64_bound(abs(stats["reference_loss"])), \
                (rank, case, stats)
            assert stats["grad_delta"] <= float64_bound(stats["grad_magnitude"]), (rank, case, stats)


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ulysses_and_ring_training_steps_match_one_process(results):
    for rank, result in enumerate(results):
        assert sorted(result["model"]) == sorted(f"{key}/{impl}" for key in SP.MODEL_LOSSES
                                                 for impl in ("ulysses", "ring"))
        for case, stats in result["model"].items():
            loss_tolerance = forward_tolerance(abs(stats["reference_loss"]), width=WIDTH, depth=LAYERS)
            assert abs(stats["loss"] - stats["reference_loss"]) <= loss_tolerance, (rank, case, stats)
            grad_tolerance = forward_tolerance(stats["grad_magnitude"], width=WIDTH, depth=2 * LAYERS)
            assert stats["grad_delta"] <= grad_tolerance, (rank, case, stats, grad_tolerance)

