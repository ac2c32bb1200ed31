"""A base model hosted for one tenant's full-parameter training (``full_parameter: {owner: alice}``), against a real
``twinkle serve`` process: the owner's native-client steps equal an in-process ``TransformersModel`` bit for bit,
``save`` downloads a Hugging Face model directory that plain ``transformers`` loads with the same logits, and after a
SIGKILL and a restart ``resume_from_checkpoint`` continues with the uninterrupted run's losses. Nobody else learns
that the model exists (native API, console, Tinker capabilities: the 404 of an unknown model), and the Tinker SDK,
which trains LoRA adapters only, is refused by name. The config refuses an unknown owner, LoRA-only options beside
``full_parameter`` and unknown keys."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch
from twinkle_server.client import TransformersModel
from twinkle_server.config import server_config
from twinkle_server.errors import NotFound, PayloadTooLarge
from twinkle_server.testing import (
    TINY_BASE,
    TINY_QWEN,
    ServerProcess,
    byte_batch,
    quickstart_tokenizer,
    tiny_model_section,
    tiny_server_config,
)

from twinkle_core.errors import ConfigError

pytestmark = [pytest.mark.timeout(300)]

ALICE, BOB = "tml-alice-full-0001", "tml-bob-full-00001"
FULL = "team/full-qwen"
API = "/twinkle/v1"
batch = byte_batch  # two rows of byte-level tokens, every token a label


def set_up(model) -> None:
    """The same calls on the remote model and on the local one; run again when resuming."""
    model.set_loss("cross_entropy")
    model.set_optimizer("AdamW", lr=1e-2, weight_decay=0.01)
    model.set_lr_scheduler("cosine", num_training_steps=10, num_warmup_steps=1)


def train(model, first: int, count: int) -> list[tuple[torch.Tensor, float]]:
    """(loss, grad norm) of each step."""
    out = []
    for step in range(first, first + count):
        loss = model.forward_backward(inputs=batch(step))["loss"]
        out.append((loss, model.clip_grad_and_step(max_grad_norm=1.0)))
    return out


def same(a: list[tuple[torch.Tensor, float]], b: list[tuple[torch.Tensor, float]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) and m == n for (x, m), (y, n) in zip(a, b, strict=True))


def write_config(directory: Path, **overrides) -> Path:
    # a shared LoRA base beside alice's full-parameter one (the same tiny network)
    return tiny_server_config(directory, tenants={"alice": ALICE, "bob": BOB}, base_models=[
        {"name": TINY_BASE, "model": tiny_model_section(), "max_lora_rank": 8},
        {"name": FULL, "model": tiny_model_section(), "full_parameter": {"owner": "alice"}}], **overrides)


def local_twin():
    """The hosted model's twin in this process, built as the full-parameter host builds it."""
    from twinkle_backend_hf.model import TransformersModel as LocalModel

    # the server runs with TWINKLE_TEST_THREADS threads (ServerProcess): the same count gives the same rounding
    torch.set_num_threads(int(os.environ.get("TWINKLE_TEST_THREADS", "1")))
    tokenizer = LocalModel.load_tokenizer(quickstart_tokenizer())
    return LocalModel(config=dict(TINY_QWEN), seed=0, precision="no", strategy="single", tokenizer=tokenizer)


