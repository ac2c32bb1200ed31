"""Ring attention with the NPU block kernel against the plain ring, one rank of a torchrun job on the fake torch_npu.

    torchrun --nproc-per-node R ring_block_on_fake_npu.py OUT_DIR

Every rank builds the same whole-sequence inputs (seeded) and runs the ring on its shard twice: plain blocks, and
full/causal blocks through :func:`twinkle_backend_npu.kernels.ring_block.block_attention` (the fake
``npu_fusion_attention``). It writes ``OUT_DIR/rank{R}.json``: per case and quantity (``out``, ``dq``, ``dk``,
``dv``) the largest ``|kernel - plain|``, the largest ``|plain|`` and the dtype; per case the ``causal`` flags the
kernel was called with, in order. ``model``: the same through ``apply_kernels`` on a tiny Llama on the ``npu``
accelerator and the transformers attention function (the kernel found on the layer). ``_control_wrong_lse``: the
kernel with ``lse = softmax_max`` (the sum left out), which must be far off, so the comparison can fail.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from twinkle_backend_hf.sequence_parallel import ring_attention as ring
from twinkle_backend_hf.sequence_parallel.ring_blocks import block_attention_of, use_block_attention
from twinkle_backend_hf.sequence_parallel.ring_layout import shard_sequence
from twinkle_backend_npu.kernels import ring_block
from twinkle_backend_npu.testing.fake_torch_npu import FakeTorchNPU, install

from twinkle_core.testing.torchrun import exit_job

BATCH, LENGTH, HEAD_DIM = 2, 24, 8  # 24 tokens split into 2R chunks for R = 2 and R = 4
#: name: (causal, layout, packed, query heads, key/value heads, dtype)
CASES = {
    "causal_zigzag_gqa": (True, "zigzag", False, 4, 2, torch.float32),
    "causal_contiguous": (True, "contiguous", False, 4, 4, torch.float32),
    "full_zigzag": (False, "zigzag", False, 4, 4, torch.float32),
    "causal_zigzag_float64": (True, "zigzag", False, 4, 2, torch.float64),
    "causal_zigzag_packed": (True, "zigzag", True, 4, 2, torch.float32),  # masked blocks: no kernel call
}
SEGMENTS = ((5, 11, 8), (3, 21))


class Counted:
    """The block kernel, recording the ``causal`` flag of every call."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __call__(self, q, k, v, *, scale, causal):
        self.calls.append(causal)
        return self.kernel(q, k, v, scale=scale, causal=causal)


def wrong_lse(q, k, v, *, scale, causal):
    import torch_npu

    out, softmax_max = torch_npu.npu_fusion_attention(q.contiguous(), k.contiguous(), v.contiguous(), q.shape[1],
                                                      "BNSD", scale=scale, sparse_mode=0)[:2]
    return out, softmax_max[..., 0]  # the log of softmax_sum left out


def segment_ids() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                        for lengths in SEGMENTS])


def run(inputs, causal, layout, segments, kernel, size, rank):
    q, k, v, dout = (shard_sequence(t, size, rank, layout, dim=2) for t in inputs)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    local = None if segments is None else shard_sequence(segments, size, rank, layout, dim=1)
    out = ring.ring_attention(q, k, v, group=None, causal=causal, layout=layout, segment_ids=local,
                              block_attention=kernel)
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def compare(got, want, dtype) -> dict:
    return {key: {"delta": float((got[key].double() - want[key].double()).abs().max()),
                  "magnitude": float(want[key].double().abs().max()), "dtype": str(dtype).removeprefix("torch.")}
            for key in want}


def through_the_model(size, rank) -> dict:
    """apply_kernels on the npu accelerator attaches the kernel; the ring's attention function finds it."""
    import transformers

    from twinkle_core.kernels import apply_kernels
    from twinkle_core.plugins import TwinklePlugins, reset_plugins

    reset_plugins(TwinklePlugins(extra_modules=["twinkle_backend_npu.plugin"]))
    config = transformers.AutoConfig.for_model("llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    network = transformers.AutoModelForCausalLM.from_config(config)
    counts = apply_kernels(network, "npu").counts
    layer = network.model.layers[0].self_attn
    counted = Counted(block_attention_of(layer))
    use_block_attention(layer, counted)  # count what the attention function calls through the layer
    ring.set_ring_group(dist.new_group(list(range(size))), "zigzag")
    g = torch.Generator().manual_seed(7)
    q, k, v = (shard_sequence(torch.randn(1, h, LENGTH, HEAD_DIM, generator=g), size, rank, "zigzag", dim=2)
               for h in (4, 2, 2))
    ring.ring_attention_forward(layer, q, k, v, None)
    ring.set_ring_group(None, "zigzag")
    return {"sites": counts.get("npu_ring_block_attention", 0), "calls": counted.calls}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    size, rank = dist.get_world_size(), dist.get_rank()
    results: dict[str, object] = {}
    for index, (name, (causal, layout, packed, heads, kv_heads, dtype)) in enumerate(CASES.items()):
        g = torch.Generator().manual_seed(index)
        inputs = [torch.randn(BATCH, n, LENGTH, HEAD_DIM, generator=g, dtype=torch.float64).to(dtype)
                  for n in (heads, kv_heads, kv_heads, heads)]
        segments = segment_ids() if packed else None
        plain = run(inputs, causal, layout, segments, None, size, rank)
        kernel = Counted(ring_block.block_attention)
        fused = run(inputs, causal, layout, segments, kernel, size, rank)
        results[name] = {"quantities": compare(fused, plain, dtype), "calls": kernel.calls}
        if name == "full_zigzag":
            wrong = run(inputs, causal, layout, segments, wrong_lse, size, rank)
            results["_control_wrong_lse"] = max(stats["delta"] for stats in compare(wrong, plain, dtype).values())
    results["model"] = through_the_model(size, rank)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    exit_job(0)


if __name__ == "__main__":
    install(FakeTorchNPU(device_count=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))  # for this whole rank
    main(sys.argv[1])
