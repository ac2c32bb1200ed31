"""A training loop written for ``TransformersModel`` runs unchanged with ``MegatronModel``.

    python examples/same_loop_both_backends.py                       # one process
    torchrun --nproc-per-node 2 examples/same_loop_both_backends.py --tp 2

The loop below only uses the ``TwinkleModel`` API: nothing in it knows which backend it drives.
Both backends start from the same Hugging Face weights and print the same losses.
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any


def train(model: Any, batches: list[dict[str, Any]], *, lr: float = 1e-2) -> list[float]:
    """The user's loop: optimizer and schedule by name, micro-batch accumulation, clipping, metrics, a save."""
    model.set_optimizer("AdamW", lr=lr, weight_decay=0.01, gradient_accumulation_steps=2)
    model.set_lr_scheduler("cosine", num_training_steps=len(batches) // 2, num_warmup_steps=1)
    model.add_metric("accuracy")
    losses = []
    for batch in batches:
        model.forward_backward(inputs=batch)
        if model.clip_grad_and_step(max_grad_norm=1.0) is not None:
            losses.append(model.calculate_metric()["loss"])
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    args = parser.parse_args()

    from twinkle_backend_megatron.model import MegatronModel
    from twinkle_backend_megatron.testing import tiny_qwen2_config

    from twinkle_core import distributed
    from twinkle_core.testing.conformance import make_batch

    batches = [make_batch(i, rows=4) for i in range(8)]
    model = MegatronModel(config=tiny_qwen2_config(), seed=0, mesh={"tp": args.tp, "pp": args.pp})
    megatron_losses = train(model, batches)
    with tempfile.TemporaryDirectory() as out:
        path = model.save("final", output_dir=out, save_optimizer=False)
        if distributed.is_main_process():
            print(f"saved a Hugging Face checkpoint to {path}")
    if distributed.world_size() == 1:
        from twinkle_backend_hf.model import TransformersModel

        hf_losses = train(TransformersModel(config=tiny_qwen2_config(), seed=0), batches)
        for step, (a, b) in enumerate(zip(hf_losses, megatron_losses)):
            print(f"step {step}: transformers {a:.6f}  megatron {b:.6f}  |diff| {abs(a - b):.2e}")
    elif distributed.is_main_process():
        print("megatron losses:", [round(x, 6) for x in megatron_losses])


if __name__ == "__main__":
    main()
