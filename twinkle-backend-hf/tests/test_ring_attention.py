"""Ring attention (:mod:`twinkle_backend_hf.sequence_parallel.ring_attention`): the layouts in one process,
and outputs and gradients against full SDPA on the gathered sequence under torchrun (gloo, 2 and 4 ranks).
The compared cases are listed in ``scripts/ring_attention_check.py``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from twinkle_backend_hf.sequence_parallel import ring_layout

from twinkle_core.errors import ConfigError
from twinkle_core.testing.tolerance import SPREAD_FACTOR, forward_tolerance

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ring_attention_check.py")
#: float64 cases: ring and reference differ only in the order of ~24-term float64 sums (measured: <= 3e-15)
FLOAT64_TOLERANCE = 1e-12
LENGTH, HEAD_DIM = 24, 8  # as in the script
#: rounding stages before each compared quantity: scores (a HEAD_DIM-term sum), then the softmax-weighted sum
#: over the keys for the output; the backward adds dP = dO V^T and the product with Q or K (or P^T dO)
STAGES = {"out": 2, "dq": 3, "dk": 3, "dv": 3}


# ---------------------------------------------------------------------- layouts
def test_zigzag_pairs_an_early_chunk_with_its_mirror():
    assert ring_layout.local_indices(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert ring_layout.local_indices(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert ring_layout.local_indices(8, 4, 1, "zigzag").tolist() == [1, 6]
    assert ring_layout.local_indices(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("layout", ring_layout.LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_reassemble_into_the_sequence(layout, world):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    shards = [ring_layout.shard_sequence(x, world, r, layout) for r in range(world)]
    assert sorted(torch.cat([s[0, :, 0] for s in shards]).tolist()) == x[0, :, 0].tolist()  # each token once
    assert torch.equal(ring_layout.unshard_sequence(shards, layout), x)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_zigzag_gives_every_rank_the_same_causal_work(world):
    """Scores computed per rank, in units of one block: contiguous 1, 2, ..., R; zig-zag (R + 1) / 2 each."""
    length, block = 64 * world, 64

    def work(layout, rank):
        total = 0
        for source in range(world):
            window = ring_layout.causal_window(length, world, rank, source, layout)
            if window is not None:
                total += len(window[2]) * len(window[3])
        return total / block**2

    assert [work("contiguous", r) for r in range(world)] == list(range(1, world + 1))
    assert [work("zigzag", r) for r in range(world)] == [(world + 1) / 2] * world


def test_causal_window_keeps_the_keys_each_query_can_see():
    for layout in ring_layout.LAYOUTS:
        for rank in range(4):
            for source in range(4):
                q = ring_layout.local_indices(16, 4, rank, layout)
                k = ring_layout.local_indices(16, 4, source, layout)
                visible = k[None, :] <= q[:, None]
                window = ring_layout.causal_window(16, 4, rank, source, layout)
                if window is None:
                    assert not visible.any()
                    continue
                rows, cols, _, _ = window
                assert visible[rows, cols].sum() == visible.sum()  # nothing visible is cut away


def test_lengths_that_do_not_split_and_unknown_layouts_are_refused():
    with pytest.raises(ConfigError, match="multiple of 4"):
        ring_layout.local_indices(6, 2, 0, "zigzag")
    with pytest.raises(ConfigError, match="choose one of"):
        ring_layout.local_indices(8, 2, 0, "striped")


def test_zigzag_batch_sharding_shifts_labels_before_the_split():
    from twinkle_backend_hf.sequence_parallel.batch_sharding import shard_batch

    ids = torch.arange(14).view(2, 7)
    batch = {"input_ids": ids, "labels": ids + 100, "attention_mask": torch.ones_like(ids)}
    shards = [shard_batch(batch, 2, r, layout="zigzag")[0] for r in range(2)]
    assert shards[0]["input_ids"].shape == (2, 4)  # 7 tokens padded to a multiple of 2 x 2 chunks
    joined = {key: ring_layout.unshard_sequence([s[key] for s in shards], "zigzag")
              for key in ("input_ids", "shift_labels", "position_ids")}
    assert torch.equal(joined["input_ids"][:, :7], ids)
    assert torch.equal(joined["shift_labels"][:, :6], ids[:, 1:] + 100)
    assert (joined["shift_labels"][:, 6:] == -100).all()
    assert torch.equal(joined["position_ids"], torch.arange(8).expand(2, 8))


def test_strategy_refuses_unknown_ring_options():
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy

    with pytest.raises(ConfigError, match="cp_impl must be one of"):
        SequenceParallelStrategy(cp_impl="striped")
    with pytest.raises(ConfigError, match="choose one of"):
        SequenceParallelStrategy(cp_impl="ring", ring_layout="striped")
    assert SequenceParallelStrategy(cp_impl="ring").layout == "zigzag"
    assert SequenceParallelStrategy(cp_impl="ulysses", ring_layout="zigzag").layout == "contiguous"


# ---------------------------------------------------------------------- several ranks
@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 4])
def test_ring_attention_matches_full_sdpa(tmp_path, nproc):
    from distributed import run_torchrun

    result = run_torchrun([SCRIPT, str(tmp_path)], nproc=nproc, timeout=120)
    assert result.returncode == 0, result.output
    for rank in range(nproc):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # the same inputs with the causal rule, or the segments, left out: the comparisons can fail
        assert results.pop("_control_wrong_causal") > 1e-2 and results.pop("_control_no_segments") > 1e-2
        assert len(results) == 11
        too_far = {}
        for case, quantities in results.items():
            for key, stats in quantities.items():
                if "spread" in stats:  # float32/bf16: rounding bound, or 10x SDPA's own distance from float64
                    dtype = getattr(torch, stats["dtype"])
                    floor = forward_tolerance(stats["magnitude"], width=LENGTH, depth=STAGES[key] - 1, dtype=dtype)
                    tolerance = max(floor, SPREAD_FACTOR * stats["spread"])
                else:
                    tolerance = FLOAT64_TOLERANCE
                if not stats["delta"] <= tolerance:
                    too_far[f"{case}.{key}"] = (stats["delta"], tolerance)
        assert not too_far, f"rank {rank}: {too_far}"


# ---------------------------------------------------------------------- the strategy on a tiny Qwen2
PARITY_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ring_parity.py")
#: tiny_qwen2_config: 2 layers whose widest reduction is the 64-wide MLP; a gradient passes them twice
LAYERS, WIDTH = 2, 64


@pytest.fixture(scope="module")
def ring_reference_dir(tmp_path_factory):
    """The single-process results (strategy "single"), computed once for the module."""
    import subprocess
    import sys

    from twinkle_core.testing.torchrun import thread_env

    out = tmp_path_factory.mktemp("ring-reference")
    done = subprocess.run([sys.executable, PARITY_SCRIPT, "reference", str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **thread_env()})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.parametrize(("nproc", "dp"), [(2, 1), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_ring_strategy_matches_single_process(ring_reference_dir, tmp_path, nproc, dp):
    """sp=2, ``cp_impl="ring"`` (zig-zag; with dp=2 the 4-rank run): one forward_backward per case (plain,
    right-padded to a multiple of 4, packed, left-padded, one kv head, LoRA with gradient checkpointing on
    packed rows): loss and gradients; forward_only logits."""
    import shutil

    from distributed import run_torchrun

    shutil.copy(ring_reference_dir / "reference.pt", tmp_path / "reference.pt")
    result = run_torchrun([PARITY_SCRIPT, "ring", str(tmp_path), str(dp)], nproc=nproc, timeout=300)
    assert result.returncode == 0, result.output
    for rank in range(nproc):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results.pop("_attn_implementation") == "twinkle_ring"
        assert results.pop("_control_packed_without_segments") > 1e-3, "the parity checks cannot tell a wrong mask"
        logits = results.pop("eval_packed")
        assert logits["logits_delta"] <= forward_tolerance(logits["logits_magnitude"], width=WIDTH, depth=LAYERS)
        assert len(results) == 6
        for case, stats in results.items():
            loss_tolerance = forward_tolerance(stats["reference_loss"], width=WIDTH, depth=LAYERS)
            assert abs(stats["loss"] - stats["reference_loss"]) <= loss_tolerance, (case, stats)
            grad_tolerance = forward_tolerance(stats["grad_magnitude"], width=WIDTH, depth=2 * LAYERS)
            assert stats["grad_delta"] <= grad_tolerance, (case, stats, grad_tolerance)
