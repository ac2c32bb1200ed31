"""Hybrid context parallelism (strategy ``ulysses`` with ``mesh.cp`` beside ``mesh.sp``): Ulysses inside a group x
ring attention across groups. The nested layout in one process, the refused combinations, and the parity of one
training step of a tiny Qwen2 against one process under torchrun (gloo): sp=2 x cp=2 (4 ranks) and cp=2 alone
(pure ring, 2 ranks). The compared cases are listed in ``scripts/hybrid_parity.py``."""

from __future__ import annotations

import json
import os

import pytest
import torch
from twinkle_backend_hf.sequence_parallel import ring_layout

from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh
from twinkle_core.testing.tolerance import forward_tolerance

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "hybrid_parity.py")
#: tiny_qwen2_config: 2 layers whose widest reduction is the 64-wide MLP; a gradient passes them twice
LAYERS, WIDTH = 2, 64


# ---------------------------------------------------------------------- layout
def test_nested_layout_is_zigzag_over_the_ring_and_contiguous_inside():
    # 16 tokens, cp=2 x sp=2: zig-zag chunks of 4, ring rank 0 owns chunks 0 and 3, ring rank 1 chunks 1 and 2
    shares = [ring_layout.nested_indices(16, 4, 2, rank, "zigzag").tolist() for rank in range(4)]
    assert shares == [[0, 1, 2, 3], [12, 13, 14, 15], [4, 5, 6, 7], [8, 9, 10, 11]]
    # what Ulysses' all-to-all gathers over the sp ranks of a ring rank is that ring rank's zig-zag share
    for ring_rank in range(2):
        gathered = shares[2 * ring_rank] + shares[2 * ring_rank + 1]
        assert gathered == ring_layout.local_indices(16, 2, ring_rank, "zigzag").tolist()


@pytest.mark.parametrize(("world", "ring"), [(4, 2), (4, 4), (4, 1), (6, 3)])
def test_nested_shards_reassemble_into_the_sequence(world, ring):
    x = torch.arange(3 * ring_layout.nested_multiple(world, ring, "zigzag")).view(1, -1)
    shards = [x[:, ring_layout.nested_indices(x.shape[1], world, ring, r, "zigzag")] for r in range(world)]
    assert torch.equal(ring_layout.unshard_nested(shards, ring, "zigzag"), x)


def test_hybrid_batch_sharding_pads_to_the_nested_multiple():
    from twinkle_backend_hf.sequence_parallel.batch_sharding import shard_batch

    ids = torch.arange(13).view(1, 13)
    shards = [shard_batch({"input_ids": ids, "labels": ids + 100}, 4, r, layout="zigzag", ring_size=2)[0]
              for r in range(4)]
    assert shards[0]["input_ids"].shape == (1, 4)  # 13 tokens padded to a multiple of 2 cp x 2 chunks x 2 sp
    joined = {key: ring_layout.unshard_nested([s[key] for s in shards], 2, "zigzag")
              for key in ("input_ids", "shift_labels", "position_ids")}
    assert torch.equal(joined["input_ids"][:, :13], ids)
    assert torch.equal(joined["shift_labels"][:, :12], ids[:, 1:] + 100)
    assert torch.equal(joined["position_ids"], torch.arange(16).view(1, 16))  # global positions for RoPE


# ---------------------------------------------------------------------- configuration
def test_mesh_cp_alone_is_the_ring_and_cp_with_sp_the_hybrid():
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy

    assert SequenceParallelStrategy.split_sizes(DeviceMesh(cp=4), "ulysses") == (4, 1)
    assert SequenceParallelStrategy.split_sizes(DeviceMesh(sp=4), "ring") == (4, 1)  # the same ring
    assert SequenceParallelStrategy.split_sizes(DeviceMesh(cp=2, sp=2), "ulysses") == (2, 2)
    assert SequenceParallelStrategy(mesh=DeviceMesh(cp=2, sp=2)).layout == "zigzag"
    with pytest.raises(ConfigError, match="leave cp_impl at 'ulysses'"):
        SequenceParallelStrategy(mesh=DeviceMesh(cp=2, sp=2), cp_impl="ring")


def test_impossible_hybrids_are_refused_before_anything_runs():
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy
    from twinkle_backend_hf.testing import make_tiny_model

    model = make_tiny_model(attn_implementation="sdpa").hf_model  # 4 attention heads, 2 key/value heads
    strategy = SequenceParallelStrategy(mesh=DeviceMesh(cp=2, sp=8))  # sp > heads: 4 heads cannot split over 8
    with pytest.raises(ConfigError, match="cannot split 4 attention heads"):
        strategy.wrap_module(model)
    strategy = SequenceParallelStrategy(mesh=DeviceMesh(cp=2, sp=2), inner_attn_implementation="sdpa")
    with pytest.raises(ConfigError, match="inner_attn_implementation does not apply"):
        strategy.wrap_module(model)


