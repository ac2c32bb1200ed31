"""The SDPA core attention (``core_attention="sdpa"``, the default) computes what megatron-core's
``DotProductAttention`` does: causal rows, left / right padding and packed rows, forward and gradients."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from twinkle_backend_megatron.sdpa_attention import SDPAttention
from twinkle_backend_megatron.testing import make_tiny_model, tiny_qwen2_config

from twinkle_core.errors import ConfigError
from twinkle_core.testing.conformance import make_batch
from twinkle_core.testing.tolerance import forward_tolerance

IGNORE_INDEX = -100


def _core_attentions(model) -> set[type]:
    return {type(m) for m in model.chunks[0].modules() if isinstance(m, DotProductAttention)}


def _padded_and_packed_batch() -> dict[str, torch.Tensor]:
    """Row 0 left-padded (its first queries see no key at all), row 1 right-padded, row 2 two packed sequences."""
    batch = make_batch(7, rows=4, length=12)
    rows, length = batch["input_ids"].shape
    positions = torch.arange(length).repeat(rows, 1)
    batch["attention_mask"][0, :3] = 0
    batch["attention_mask"][1, -4:] = 0
    batch["labels"][0, :3] = IGNORE_INDEX
    batch["labels"][1, -4:] = IGNORE_INDEX
    positions[2, 5:] = torch.arange(length - 5)
    batch["position_ids"] = positions
    return batch


def _loss_logits_grads(core_attention: str, batch: dict[str, torch.Tensor]):
    model = make_tiny_model(seed=0, core_attention=core_attention)
    model.set_optimizer("SGD", lr=0.1)
    out = model.forward_backward(inputs=batch)
    grads = {name: p.grad.clone() for name, p in model.chunks[0].named_parameters() if p.grad is not None}
    logits = model.forward_only(inputs=batch)["logits"]
    return model, float(out["loss"]), logits, grads


def test_sdpa_is_the_default_and_megatron_keeps_dot_product_attention():
    assert _core_attentions(make_tiny_model(seed=0)) == {SDPAttention}
    assert _core_attentions(make_tiny_model(seed=0, core_attention="megatron")) == {DotProductAttention}
    # attention dropout comes from megatron-core's per-TP-rank RNG tracker: SDPA would draw other masks
    dropout = make_tiny_model(seed=0, config=tiny_qwen2_config(attention_dropout=0.1))
    assert _core_attentions(dropout) == {DotProductAttention}
    with pytest.raises(ConfigError, match="core_attention must be one of"):
        make_tiny_model(seed=0, core_attention="flash")


@pytest.mark.parity
@pytest.mark.parametrize("batch", [make_batch(3, rows=4, length=12), _padded_and_packed_batch()],
                         ids=["causal", "padded-and-packed"])
def test_sdpa_matches_dot_product_attention(batch):
    model, loss, logits, grads = _loss_logits_grads("sdpa", batch)
    _, want_loss, want_logits, want_grads = _loss_logits_grads("megatron", batch)
    config = model.hf_config
    depth, width = config.num_hidden_layers, max(config.intermediate_size, batch["input_ids"].numel())
    assert loss == pytest.approx(want_loss, abs=forward_tolerance(abs(want_loss), width=width, depth=depth))
    real = batch["attention_mask"].bool()  # padding positions' logits are not defined by either attention
    torch.testing.assert_close(logits[real], want_logits[real], rtol=0,
                               atol=forward_tolerance(float(want_logits.abs().max()), width=width, depth=depth))
    assert grads.keys() == want_grads.keys() and grads
    for name, want in want_grads.items():
        tolerance = forward_tolerance(float(want.abs().max()), width=width, depth=depth)
        torch.testing.assert_close(grads[name], want, rtol=0, atol=tolerance, msg=name)