def test_owner_trains_saves_and_resumes_after_a_kill_bitwise(tmp_path: Path):
    import transformers
    from twinkle_rl.samplers.hf_generate import HFGenerateSampler

    from twinkle_core.sampling import SamplingParams, sample_seed

    config = write_config(tmp_path / "server")
    local = local_twin()
    with ServerProcess(config) as server:
        model = TransformersModel(model_id=FULL, base_url=server.base_url, api_key=ALICE)
        assert model.full_parameter
        for m in (model, local):
            set_up(m)
        remote_steps, local_steps = train(model, 0, 3), train(local, 0, 3)
        assert same(remote_steps, local_steps), (remote_steps, local_steps)
        assert remote_steps[0][0] > remote_steps[-1][0]
        remote_weights, local_weights = model.get_state_dict(), local.get_state_dict()
        assert remote_weights.keys() == local_weights.keys() and len(remote_weights) > 10  # every parameter
        assert all(torch.equal(remote_weights[k], local_weights[k]) for k in local_weights)
        configs = model.get_train_configs()
        assert (configs["step"], configs["adapter_name"], configs["adapters"]) == (3, None, [])
        assert configs["trainable_parameters"] == local.get_train_configs()["trainable_parameters"]
        assert configs["lr"] == local.get_train_configs()["lr"]
        want_logits = local.forward_only(inputs=batch(0))["logits"]
        assert torch.equal(model.forward_only(inputs=batch(0))["logits"], want_logits)
        seeds = [[sample_seed(3, i, j) for j in range(2)] for i in range(2)]
        prompts = [list(b"upper: ab"), list(b"lower: Q")]
        got = model.sample(prompts, n=2, max_new_tokens=5, temperature=1.0, seeds=seeds)
        sampler = HFGenerateSampler()
        sampler.bind(local, local.tokenizer, adapter_name=None)
        want = sampler.sample(prompts, n=2, params=SamplingParams(temperature=1.0, max_new_tokens=5), seeds=seeds)
        assert [[(c.token_ids, c.logprobs) for c in g] for g in got] == [[(c.token_ids, c.logprobs) for c in g]
                                                                         for g in want]

        # save: the server keeps the checkpoint (weights and training state); the client gets a plain HF directory
        path = model.save("step-3", output_dir=str(tmp_path / "outputs"))
        files = {p.name for p in Path(path).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= files and "twinkle_state" not in files
        plain = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            plain_logits = plain(input_ids=batch(0)["input_ids"], attention_mask=batch(0)["attention_mask"]).logits
        assert torch.equal(plain_logits, want_logits)
        assert model.checkpoints() == ["step-3"]
        again = model.download("step-3", output_dir=str(tmp_path / "again"))
        assert (Path(again) / "model.safetensors").read_bytes() == (Path(path) / "model.safetensors").read_bytes()
        uninterrupted = train(model, 3, 3)
        model.close()
        server.kill()

    with ServerProcess(config) as server:
        model = TransformersModel(model_id=FULL, base_url=server.base_url, api_key=ALICE)
        assert model.checkpoints() == ["step-3"]
        set_up(model)
        model.resume_from_checkpoint("step-3")
        assert model.get_train_configs()["step"] == 3
        resumed = train(model, 3, 3)
        model.close()
    assert same(resumed, uninterrupted), (resumed, uninterrupted)


def test_nobody_else_sees_it_and_tinker_is_refused_by_name(tmp_path: Path):
    import tinker

    # responses up to 4 x 0.02 MiB: less than the tiny model's weights (35,488 float32: 139 KiB)
    config = write_config(tmp_path / "server", limits={"max_body_mb": 0.02})
    with ServerProcess(config) as server, \
            httpx.Client(base_url=server.base_url, headers={"X-API-Key": BOB}, timeout=60) as bob, \
            httpx.Client(base_url=server.base_url, headers={"X-API-Key": ALICE}, timeout=60) as alice:
        # the native API: bob gets exactly the 404 of a base model that does not exist
        assert [m["name"] for m in bob.get(f"{API}/models").json()["models"]] == [TINY_BASE]
        listed = {m["name"]: m for m in alice.get(f"{API}/models").json()["models"]}
        assert listed[FULL]["full_parameter"] and not listed[TINY_BASE]["full_parameter"]
        with pytest.raises(NotFound, match="not hosted"):
            TransformersModel(model_id=FULL, base_url=server.base_url, api_key=BOB)

        def probe(base: str) -> list[tuple[int, str]]:
            answers = [bob.post(f"{API}/full/call", json={"base_model": base, "method": "get_train_configs"}),
                       bob.get(f"{API}/full/checkpoints", params={"base_model": base}),
                       bob.get(f"{API}/full/checkpoints/step-1/files/config.json", params={"base_model": base}),
                       bob.post(f"{API}/adapters", json={"name": "a", "base_model": base, "config": {"r": 4}})]
            return [(a.status_code, a.json()["error"].replace(base, "<base>")) for a in answers]

        hidden = probe(FULL)
        assert hidden == probe("team/nowhere")  # word for word, but for the name asked for
        assert [status for status, _ in hidden] == [404] * 4 and FULL not in str(hidden)

        # the owner's model has no adapters; a LoRA base is not called as a full model
        refused = alice.post(f"{API}/adapters", json={"name": "a", "base_model": FULL, "config": {"r": 4}})
        assert refused.status_code == 400 and "full-parameter training" in refused.json()["error"]
        owner = TransformersModel(model_id=FULL, base_url=server.base_url, api_key=ALICE)
        assert owner.get_train_configs()["step"] == 0  # a call on the model's lane
        with pytest.raises(ConfigError, match="no adapters"):
            owner.add_adapter_to_model("lora", {"r": 4, "target_modules": "all-linear"})
        with pytest.raises(ConfigError, match="without adapter_name"):
            owner.set_loss("cross_entropy", adapter_name="lora")
        with pytest.raises(PayloadTooLarge, match=r"weights are 141,952 bytes, over the server's response limit of 83,884 bytes .* save\(\) them"):
            owner.get_state_dict()
        owner.close()
        shared = alice.post(f"{API}/full/call", json={"base_model": TINY_BASE, "method": "get_train_configs"})
        assert shared.status_code == 400 and "add_adapter_to_model" in shared.json()["error"]

        # the console: neither the model nor its lane (which alice's call started)
        overview = bob.get("/console/api/overview").json()
        assert overview["base_models"] == [TINY_BASE] and FULL not in overview["queue"] | overview["running"]
        assert FULL in alice.get("/console/api/overview").json()["running"]

        # the Tinker SDK: bob's capabilities do not list it, and for him it is not hosted
        client = tinker.ServiceClient(base_url=server.base_url, api_key=BOB)
        try:
            capabilities = tinker.RestClient(base_url=server.base_url, api_key=BOB).get_server_capabilities()
            assert [m.model_name for m in capabilities.result().supported_models] == [TINY_BASE]
            with pytest.raises(tinker.NotFoundError, match="not hosted"):
                client.create_lora_training_client(base_model=FULL, rank=4).result()
            with pytest.raises(tinker.NotFoundError, match="not hosted"):
                client.create_sampling_client(base_model=FULL).result()
        finally:
            client.close("success").result(timeout=60)
        # alice's list it as neither trainable nor sampleable through Tinker, and both are refused naming the mode
        client = tinker.ServiceClient(base_url=server.base_url, api_key=ALICE)
        try:
            capabilities = tinker.RestClient(base_url=server.base_url, api_key=ALICE).get_server_capabilities()
            models = {m.model_name: m for m in capabilities.result().supported_models}
            assert (models[FULL].trainable, models[FULL].sampleable) == (False, False)
            assert models[TINY_BASE].trainable
            with pytest.raises(tinker.BadRequestError, match="hosts for full-parameter training.*native client"):
                client.create_lora_training_client(base_model=FULL, rank=4).result()
            with pytest.raises(tinker.BadRequestError, match="full-parameter training"):
                client.create_sampling_client(base_model=FULL).result()
            client.create_lora_training_client(base_model=TINY_BASE, rank=4).result()  # the shared base trains
        finally:
            client.close("success").result(timeout=60)


@pytest.mark.parametrize("entry, message", [
    ({"full_parameter": {"owner": "carol"}}, r"owner 'carol' is not a configured tenant; configured: \['alice'"),
    ({"full_parameter": {"owner": "alice"}, "max_lora_rank": 8},
     r"full_parameter .* no LoRA adapters; \['max_lora_rank'\]"),
    ({"full_parameter": {"owner": "alice"}, "max_adapters": 2}, r"\['max_adapters'\] configure LoRA hosting"),
    ({"full_parameter": {"owner": "alice", "shared": True}}, r"full_parameter: unknown key\(s\) \['shared'\]"),
    ({"full_parameter": "alice"}, r"full_parameter must be a mapping such as \{owner: alice\}"),
    ({"full_parameter": {}}, r"full_parameter.owner must name the tenant"),
])
def test_config_errors_name_the_conflict(entry, message, tmp_path):
    raw = {"base_models": [{"name": FULL, "model": {"path": "/nowhere"}, **entry}], "state_dir": "state",
           "tenants": [{"name": "alice", "api_key": ALICE}]}
    with pytest.raises(ConfigError, match=message):
        server_config(raw, base_dir=tmp_path)


def test_a_valid_entry_names_its_owner(tmp_path):
    raw = {"base_models": [{"name": FULL, "model": {"path": "/nowhere"}, "full_parameter": {"owner": "alice"}},
                           {"name": TINY_BASE, "model": {"path": "/nowhere"}}],
           "tenants": [{"name": "alice", "api_key": ALICE}], "state_dir": "state"}
    models = server_config(raw, base_dir=tmp_path).base_models
    assert models[0].full_parameter.owner == "alice" and models[1].full_parameter is None
