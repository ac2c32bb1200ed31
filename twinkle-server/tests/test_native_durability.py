"""Native adapters survive a restart like Tinker runs: a ``twinkle serve`` killed with SIGKILL and restarted on the
same config lists the tenant's adapters again (freshly initialised from their seed, a removed one gone), and a
client that re-attaches by name and resumes from a saved checkpoint continues with exactly the losses of a run that
was never interrupted. Native and Tinker adapters count against ``max_adapters`` together, also after a restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from twinkle_server.client import TransformersModel
from twinkle_server.errors import TooManyRequests
from twinkle_server.testing import (
    TINY_BASE,
    ServerProcess,
    byte_batch,
    tiny_model_section,
    tiny_server_config,
)

pytestmark = [pytest.mark.timeout(400)]

KEY = "tml-native-durable-01"
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
batch = byte_batch  # two rows of byte-level tokens, every token a label


def connect(server: ServerProcess) -> TransformersModel:
    return TransformersModel(model_id=TINY_BASE, base_url=server.base_url, api_key=KEY, seed=5)


def set_up(model: TransformersModel) -> None:
    """What a training script runs before its first step, and again when it resumes."""
    model.set_loss("cross_entropy", adapter_name="policy")
    model.set_optimizer("AdamW", adapter_name="policy", lr=1e-2, gradient_accumulation_steps=2)
    model.set_lr_scheduler("cosine", adapter_name="policy", num_training_steps=20, num_warmup_steps=2)


def train(model: TransformersModel, first: int, count: int) -> list[float]:
    losses = []
    for step in range(first, first + count):
        losses.append(float(model.forward_backward(inputs=batch(step), adapter_name="policy")["loss"]))
        model.clip_grad_and_step(max_grad_norm=1.0, adapter_name="policy")
    return losses


def test_native_adapter_survives_kill_and_resumes_exactly(tmp_path: Path):
    pytest.importorskip("tinker")
    import tinker

    config = tiny_server_config(tmp_path / "server", tenants={"durable": KEY},
                                base_models=[{"name": TINY_BASE, "model": tiny_model_section(), "max_lora_rank": 32,
                                              "max_adapters": 3}])

    with ServerProcess(config) as server:
        model = connect(server)
        model.add_adapter_to_model("policy", dict(LORA))
        initial = model.get_state_dict(adapter_name="policy")
        set_up(model)
        before = train(model, 0, 4)
        model.save("after-4", output_dir=str(tmp_path / "outputs"), adapter_name="policy")
        uninterrupted = train(model, 4, 4)
        model.add_adapter_to_model("gone", dict(LORA))  # removed before the crash: it must stay removed
        model.remove_adapter("gone")
        # a Tinker run beside it: restored by its own path, and counted with the native adapters
        service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
        service.create_lora_training_client(base_model=TINY_BASE, rank=8, seed=0).result()
        service.close("success").result(timeout=60)  # no heartbeat thread left behind once the server is killed
        model.close()
        server.kill()

    registry = json.loads((tmp_path / "server" / "state" / "registry.json").read_text())
    assert [r["name"] for r in registry["native_adapters"].values()] == ["policy"]
    assert len(registry["runs"]) == 1  # a native adapter is no Tinker run: Tinker's listings never show it

    with ServerProcess(config) as server:
        model = connect(server)
        assert model.adapters() == ["policy"]  # re-attached by name
        restored = model.get_state_dict(adapter_name="policy")
        assert restored.keys() == initial.keys()
        assert all(torch.equal(restored[k], initial[k]) for k in initial)  # fresh, from the recorded seed
        assert model.checkpoints(adapter_name="policy") == ["after-4"]
        set_up(model)
        model.resume_from_checkpoint("after-4", adapter_name="policy")
        assert model.get_train_configs(adapter_name="policy")["step"] == 2
        after = train(model, 4, 4)

        # max_adapters=3: the restored native adapter and Tinker run, plus one more
        model.add_adapter_to_model("third", dict(LORA))
        with pytest.raises(TooManyRequests, match="max_adapters=3"):
            model.add_adapter_to_model("fourth", dict(LORA))
        assert model.adapters() == ["policy", "third"]  # the refused ones left nothing behind
        model.close()

    assert before[0] > before[-1]
    assert after == uninterrupted, (after, uninterrupted)  # bitwise: same CPU kernels, same state


def test_native_and_tinker_adapters_share_max_adapters(tmp_path: Path):
    from twinkle_server.host import ModelHost

    host = ModelHost("tiny", tiny_model_section(), state_dir=tmp_path, max_lora_rank=8, max_adapters=2)
    host.create_adapter("run-1", rank=4, seed=0)
    host.add_lora_adapter("native_a", dict(LORA), seed=0)
    with pytest.raises(TooManyRequests, match="max_adapters=2"):
        host.create_adapter("run-2", rank=4, seed=0)
    with pytest.raises(TooManyRequests, match="max_adapters=2"):
        host.add_lora_adapter("native_b", dict(LORA), seed=0)
    host.remove_lora_adapter("native_a")
    host.create_adapter("run-2", rank=4, seed=0)  # the native adapter's place is free again
    assert host.adapter_ids() == ["run-1", "run-2"]
