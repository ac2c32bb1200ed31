"""Limits and concurrency on a real ``twinkle serve``: a payload bomb, a malformed protobuf body, too many tokens and
too much queued work are each refused with the limit named and without disturbing another tenant; two tenants
trained concurrently end with weights bitwise equal to training each alone, serially, in process."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from twinkle_server.testing import TINY_BASE, ServerProcess, tiny_model_section, tiny_server_config

tinker = pytest.importorskip("tinker")
types = tinker.types

pytestmark = [pytest.mark.timeout(300)]

KEYS = {"alice": "tml-limits-alice-1", "bob": "tml-limits-bob-001"}
LIMITS = {"max_body_mb": 0.25, "max_tokens_per_request": 2048, "max_queued_per_tenant": 3}
LR = 1e-2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tiny_server_config(tmp_path_factory.mktemp("limits"), tenants=KEYS, limits=LIMITS)
    with ServerProcess(config) as process:
        yield process


def rows(tenant: int, step: int, n: int = 2, length: int = 24) -> list[list[int]]:
    import random

    rng = random.Random(tenant * 7919 + step)
    return [[rng.randrange(1, 262) for _ in range(length + 1)] for _ in range(n)]


def datums(batch: list[list[int]]):
    return [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                        loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)}) for r in batch]


def proto_body(model_id: str, data, seq_id: int) -> bytes:
    from tinker.proto.request_conv import forward_backward_request_to_proto

    return forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)).SerializeToString()


def loss_now(client) -> float:
    return client.forward(datums(rows(99, 0)), "cross_entropy").result().metrics["loss:sum"]


def test_bad_and_oversized_requests_are_refused_without_touching_others(server):
    alice = tinker.ServiceClient(base_url=server.base_url, api_key=KEYS["alice"])
    bob = tinker.ServiceClient(base_url=server.base_url, api_key=KEYS["bob"])
    victim = alice.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=1).result()
    attacker = bob.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=2).result()
    before = loss_now(victim)
    headers = {"X-API-Key": KEYS["bob"], "Content-Type": "application/x-protobuf"}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        bomb = http.post("/api/v1/forward_backward", content=b"\0" * (1 << 20), headers=headers)
        assert bomb.status_code == 413 and "max_body_mb" in bomb.json()["error"]

        garbage = http.post("/api/v1/forward_backward", content=b"\xff\xfe not a protobuf \x00\x01", headers=headers)
        assert garbage.status_code == 400, garbage.text

        too_long = proto_body(attacker.model_id, datums(rows(3, 0, n=3, length=1000)), seq_id=1)
        refused = http.post("/api/v1/forward_backward", content=too_long, headers=headers)
        assert refused.status_code == 413 and "max_tokens_per_request" in refused.json()["error"]

        # another tenant's run id: 404, as for an id that does not exist
        stolen = http.post("/api/v1/forward_backward", content=proto_body(victim.model_id, datums(rows(3, 1)), 2),
                           headers=headers)
        assert stolen.status_code == 404

        # more work than the tenant's queue holds: 429 naming the limit. A long sampling request holds the lane
        # first, so the posts below queue behind it whatever the machine's speed.
        sampler = bob.create_sampling_client(base_model=TINY_BASE).result()
        long_sample = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), num_samples=8,
                                     sampling_params=types.SamplingParams(max_tokens=240, temperature=1.0, stop=[]))
        answers = [http.post("/api/v1/forward_backward", headers=headers,
                             content=proto_body(attacker.model_id, datums(rows(4, i)), 100 + i)) for i in range(20)]
        refused = [a for a in answers if a.status_code == 429]
        assert refused, [a.status_code for a in answers]
        assert "max_queued_per_tenant=3" in refused[0].json()["error"], refused[0].text
        long_sample.result()
    assert loss_now(victim) == before  # nothing bob sent reached alice's adapter
    for service in (alice, bob):  # finish the sessions while the server is up (no heartbeats left running)
        service.close("success").result(timeout=60)


def train_alone_in_process(seed: int, tenant: int, steps: int, directory: Path) -> dict[str, torch.Tensor]:
    from twinkle_server.host import AdamStep, Datum, ModelHost

    # the server runs with TWINKLE_TEST_THREADS threads (ServerProcess): the same count gives the same rounding
    torch.set_num_threads(int(os.environ.get("TWINKLE_TEST_THREADS", "1")))
    host = ModelHost(TINY_BASE, tiny_model_section(), state_dir=directory, max_lora_rank=32)
    host.create_adapter("alone", rank=4, seed=seed)
    for step in range(steps):
        data = [Datum(tokens=r[:-1], loss_fn_inputs={"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)})
                for r in rows(tenant, step)]
        host.forward_backward("alone", data, "cross_entropy")
        host.optim_step("alone", AdamStep(learning_rate=LR))
    host.export_adapter("alone", directory / "export")
    return load_file(str(directory / "export" / "adapter_model.safetensors"))


def test_two_tenants_trained_concurrently_equal_each_trained_alone(server, tmp_path: Path):
    steps = 5
    exported: dict[str, str] = {}

    def tenant(name: str, index: int) -> None:
        service = tinker.ServiceClient(base_url=server.base_url, api_key=KEYS[name])
        client = service.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=10 + index).result()
        for step in range(steps):
            fwd = client.forward_backward(datums(rows(index, step)), "cross_entropy")
            opt = client.optim_step(types.AdamParams(learning_rate=LR))
            fwd.result()
            opt.result()
        export = client.save_weights_external("concurrent").result().path
        rest = tinker.RestClient(base_url=server.base_url, api_key=KEYS[name])
        exported[name] = rest.get_external_weights_urls(export).result().urls
        service.close("success").result(timeout=60)

    threads = [threading.Thread(target=tenant, args=(name, i)) for i, name in enumerate(KEYS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    assert set(exported) >= set(KEYS), exported

    for index, name in enumerate(KEYS):
        served = download_adapter(exported[name], tmp_path / f"served-{name}")
        alone = train_alone_in_process(10 + index, index, steps, tmp_path / f"alone-{name}")
        assert served.keys() == alone.keys()
        unequal = [k for k in alone if not torch.equal(alone[k], served[k])]
        assert not unequal, f"{name}: {len(unequal)} tensors differ, e.g. {unequal[:2]}"


def download_adapter(urls: dict[str, str], directory: Path) -> dict[str, torch.Tensor]:
    """The adapter's safetensors through the SDK's own signed download URLs (a plain HTTP GET)."""
    import urllib.request

    directory.mkdir(parents=True)
    with urllib.request.urlopen(urls["adapter_model.safetensors"], timeout=30) as response:
        (directory / "adapter_model.safetensors").write_bytes(response.read())
    return load_file(str(directory / "adapter_model.safetensors"))


def test_a_client_side_custom_loss_trains_through_the_sdk(server):
    """``forward_backward_custom`` (the SDK computes the loss on the client from the returned log-probs and sends
    its gradient back as cross_entropy weights) steps exactly like the same loss sent as cross_entropy."""
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEYS["alice"])
    custom = service.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=21).result()
    plain = service.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=21).result()

    def twice_the_nll(data, logprobs_list):
        loss = sum(-(2.0 * lp).sum() for lp in logprobs_list)
        return loss, {"twice_nll:sum": float(loss)}

    batch = rows(7, 0)
    result = custom.forward_backward_custom(datums(batch), twice_the_nll).result()
    weighted = [types.Datum(model_input=types.ModelInput.from_ints(r[:-1]),
                            loss_fn_inputs={"target_tokens": r[1:], "weights": [2.0] * (len(r) - 1)}) for r in batch]
    expected = plain.forward_backward(weighted, "cross_entropy").result()
    assert result.metrics["twice_nll:sum"] == pytest.approx(expected.metrics["loss:sum"], rel=1e-5)
    for client in (custom, plain):
        client.optim_step(types.AdamParams(learning_rate=LR)).result()
    assert loss_now(custom) == loss_now(plain)
    service.close("success").result(timeout=60)
