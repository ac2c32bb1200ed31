"""The vision-language training run both backends execute in the VLM parity tests (the same code on either).

The ``vlm`` task on a tiny Qwen2.5-VL with vision frozen and projector + language trained in full (the default plan
with its language part ``full``: LoRA on a vision-language MegatronModel is refused), AdamW with clipping, the
whole batch of coloured-square chats every step; per-step loss and pre-clip grad norm, and the final logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

STEPS = 3
#: vision frozen, projector full (the vlm task's defaults), language full
TASK_OPTIONS = {"train_language": "full"}
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "white": (250, 250, 250)}


def colour_rows(directory: Path) -> list[dict[str, Any]]:
    """One chat row per colour: a square image of its own size and its colour as the answer (padded batch)."""
    from PIL import Image

    rows = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        path = directory / f"{name}.png"
        Image.new("RGB", (28 + 8 * i, 30 + 4 * i), rgb).save(path)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": str(path)},
                                         {"type": "text", "text": "What colour is this?"}]},
            {"role": "assistant", "content": name}]})
    return rows


def megatron_vlm(model_dir: str, *, mesh: dict[str, int] | None = None, task_options: dict[str, Any] | None = None,
                 **options: Any) -> tuple[Any, Any]:
    """``(MegatronModel, VLMTask)`` on ``model_dir``, prepared as the trainer prepares them."""
    from twinkle_backend_megatron.model import MegatronModel
    from twinkle_vlm.task import VLMTask

    task = VLMTask(**(task_options or TASK_OPTIONS))
    model = MegatronModel(model_id=model_dir, task=task, tokenizer=MegatronModel.load_tokenizer(model_dir),
                          mesh=mesh, **options)
    task.prepare_model(model)
    return model, task


def run(model: Any, task: Any, rows: list[dict[str, Any]], *, steps: int = STEPS,
        reverse_rows: bool = False) -> dict[str, Any]:
    """``steps`` AdamW steps on the batch of ``rows``; ``reverse_rows``: the same run with the rows reversed
    (the reference's own float spread, ``twinkle_core.testing.tolerance``). Logits: the padding zeroed, rows in
    the order of ``rows``."""
    from twinkle_vlm.testing import vlm_batch

    batch = vlm_batch(task, model, rows[::-1] if reverse_rows else rows)
    model.set_loss("cross_entropy")
    model.set_optimizer("AdamW", lr=1e-2)
    losses, norms = [], []
    for _ in range(steps):
        model.forward_backward(inputs=batch)
        norms.append(float(model.clip_grad_and_step(max_grad_norm=1.0)))
        losses.append(float(model.calculate_metric()["loss"]))
    logits = model.forward_only(inputs=batch)["logits"].detach().double()
    logits = logits * batch["attention_mask"][..., None]
    if reverse_rows:
        logits = logits.flip(0)
    return {"losses": losses, "norms": norms, "logits": logits.tolist()}
