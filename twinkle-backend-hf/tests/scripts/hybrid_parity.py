"""Hybrid context parallelism (Ulysses inside a group x ring across groups) vs. one process, tiny Qwen2 (fp32, gloo).

    python hybrid_parity.py reference OUT_DIR                      # strategy "single", one process
    torchrun --nproc-per-node 4 hybrid_parity.py hybrid OUT_DIR 2 2  # mesh cp=2 x sp=2
    torchrun --nproc-per-node 2 hybrid_parity.py hybrid OUT_DIR 2 1  # mesh cp=2 alone: pure ring

One ``forward_backward`` per case: unpacked rows with full fine-tuning, packed rows with LoRA and gradient
checkpointing. ``hybrid`` reads ``OUT_DIR/reference.pt`` and writes ``OUT_DIR/rank{R}.json`` like
``ring_parity.py`` (loss, largest gradient difference, the ``forward_only`` logits of the packed batch, which
are gathered over the ``cp * sp`` ranks) plus ``_control_packed_without_segments``: the packed case with its
segment boundaries ignored, a delta that must be large.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from ring_parity import one_step  # noqa: E402
from sp_parity import lm_batch, make_model, max_delta, packed_batch  # noqa: E402

from twinkle_core.testing.torchrun import exit_job  # noqa: E402

#: name: (batch, config overrides, LoRA + gradient checkpointing?)
CASES = {
    "lm_full": (lm_batch(100), {}, False),
    "packed_lora_checkpointing": (packed_batch(13), {}, True),
}


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

    mesh = DeviceMesh(cp=int(sys.argv[3]), sp=int(sys.argv[4]))
    saved = torch.load(os.path.join(out_dir, "reference.pt"), weights_only=False)
    results: dict[str, object] = {}
    for name, (batch, overrides, lora) in CASES.items():
        ref_loss, ref_grads = saved[name]
        loss, got, model = one_step(SequenceParallelStrategy(mesh=mesh), batch, overrides, lora)
        results[name] = {"loss": loss, "reference_loss": ref_loss, "grad_delta": max_delta(got, ref_grads),
                         "grad_magnitude": max(float(g.abs().max()) for g in ref_grads.values())}
        results["_attn_implementation"] = model.hf_model.config._attn_implementation
    logits = make_model(SequenceParallelStrategy(mesh=mesh)).forward_only(inputs=packed_batch(8))["logits"]
    results["eval_packed"] = {"logits_delta": max_delta(logits, saved["eval_packed"]),
                              "logits_magnitude": float(saved["eval_packed"].abs().max())}
    # negative control: the packed case with its segment boundaries ignored must NOT match the reference
    original = ring_attention.sequence_ids
    ring_attention.sequence_ids = lambda positions: None
    try:
        _, wrong, _ = one_step(SequenceParallelStrategy(mesh=mesh), *CASES["packed_lora_checkpointing"])
        results["_control_packed_without_segments"] = max_delta(wrong, saved["packed_lora_checkpointing"][1])
    finally:
        ring_attention.sequence_ids = original
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    exit_job(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
