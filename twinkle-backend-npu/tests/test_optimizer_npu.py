"""``set_optimizer("AdamW")`` on the npu accelerator builds torch_npu's NpuFusedAdamW (the fake's, here), the
kernel switch keeps torch's AdamW, and the weights after a few steps equal torch's AdamW.

Tolerance: the fake NpuFusedAdamW runs torch's per-parameter AdamW update and the reference torch's default
kernel (fused or foreach, whichever torch has for CPU), the same formula in another grouping: a few fp32 ulp per step, so 1e-6 relative to the
largest weight after 3 steps.
"""

from __future__ import annotations

import pytest
import torch
from twinkle_backend_npu.testing import fake_ops, install_fake_torch_npu

from twinkle_core.optim import build_optimizer
from twinkle_core.plugins import TwinklePlugins, reset_plugins

TINY_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 32, "tie_word_embeddings": False}


@pytest.fixture
def npu(monkeypatch):
    reset_plugins(TwinklePlugins(extra_modules=["twinkle_backend_npu.plugin"]))
    with install_fake_torch_npu():
        monkeypatch.setenv("TWINKLE_ACCELERATOR", "npu")
        yield
    reset_plugins()


def parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    return list(torch.nn.Linear(8, 4).parameters())


def train(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 3) -> list[torch.Tensor]:
    inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        optimizer.zero_grad()
        (inputs @ params[0].T + params[1]).square().mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in params]


def test_adamw_on_the_npu_accelerator_is_npu_fused_adamw_and_steps_like_torch_adamw(npu):
    fused_params, plain_params = parameters(), parameters()
    fused = build_optimizer("AdamW", fused_params, accelerator="npu", lr=0.1, weight_decay=0.01)
    assert type(fused) is fake_ops.NpuFusedAdamW
    plain = build_optimizer("AdamW", plain_params, lr=0.1, weight_decay=0.01)
    assert type(plain) is torch.optim.AdamW
    for got, expected in zip(train(fused, fused_params), train(plain, plain_params)):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_the_switch_and_other_accelerators_keep_torch_adamw(npu):
    off = build_optimizer("AdamW", parameters(), accelerator="npu", kernels={"npu_fused_adamw": False}, lr=0.1)
    assert type(off) is torch.optim.AdamW
    assert type(build_optimizer("AdamW", parameters(), accelerator="cpu", lr=0.1)) is torch.optim.AdamW
    assert type(build_optimizer("SGD", parameters(), accelerator="npu", lr=0.1)) is torch.optim.SGD


def test_transformers_model_set_optimizer_builds_it_on_npu(npu, monkeypatch):
    from twinkle_backend_hf.model import TransformersModel

    built = []

    class Recorded(fake_ops.NpuFusedAdamW):
        def __init__(self, *args, **kwargs):
            built.append(self)
            super().__init__(*args, **kwargs)

    import torch_npu

    monkeypatch.setattr(torch_npu.optim, "NpuFusedAdamW", Recorded, raising=False)
    model = TransformersModel(config=TINY_LLAMA, seed=0)
    model.set_optimizer("AdamW", lr=1e-3)
    assert len(built) == 1
    assert model.get_train_configs()["optimizer"]["name"] == "AdamW"
