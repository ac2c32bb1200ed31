"""The training run both backends execute in the parity tests (the same code on either)."""

from __future__ import annotations

from typing import Any

STEPS = 10


def run(model: Any, *, steps: int = STEPS, adapter_name: str | None = None, lr: float = 1e-2,
        reverse_rows: bool = False, length: int | None = None) -> dict[str, Any]:
    """``steps`` AdamW steps with a cosine schedule and clipping; per-step loss and pre-clip grad norm.

    ``reverse_rows`` trains on every batch with its rows reversed: the same mathematics in another
    summation order, which gives the reference's own float spread (``twinkle_core.testing.tolerance``).
    ``length`` cuts every batch to its first ``length`` positions."""
    from twinkle_core.testing.conformance import local_rows, make_batch

    kw = {"adapter_name": adapter_name} if adapter_name else {}
    model.set_optimizer("AdamW", lr=lr, **kw)
    model.set_lr_scheduler("cosine", num_training_steps=steps, num_warmup_steps=1, **kw)
    losses, norms = [], []
    for step in range(steps):
        batch = {key: value[:, :length] for key, value in make_batch(100 + step).items()}
        if reverse_rows:
            batch = {key: value.flip(0) for key, value in batch.items()}
        model.forward_backward(inputs=local_rows(model, batch), **kw)
        norms.append(model.clip_grad_and_step(max_grad_norm=1.0, **kw))
        losses.append(model.calculate_metric(**kw)["loss"])
    logits = model.forward_only(inputs={k: v[:, :length] for k, v in make_batch(99).items()}, **kw)["logits"]
    return {"losses": losses, "norms": norms, "logits": logits.detach().double().tolist()}