# ---------------------------------------------------------------------- several ranks
@pytest.fixture(scope="module")
def hybrid_reference_dir(tmp_path_factory):
    """The single-process results (strategy "single"), computed once for the module."""
    import subprocess
    import sys

    from twinkle_core.testing.torchrun import thread_env

    out = tmp_path_factory.mktemp("hybrid-reference")
    done = subprocess.run([sys.executable, SCRIPT, "reference", str(out)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **thread_env()})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


@pytest.mark.parity
@pytest.mark.distributed
@pytest.mark.parametrize(("cp", "sp", "attention"), [(2, 2, "twinkle_ulysses_twinkle_ring"),
                                                     pytest.param(2, 1, "twinkle_ring", marks=pytest.mark.slow)])
def test_hybrid_matches_single_process(hybrid_reference_dir, tmp_path, cp, sp, attention):
    """One forward_backward of unpacked rows (full fine-tuning) and of packed rows (LoRA, gradient checkpointing):
    loss and gradients; forward_only logits gathered over the cp x sp ranks; a control that ignores the packed
    segments must miss. cp=2 alone is pure ring (``slow``: ``test_ring_attention`` covers the same ring via
    ``cp_impl: ring``)."""
    import shutil

    from distributed import run_torchrun

    shutil.copy(hybrid_reference_dir / "reference.pt", tmp_path / "reference.pt")
    result = run_torchrun([SCRIPT, "hybrid", str(tmp_path), str(cp), str(sp)], nproc=cp * sp, timeout=120)
    assert result.returncode == 0, result.output
    for rank in range(cp * sp):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results.pop("_attn_implementation") == attention
        assert results.pop("_control_packed_without_segments") > 1e-3, "the parity checks cannot tell a wrong mask"
        logits = results.pop("eval_packed")
        assert logits["logits_delta"] <= forward_tolerance(logits["logits_magnitude"], width=WIDTH, depth=LAYERS)
        assert sorted(results) == ["lm_full", "packed_lora_checkpointing"]
        for case, stats in results.items():
            loss_tolerance = forward_tolerance(stats["reference_loss"], width=WIDTH, depth=LAYERS)
            assert abs(stats["loss"] - stats["reference_loss"]) <= loss_tolerance, (case, stats)
            grad_tolerance = forward_tolerance(stats["grad_magnitude"], width=WIDTH, depth=2 * LAYERS)
            assert stats["grad_delta"] <= grad_tolerance, (case, stats, grad_tolerance)


BUDGET_SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "cp_budget.py")
#: the per-rank budget for what grows with the sequence (activations and logits kept for backward)
BUDGET_BYTES = 2 ** 20


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sequence_over_the_per_rank_budget_trains_under_cp4(tmp_path):
    """512 tokens of a tiny Qwen2 keep ~2.6 MB for backward in one process, over a 1 MiB per-rank budget; under
    cp=4 every rank keeps under it (measured ~0.7 MB) and the step's loss is the single process's. The memory
    model (:mod:`twinkle_core.memory_model`) draws the same line. ``slow``: a 4-process job of ~20-40 s."""
    import subprocess
    import sys

    from distributed import run_torchrun
    from twinkle_backend_hf.testing import tiny_qwen2_config

    from twinkle_core.memory_model import ModelShape, estimate_memory
    from twinkle_core.testing.torchrun import thread_env

    done = subprocess.run([sys.executable, BUDGET_SCRIPT, "single", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **thread_env()})
    assert done.returncode == 0, done.stdout + done.stderr
    result = run_torchrun([BUDGET_SCRIPT, "cp", str(tmp_path)], nproc=4, timeout=120)
    assert result.returncode == 0, result.output
    single = json.loads((tmp_path / "single.json").read_text())
    assert single["saved_bytes"] > BUDGET_BYTES
    for rank in range(4):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["saved_bytes"] <= BUDGET_BYTES, (rank, got)
        assert abs(got["loss"] - single["loss"]) <= forward_tolerance(single["loss"], width=WIDTH, depth=LAYERS)
    shape = ModelShape.from_config(tiny_qwen2_config(vocab_size=single["vocab"]))

    def estimate(cp):
        e = estimate_memory(shape, rows=1, seq_len=512, mesh=DeviceMesh(cp=cp), precision="no")
        return e.activations + e.logits

    assert estimate(1) > BUDGET_BYTES >= estimate(4)
