"""Ring attention's full and causal blocks as npu_fusion_attention (``npu_ring_block_attention``), on the fake
torch_npu: one block equals the ring's plain block (output and log-sum-exp), the kernel is attached on the npu
accelerator only, and under torchrun (gloo, 2 ranks) the ring with the kernel gives the plain ring's outputs and
gradients, calling the kernel for exactly the full and causal blocks (packed rows keep the plain blocks).

Tolerance: both sides compute the same float32 (or float64) quantities with their sums in another order (the fake op
normalises with softmax, the plain block with ``exp(s - lse)``), so they agree within
:func:`~twinkle_core.testing.tolerance.forward_tolerance` over the rounding stages before each quantity: scores (a
HEAD_DIM-term sum) and the probability-weighted sum over at most LENGTH keys for the output; the backward, which
recomputes the probabilities from the merged log-sum-exp, adds one more.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from twinkle_backend_hf.sequence_parallel.ring_blocks import block_attention_of, plain_block_attention
from twinkle_backend_npu.kernels import ring_block
from twinkle_backend_npu.testing import install_fake_torch_npu

from twinkle_core.kernels import apply_kernels
from twinkle_core.plugins import TwinklePlugins, reset_plugins
from twinkle_core.testing.tolerance import forward_tolerance

SCRIPT = os.path.join(os.path.dirname(__file__), "ring_block_on_fake_npu.py")
LENGTH = 24  # as in the script
#: rounding stages before each compared quantity (see the module docstring)
STAGES = {"out": 2, "lse": 1, "dq": 3, "dk": 3, "dv": 3}
#: the ``causal`` flag of each kernel call on ranks 0 and 1 of 2: zig-zag computes the causal diagonal block, then
#: the one chunk pair of the other rank's block that is wholly visible; contiguous rank 0 skips the future block
EXPECTED_CALLS = {
    "causal_zigzag_gqa": [[True, False], [True, False]],
    "causal_contiguous": [[True], [True, False]],
    "full_zigzag": [[False, False], [False, False]],
    "causal_zigzag_float64": [[True, False], [True, False]],
    "causal_zigzag_packed": [[], []],
}


@pytest.fixture
def npu():
    reset_plugins(TwinklePlugins(extra_modules=["twinkle_backend_npu.plugin"]))
    with install_fake_torch_npu():
        yield
    reset_plugins()


def close(what: str, got: torch.Tensor, want: torch.Tensor, stages: int, width: int) -> None:
    tolerance = forward_tolerance(float(want.abs().max()), width=width, depth=stages - 1, dtype=want.dtype)
    delta = float((got - want).abs().max())
    assert delta <= tolerance, f"{what}: max |kernel - plain| = {delta:.3g} > {tolerance:.3g}"


@pytest.mark.parametrize("causal", [True, False])
def test_one_block_equals_the_plain_block(npu, causal):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 12, 8, generator=g)
    k, v = torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)  # grouped-query
    mask = torch.ones(12, 12, dtype=torch.bool).tril() if causal else None
    want_out, want_lse = plain_block_attention(q, k, v, scale=0.3, mask=mask)
    out, lse = ring_block.block_attention(q, k, v, scale=0.3, causal=causal)
    assert lse.dtype == torch.float32 and lse.shape == want_lse.shape
    close("out", out, want_out, STAGES["out"], 12)
    close("lse", lse, want_lse, STAGES["lse"], 12)


def test_attached_to_every_attention_layer_on_the_npu_accelerator_only(npu):
    import transformers

    config = transformers.AutoConfig.for_model("llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

    def layers(accelerator, switch=None):
        network = transformers.AutoModelForCausalLM.from_config(config)
        counts = apply_kernels(network, accelerator, switch).counts
        return counts.get("npu_ring_block_attention", 0), [block_attention_of(m.self_attn) for m in network.model.layers]

    assert layers("npu") == (2, [ring_block.block_attention] * 2)
    assert layers("npu", {"npu_ring_block_attention": False}) == (0, [None, None])
    assert layers("cpu") == (0, [None, None])


@pytest.mark.parity
@pytest.mark.distributed
def test_ring_with_the_kernel_equals_the_plain_ring(tmp_path):
    from twinkle_core.testing.torchrun import run_torchrun

    result = run_torchrun([SCRIPT, str(tmp_path)], nproc=2, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results.pop("_control_wrong_lse") > 1e-2  # a wrong log-sum-exp shows: the comparison can fail
        # through apply_kernels and the transformers attention function: found on the layer and called
        assert results.pop("model") == {"sites": 1, "calls": [True, False]}
        assert {case: entry["calls"] for case, entry in results.items()} == {
            case: calls[rank] for case, calls in EXPECTED_CALLS.items()}
        for case, entry in results.items():
            for key, stats in entry["quantities"].items():
                dtype = getattr(torch, stats["dtype"])
                tolerance = forward_tolerance(stats["magnitude"], width=LENGTH, depth=STAGES[key] - 1, dtype=dtype)
                assert stats["delta"] <= tolerance, f"rank {rank} {case}.{key}: {stats['delta']:.3g} > {tolerance:.3g}"
