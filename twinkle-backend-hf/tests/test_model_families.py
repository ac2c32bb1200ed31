"""Every model family of the seed table: a tiny config trains a step, saves, and plain transformers reloads it."""

from __future__ import annotations

import pytest
import torch
import transformers
from families import FAMILIES
from twinkle_backend_hf.model import TransformersModel

from twinkle_core.testing.conformance import make_batch


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_trains_saves_and_reloads_in_plain_transformers(family, tmp_path):
    model = TransformersModel(config=dict(FAMILIES[family]), seed=0)
    model.set_optimizer("AdamW", lr=1e-3)
    batch = make_batch(0, rows=2, length=8)
    first = model.forward_backward(inputs=batch)
    norm = model.clip_grad_and_step(max_grad_norm=1.0)
    assert torch.isfinite(first["loss"]) and norm > 0
    path = model.save("ckpt", output_dir=str(tmp_path))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reloaded.eval()
    with torch.no_grad():
        got = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    torch.testing.assert_close(got, model.forward_only(inputs=batch)["logits"], atol=1e-5, rtol=1e-5)
