"""Ring context parallelism (strategy ``ulysses`` with ``cp_impl="ring"``) vs. one process, tiny Qwen2 (fp32, gloo).

    python ring_parity.py reference OUT_DIR                    # strategy "single", one process
    torchrun --nproc-per-node 2 ring_parity.py ring OUT_DIR    # mesh sp=2, zig-zag layout
    torchrun --nproc-per-node 4 ring_parity.py ring OUT_DIR 2  # mesh dp=2 x sp=2

One ``forward_backward`` per case. ``reference`` writes ``OUT_DIR/reference.pt``; ``ring`` reads it and
writes ``OUT_DIR/rank{R}.json``: per case the loss (the model's loss metric) and the reference's, the
largest ``|grad|`` difference and the reference's largest ``|grad|`` (for the tolerance), and the same
for the ``forward_only`` logits of a packed batch; ``_control_*``: a delta that must be large (the packed
case with its segment boundaries ignored), so the comparison is known to be able to fail. Batches come
from ``sp_parity.py``.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from sp_parity import (  # noqa: E402
    grads,
    left_padded_batch,
    lm_batch,
    make_model,
    max_delta,
    packed_batch,
    right_padded_batch,
)

from twinkle_core.testing.conformance import LORA_CONFIG  # noqa: E402
from twinkle_core.testing.torchrun import exit_job  # noqa: E402

#: name: (batch, config overrides, LoRA + gradient checkpointing?)
CASES = {
    "lm": (lm_batch(100), {}, False),
    "right_padded": (right_padded_batch(7), {}, False),  # 15 tokens: padded to a multiple of 2 sp
    "packed": (packed_batch(8), {}, False),
    "left_padded": (left_padded_batch(9), {}, False),  # pads isolated through their positions
    "single_kv_head": (lm_batch(10), {"num_key_value_heads": 1}, False),
    "lora_checkpointing_packed": (packed_batch(13), {}, True),
}


def all_rows(model, batch):
    return batch


def one_step(strategy, batch, overrides, lora, rows=all_rows) -> tuple[float, dict[str, torch.Tensor], object]:
    model = make_model(strategy, {"gradient_checkpointing": True} if lora else None, **overrides)
    if lora:
        model.add_adapter_to_model("sft", LORA_CONFIG)
    model.set_optimizer("SGD", lr=0.1)
    model.forward_backward(inputs=rows(model, batch))
    model.clip_grad_norm(math.inf)
    return model.calculate_metric()["loss"], grads(model), model


def main(mode: str, out_dir: str) -> None:
    torch.use_deterministic_algorithms(True)
    if mode == "reference":
        saved = {name: one_step("single", *case)[:2] for name, case in CASES.items()}
        saved["eval_packed"] = make_model("single").forward_only(inputs=packed_batch(8))["logits"]
        torch.save(saved, os.path.join(out_dir, "reference.pt"))
        return

    from twinkle_backend_hf.sequence_parallel import ring_attention
    from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy

    from twinkle_core.mesh import DeviceMesh
    from twinkle_core.testing.conformance_data import local_rows

    dp = int(sys.argv[3]) if len(sys.argv) > 3 else 1  # optional data-parallel size (world = dp * sp)
    mesh = DeviceMesh(dp=dp, sp=int(os.environ["WORLD_SIZE"]) // dp)
    saved = torch.load(os.path.join(out_dir, "reference.pt"), weights_only=False)
    results: dict[str, object] = {}
    for name, (batch, overrides, lora) in CASES.items():
        ref_loss, ref_grads = saved[name]
        loss, ring_grads, model = one_step(SequenceParallelStrategy(mesh=mesh, cp_impl="ring"), batch, overrides,
                                           lora, local_rows)
        results[name] = {"loss": loss, "reference_loss": ref_loss, "grad_delta": max_delta(ring_grads, ref_grads),
                         "grad_magnitude": max(float(g.abs().max()) for g in ref_grads.values())}
        results["_attn_implementation"] = model.hf_model.config._attn_implementation
    # forward_only gathers the zig-zag shards back into sequence order
    model = make_model(SequenceParallelStrategy(mesh=mesh, cp_impl="ring"))
    logits = model.forward_only(inputs=local_rows(model, packed_batch(8)))["logits"]
    share = saved["eval_packed"].shape[0] // dp
    dp_rank = int(os.environ["RANK"]) // mesh.sp
    reference = saved["eval_packed"][dp_rank * share: (dp_rank + 1) * share]
    results["eval_packed"] = {"logits_delta": max_delta(logits, reference),
                              "logits_magnitude": float(reference.abs().max())}
    # negative control: the packed case with its segment boundaries ignored must NOT match the reference
    original = ring_attention.sequence_ids
    ring_attention.sequence_ids = lambda positions: None
    try:
        strategy = SequenceParallelStrategy(mesh=mesh, cp_impl="ring")
        _, wrong, _ = one_step(strategy, *CASES["packed"], local_rows)
        results["_control_packed_without_segments"] = max_delta(wrong, saved["packed"][1])
    finally:
        ring_attention.sequence_ids = original
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    exit_job(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
