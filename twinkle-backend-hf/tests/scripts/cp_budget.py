"""A sequence too long for a per-rank memory budget in one process trains under ring context parallelism (cp=4).

    python cp_budget.py single OUT_DIR                      # strategy "single"
    torchrun --nproc-per-node 4 cp_budget.py cp OUT_DIR     # strategy "ulysses", mesh cp=4 (pure ring)

One ``forward_backward`` of a tiny Qwen2 (fp32) on one row of ``LENGTH`` tokens; measured: the bytes autograd keeps
for the backward pass (every saved tensor that does not share a parameter's storage: the activations and logits,
the part of the memory that grows with the sequence) and the loss. Writes ``OUT_DIR/{single,rank{R}}.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from sp_parity import VOCAB, lm_batch, make_model  # noqa: E402

from twinkle_core.testing.torchrun import exit_job  # noqa: E402

LENGTH = 512


def saved_bytes_of_one_step(model) -> tuple[int, float]:
    parameters = {p.untyped_storage().data_ptr() for p in model.module.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.set_optimizer("SGD", lr=0.1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.forward_backward(inputs=lm_batch(7, rows=1, length=LENGTH))
    return sum(saved.values()), model.calculate_metric()["loss"]


def main(mode: str, out_dir: str) -> None:
    if mode == "single":
        saved, loss = saved_bytes_of_one_step(make_model("single"))
        name = "single"
    else:
        from twinkle_backend_hf.sequence_parallel.strategy import SequenceParallelStrategy

        from twinkle_core.mesh import DeviceMesh

        saved, loss = saved_bytes_of_one_step(make_model(SequenceParallelStrategy(mesh=DeviceMesh(cp=4))))
        name = f"rank{os.environ['RANK']}"
    with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
        json.dump({"saved_bytes": saved, "loss": loss, "vocab": VOCAB}, fh)
    if mode != "single":
        exit_job(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
