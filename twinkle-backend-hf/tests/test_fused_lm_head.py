"""The fused LM head: ``forward_backward`` hands the loss hidden states and the head's weight instead of logits, and
the loss gives the same value and gradients as through the logits, for every family the backend vouches for."""

from __future__ import annotations

import pytest
import torch
from families import FAMILIES
from twinkle_backend_hf.model import _PLAIN_HEAD_MODEL_TYPES, TransformersModel

from twinkle_core.loss.cross_entropy import FUSED_HEAD_MIN_VOCAB
from twinkle_core.testing.conformance import make_batch

EPS32 = torch.finfo(torch.float32).eps


def _step(config: dict, lm_head: str, *, precision: str = "no", adapter: bool = False, steps: int = 1):
    model = TransformersModel(config=dict(config), seed=0, precision=precision)
    if adapter:
        model.add_adapter_to_model("default", {"type": "lora", "r": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    model.set_loss("cross_entropy", lm_head=lm_head)
    model.set_optimizer("AdamW", lr=1e-2)
    losses, outputs = [], None
    for step in range(steps):
        outputs = model.forward_backward(inputs=make_batch(step, rows=2, length=12))
        losses.append(outputs["loss"].item())
        if step == steps - 1:
            grads = {n: p.grad.clone() for n, p in model.module.named_parameters() if p.grad is not None}
        model.clip_grad_and_step(max_grad_norm=None)
    return outputs, losses, grads


def _close(got: torch.Tensor, want: torch.Tensor, terms: int, eps: float = EPS32) -> None:
    # both sides sum the same terms in another order: each sum is off by at most ~terms * eps of its magnitude
    bound = 4 * terms * eps * max(want.abs().max().item(), 1e-3)
    assert (got - want).abs().max().item() <= bound, ((got - want).abs().max().item(), bound)


def test_every_family_the_backend_vouches_for_is_tested_here():
    assert _PLAIN_HEAD_MODEL_TYPES <= {config["model_type"] for config in FAMILIES.values()}


@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if FAMILIES[f]["model_type"] in _PLAIN_HEAD_MODEL_TYPES))
def test_the_fused_head_gives_the_logits_loss_and_gradients(family):
    fused_out, fused_losses, fused_grads = _step(FAMILIES[family], "fused")
    plain_out, plain_losses, plain_grads = _step(FAMILIES[family], "logits")
    assert "logits" not in fused_out and fused_out["hidden_states"].shape[-1] == FAMILIES[family]["hidden_size"]
    assert "logits" in plain_out and "lm_head_weight" not in plain_out
    tokens = 2 * 12
    assert abs(fused_losses[0] - plain_losses[0]) <= 4 * tokens * EPS32 * abs(plain_losses[0])
    assert fused_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        _close(fused_grads[name], grad, terms=tokens, eps=EPS32 * 8)  # 8: the chain rule through 2 layers


def test_three_adamw_steps_follow_the_same_losses():
    _, fused, _ = _step(FAMILIES["qwen2"], "fused", steps=3)
    _, plain, _ = _step(FAMILIES["qwen2"], "logits", steps=3)
    assert fused == pytest.approx(plain, rel=1e-5)


def test_lora_and_bf16_autocast_use_the_fused_head_too():
    fused_out, fused_losses, fused_grads = _step(FAMILIES["qwen2"], "fused", precision="bf16", adapter=True)
    _, plain_losses, plain_grads = _step(FAMILIES["qwen2"], "logits", precision="bf16", adapter=True)
    assert "logits" not in fused_out and fused_out["hidden_states"].dtype == torch.bfloat16
    # the head runs in bf16 on both sides; only the summation order of the float32 loss differs
    assert fused_losses[0] == pytest.approx(plain_losses[0], rel=1e-3)
    assert fused_grads.keys() == plain_grads.keys() and all("lora" in n for n in fused_grads)
    for name, grad in plain_grads.items():
        _close(fused_grads[name], grad, terms=24, eps=torch.finfo(torch.bfloat16).eps)


def test_auto_fuses_from_the_vocabulary_threshold_on():
    small, _, _ = _step(FAMILIES["qwen2"], "auto")
    large, _, _ = _step({**FAMILIES["qwen2"], "vocab_size": FUSED_HEAD_MIN_VOCAB, "hidden_size": 16,
                         "intermediate_size": 32, "num_hidden_layers": 1, "head_dim": 8}, "auto")
    assert "logits" in small and "logits" not in large


def test_forward_and_forward_only_keep_their_logits():
    model = TransformersModel(config=dict(FAMILIES["qwen2"]), seed=0)
    model.set_loss("cross_entropy", lm_head="fused")
    batch = make_batch(0, rows=2, length=8)
    assert "logits" in model.forward(inputs=batch)
    assert "logits" in model.forward_only(inputs=batch)


def test_a_metric_that_reads_logits_keeps_them():
    model = TransformersModel(config=dict(FAMILIES["qwen2"]), seed=0)
    model.set_loss("cross_entropy", lm_head="fused")
    model.set_optimizer("AdamW", lr=1e-3)
    model.add_metric("accuracy")
    out = model.forward_backward(inputs=make_batch(0, rows=2, length=8))
    assert "logits" in out and 0.0 <= model.calculate_metric()["accuracy"] <= 1.0


def test_an_unvouched_architecture_keeps_its_logits():
    config = {"model_type": "gemma2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "final_logit_softcapping": 30.0}
    out, _, _ = _step(config, "fused")
    assert "logits" in out  # soft-capped logits are not lm_head(h): the loss gets them the usual way
