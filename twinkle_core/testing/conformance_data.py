"""What the conformance suites share: the tiny model's bounds, the adapter config, random batches and the
helpers that compare weights and logits. Every suite module (``conformance``, ``conformance_generation``,
``conformance_tasks``) imports from here, so none imports another.
"""

from __future__ import annotations

from typing import Any

from twinkle_core.constants import IGNORE_INDEX

CONFORMANCE_VOCAB_SIZE = 64
LORA_CONFIG: dict[str, Any] = {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
CONFORMANCE_MAX_WIDTH = 128
CONFORMANCE_MAX_DEPTH = 4


def make_batch(seed: int, rows: int = 8, length: int = 12, vocab: int = CONFORMANCE_VOCAB_SIZE) -> dict[str, Any]:
    """Random token rows whose labels mask a prompt of varying length (so token counts differ per row)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = input_ids.clone()
    prompt = torch.randint(1, length - 2, (rows,), generator=g)
    for i in range(rows):
        labels[i, : int(prompt[i])] = IGNORE_INDEX
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def rows(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    return {k: v[start:stop] for k, v in batch.items()}


def local_rows(model: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """This data-parallel rank's share of a global batch."""
    cfg = model.get_train_configs()
    n = batch["input_ids"].shape[0] // cfg["dp_size"]
    return rows(batch, cfg["dp_rank"] * n, (cfg["dp_rank"] + 1) * n)


def assert_state_equal(a: dict[str, Any], b: dict[str, Any], atol: float = 0.0) -> None:
    import torch

    assert a.keys() == b.keys()
    for key in a:
        if atol == 0.0:
            assert torch.equal(a[key].cpu(), b[key].cpu()), key
        else:
            torch.testing.assert_close(a[key].cpu(), b[key].cpu(), atol=atol, rtol=0, msg=key)


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def forward_tolerance_of(logits: Any) -> float:
    """Two code paths of one forward with the same weights (see :mod:`twinkle_core.testing.tolerance`)."""
    from twinkle_core.testing.tolerance import forward_tolerance

    return forward_tolerance(float(logits.abs().max()), width=CONFORMANCE_MAX_WIDTH, depth=CONFORMANCE_MAX_DEPTH)
