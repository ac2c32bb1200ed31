"""Durability: a server killed with SIGKILL and restarted serves the last saved state, and a client that loads it
continues with exactly the losses of a run that was never interrupted; graceful shutdown never tears a
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from twinkle_server.testing import TINY_BASE, ServerProcess, tiny_server_config

pytestmark = [pytest.mark.timeout(400)]

KEY = "tml-durable-tenant-1"
TEXTS = ["upper: abc -> ABC", "reverse: abcd -> dcba", "upper: xyz -> XYZ"]


def datums(tokenizer_texts: list[str]):
    import tinker

    data = []
    for text in tokenizer_texts:
        ids = list(text.encode())  # the byte tokenizer: ids are bytes (+ offsets are irrelevant to the model here)
        data.append(tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}))
    return data


def train_steps(client, steps: int) -> list[float]:
    import tinker

    losses = []
    for step in range(steps):
        batch = datums([TEXTS[(step + i) % len(TEXTS)] for i in range(2)])
        result = client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(tinker.types.AdamParams(learning_rate=5e-3, weight_decay=0.01)).result()
        losses.append(result.metrics["loss:sum"])
    return losses


def connect(server: ServerProcess):
    import tinker

    return tinker.ServiceClient(base_url=server.base_url, api_key=KEY)


def test_kill_restart_and_load_state_continue_exactly(tmp_path: Path):
    pytest.importorskip("tinker")
    config = tiny_server_config(tmp_path / "server", tenants={"durable": KEY})

    with ServerProcess(config) as server:  # the uninterrupted run: 3 steps, save, 3 more
        service = connect(server)
        client = service.create_lora_training_client(base_model=TINY_BASE, rank=8, seed=0)
        before = train_steps(client, 3)
        saved = client.save_state("after-3").result().path
        uninterrupted = train_steps(client, 3)

        victim = service.create_lora_training_client(base_model=TINY_BASE, rank=8, seed=0)
        train_steps(victim, 1)
        # a save whose server dies mid-way: submitted, then the process is killed at once
        victim.save_state("torn")
        server.kill()

    with ServerProcess(config) as server:
        service = connect(server)
        resumed = service.create_lora_training_client(base_model=TINY_BASE, rank=8, seed=0)
        resumed.load_state_with_optimizer(saved).result()
        after = train_steps(resumed, 3)
        rest = service.create_rest_client()
        listed = [c.checkpoint_id for c in rest.list_checkpoints(saved.split("/")[2]).result().checkpoints]

    assert before[0] > before[-1]
    assert after == uninterrupted, (after, uninterrupted)  # bitwise: same CPU kernels, same state
    assert any("after-3" in c for c in listed), listed
    # nothing torn on disk: every registered checkpoint directory is complete, no temporary directory left
    state = tmp_path / "server" / "state"
    registry = json.loads((state / "registry.json").read_text())
    for record in registry["checkpoints"].values():
        assert Path(record["path"]).is_dir() and any(Path(record["path"]).iterdir())
    leftovers = [p for p in state.rglob("*") if p.name.startswith(".") and p.name.endswith(".tmp")]
    assert not leftovers, leftovers
