"""The native API and its client against a real server (uvicorn on loopback, in a thread): the README loop, a DPO
step and a GRPO step through ``twinkle_server.client`` equal the same calls on a local MultiLoraTransformersModel;
tenants are isolated; bad keys, methods, names and tensor payloads are refused without touching an adapter."""

from __future__ import annotations

import base64
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
from twinkle_server import tensor_wire
from twinkle_server.app import build_app
from twinkle_server.client import RemoteModel, RemoteSampler, TransformersModel
from twinkle_server.config import server_config
from twinkle_server.errors import BadRequest, NotFound, Unauthorized
from twinkle_server.testing import TINY_BASE, TINY_QWEN, quickstart_tokenizer, tiny_model_section

pytestmark = pytest.mark.timeout(240)

KEY_A, KEY_B = "tml-alice-native-0001", "tml-bob-native-00001"
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
MODEL_SEED = 0  # tiny_model_section's: the hosted base's initial weights
API = "/twinkle/v1"


@dataclass
class Running:
    base_url: str
    app: Any


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import uvicorn

    directory = tmp_path_factory.mktemp("native")
    config = server_config({
        "host": "127.0.0.1", "port": 0, "state_dir": str(directory / "state"),
        "base_models": [{"name": TINY_BASE, "model": tiny_model_section(MODEL_SEED), "max_lora_rank": 16}],
        "tenants": [{"name": "alice", "api_key": KEY_A}, {"name": "bob", "api_key": KEY_B}],
    })
    app = build_app(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="native-test-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not uv.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        yield Running(f"http://127.0.0.1:{port}", app)
    finally:
        uv.should_exit = True
        thread.join(60)
        sock.close()


@pytest.fixture(scope="module")
def tokenizer():
    from twinkle_backend_hf.multi_lora import MultiLoraTransformersModel

    return MultiLoraTransformersModel.load_tokenizer(quickstart_tokenizer())


def local_model(tokenizer, name: str, seed: int) -> Any:
    """The hosted model's twin, built as the host builds it, with one adapter drawn as the server draws it."""
    from twinkle_backend_hf.multi_lora import MultiLoraTransformersModel

    model = MultiLoraTransformersModel(config=dict(TINY_QWEN), seed=MODEL_SEED, precision="no", strategy="single",
                                       tokenizer=tokenizer, max_lora_rank=16)
    torch.manual_seed(seed)
    model.add_adapter_to_model(name, dict(LORA))
    return model


def remote(server, key: str = KEY_A, **kwargs) -> RemoteModel:
    return TransformersModel(model_id=TINY_BASE, base_url=server.base_url, api_key=key, **kwargs)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def sft_batches(tokenizer, count: int, rows: int = 2) -> list[dict[str, torch.Tensor]]:
    from twinkle_core.tasks.causal_lm import CausalLMTask

    task = CausalLMTask()
    data = [{"messages": [{"role": "user", "content": f"reverse: {w}"}, {"role": "assistant", "content": w[::-1]}]}
            for w in ("kdoq", "yuewtn", "abc", "tcujgy", "klcoa", "mnop", "zyx", "qwerty")]
    features = task.load_dataset(data, tokenizer, max_length=48)
    return [task.collate(features[i * rows:(i + 1) * rows]) for i in range(count)]


# ---------------------------------------------------------------------------------------------- the README loop
def test_readme_loop_remote_equals_local_and_save_is_a_plain_peft_directory(server, tokenizer, tmp_path, monkeypatch):
    import peft
    import transformers

    batches = sft_batches(tokenizer, 4)
    monkeypatch.setenv("TWINKLE_SERVER_URL", server.base_url)
    monkeypatch.setenv("TWINKLE_API_KEY", KEY_A)
    # the README's line, with the one import changed (the server decides precision and strategy)
    model = TransformersModel(model_id=TINY_BASE, precision="bf16", seed=7)
    local = local_model(tokenizer, "default", seed=7)
    for m in (model, local):
        if m is model:
            m.add_adapter_to_model("default", dict(LORA))
        m.set_loss("cross_entropy")
        m.set_optimizer("AdamW", lr=1e-2, gradient_accumulation_steps=2)
        m.set_lr_scheduler("cosine", num_training_steps=10, num_warmup_steps=1)
    for batch in batches:
        got, want = model.forward_backward(inputs=batch), local.forward_backward(inputs=batch)
        assert torch.equal(got["loss"], want["loss"]) and int(got["num_tokens"]) == int(want["num_tokens"])
        assert model.clip_grad_and_step(max_grad_norm=1.0) == local.clip_grad_and_step(max_grad_norm=1.0)
    assert_same_weights(model.get_state_dict(), local.get_state_dict(adapter_name="default"))
    configs = model.get_train_configs()
    assert (configs["step"], configs["adapters"], configs["loss"]["name"]) == (2, ["default"], "cross_entropy")
    assert configs["lr"] == local.get_train_configs(adapter_name="default")["lr"]
    assert "tenants" not in configs  # other tenants' adapters are not disclosed

    path = model.save("final", output_dir=str(tmp_path / "outputs"))
    assert path == str(tmp_path / "outputs" / "final")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "outputs" / "final").iterdir()}
    assert model.checkpoints() == ["final"]
    torch.manual_seed(MODEL_SEED)  # the base as the host built it
    base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**dict(TINY_QWEN)),
                                                         dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, path).eval()
    with torch.no_grad():
        plain = loaded(input_ids=batches[0]["input_ids"], attention_mask=batches[0]["attention_mask"]).logits
    want = local.forward_only(inputs=batches[0], adapter_name="default")["logits"]
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.forward_only(inputs=batches[0])["logits"], want)

    # the server keeps the full checkpoint: training resumes from it (and a long call is a future polled for)
    model.resume_from_checkpoint("final")
    assert model.get_train_configs()["step"] == 2
    model.close()


# ---------------------------------------------------------------------------------------------- preference
def test_dpo_step_through_the_client_equals_in_process(server, tokenizer):
    from twinkle_rl.layout import sequence_sums
    from twinkle_rl.task import PreferenceTask

    rows = [{"prompt": f"reverse: {w}", "chosen": w[::-1], "rejected": w} for w in ("kdoq", "abcde", "xyz")]
    model = remote(server)
    model.add_adapter_to_model("dpo", dict(LORA), seed=11)
    local = local_model(tokenizer, "dpo", seed=11)
    got_task, want_task = PreferenceTask(adapter_name="dpo"), PreferenceTask(adapter_name="dpo")
    features = got_task.load_dataset(rows, tokenizer)
    want_task.load_dataset(rows, tokenizer)
    for m in (model, local):
        m.set_loss("dpo", adapter_name="dpo", beta=0.1)
        m.set_optimizer("AdamW", adapter_name="dpo", lr=1e-2)
    for step in range(2):
        batch = got_task.collate(features)
        got_batch = got_task.prepare_batch(model, dict(batch))  # ref_logps: the server's base, adapters off
        want_batch = want_task.prepare_batch(local, dict(batch))
        assert torch.equal(got_batch["ref_logps"], want_batch["ref_logps"])
        if step == 0:  # the same reference from the labels' log-probs alone (no logits on the wire)
            scored = model.forward_only(inputs=batch, adapter_name="dpo", disable_adapters=True,
                                        return_outputs=["label_logprobs", "label_mask"])
            assert set(scored) == {"label_logprobs", "label_mask"}
            sums, _ = sequence_sums(scored["label_logprobs"], scored["label_mask"], batch, 2 * len(features))
            assert torch.equal(sums.float(), want_batch["ref_logps"])
        got = model.forward_backward(inputs=got_batch, adapter_name="dpo")
        want = local.forward_backward(inputs=want_batch, adapter_name="dpo")
        assert torch.equal(got["loss"], want["loss"]), step
        for key in ("rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert got[key] == want[key], key
        model.clip_grad_and_step(adapter_name="dpo")
        local.clip_grad_and_step(adapter_name="dpo")
    assert_same_weights(model.get_state_dict(adapter_name="dpo"), local.get_state_dict(adapter_name="dpo"))
    model.close()


# ---------------------------------------------------------------------------------------------- grpo
def test_grpo_rollouts_and_step_through_the_client_equal_in_process(server, tokenizer):
    from twinkle_rl.advantages import grpo_advantages
    from twinkle_rl.experience import experience_batch
    from twinkle_rl.samplers.hf_generate import HFGenerateSampler

    from twinkle_core.sampling import SamplingParams, sample_seed

    model = remote(server)
    model.add_adapter_to_model("grpo", dict(LORA), seed=13)
    local = local_model(tokenizer, "grpo", seed=13)
    for m in (model, local):
        m.set_loss("grpo", adapter_name="grpo", temperature=1.0)
        m.set_optimizer("AdamW", adapter_name="grpo", lr=1e-2)
    prompts = [tokenizer(text)["input_ids"] for text in ("reverse: abc", "upper: kdoq")]
    n, params = 4, SamplingParams(temperature=1.0, max_new_tokens=6)
    seeds = [[sample_seed(5, i, j) for j in range(n)] for i in range(len(prompts))]
    groups = model.sample(prompts, n=n, max_new_tokens=6, temperature=1.0, seeds=seeds, adapter_name="grpo")
    sampler = HFGenerateSampler()
    sampler.bind(local, tokenizer, adapter_name="grpo")
    want_groups = sampler.sample(prompts, n=n, params=params, seeds=seeds)
    for got, want in zip((c for g in groups for c in g), (c for g in want_groups for c in g), strict=True):
        assert (got.token_ids, got.logprobs, got.finish_reason) == (want.token_ids, want.logprobs, want.finish_reason)
    via_sampler = RemoteSampler()  # the core sampler contract over the client
    via_sampler.bind(model, tokenizer, adapter_name="grpo")
    again = via_sampler.sample(prompts, n=n, params=params, seeds=seeds)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in groups]

    completions = [c for g in groups for c in g]
    rewards = torch.tensor([[sum(t % 2 == 0 for t in c.token_ids) / max(len(c.token_ids), 1) for c in g]
                            for g in groups], dtype=torch.float64)
    batch = experience_batch([p for p in prompts for _ in range(n)], completions, pad_token_id=tokenizer.pad_token_id)
    batch["advantages"] = grpo_advantages(rewards).reshape(-1).to(torch.float32)
    assert bool(batch["advantages"].abs().sum() > 0)
    got = model.forward_backward(inputs=batch, adapter_name="grpo")
    want = local.forward_backward(inputs=batch, adapter_name="grpo")
    assert torch.equal(got["loss"], want["loss"]) and int(got["num_tokens"]) == int(want["num_tokens"])
    assert model.clip_grad_and_step(adapter_name="grpo") == local.clip_grad_and_step(adapter_name="grpo")
    assert_same_weights(model.get_state_dict(adapter_name="grpo"), local.get_state_dict(adapter_name="grpo"))
    model.close()


# ---------------------------------------------------------------------------------------------- tenants and refusals
def test_tenants_are_isolated_and_bad_requests_leave_the_adapter_alone(server, tokenizer):
    batch = sft_batches(tokenizer, 1)[0]
    alice = remote(server)
    alice.add_adapter_to_model("shared-name", dict(LORA), seed=3)
    alice.set_optimizer("AdamW", adapter_name="shared-name", lr=1e-2)
    alice.forward_backward(inputs=batch, adapter_name="shared-name")
    alice.clip_grad_and_step(adapter_name="shared-name")
    before = alice.get_state_dict(adapter_name="shared-name")

    http_b = httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEY_B}, timeout=60)
    http_a = httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEY_A}, timeout=60)
    try:
        # bob neither sees nor touches alice's adapter
        bob = remote(server, key=KEY_B)
        assert "shared-name" not in bob.adapters()
        response = http_b.post(f"{API}/adapters/shared-name/call", json={"method": "get_state_dict"})
        assert response.status_code == 404
        assert http_b.delete(f"{API}/adapters/shared-name").status_code == 404
        assert http_b.get(f"{API}/adapters/shared-name/checkpoints/final").status_code == 404
        with pytest.raises(NotFound):
            bob.get_state_dict(adapter_name="shared-name")
        bob.add_adapter_to_model("shared-name", dict(LORA), seed=4)  # his own, under the same name
        bob.set_optimizer("AdamW", adapter_name="shared-name", lr=1e-1)
        bob.forward_backward(inputs=batch, adapter_name="shared-name")
        bob.clip_grad_and_step(adapter_name="shared-name")
        bob.remove_adapter("shared-name")

        # a bad key
        assert httpx.get(f"{server.base_url}{API}/models", headers={"X-API-Key": "tml-nobody-00000"}).status_code == 401
        assert httpx.post(f"{server.base_url}{API}/adapters/shared-name/call", json={"method": "step"}).status_code == 401
        with pytest.raises(Unauthorized):
            remote(server, key="tml-wrong-key-000")

        # bad tensor payloads: shape / bytes mismatch, unknown dtype, token ids outside the vocabulary
        short = {"$tensor": {"dtype": "int64", "shape": [2, 8], "data": base64.b64encode(b"\0" * 8).decode()}}
        bad_dtype = {"$tensor": {"dtype": "object", "shape": [1], "data": ""}}
        huge = {"$tensor": {"dtype": "float32", "shape": [1 << 20, 1 << 20], "data": ""}}
        for inputs, message in ((short, "needs 128 bytes"), (bad_dtype, "not accepted"), (huge, "elements")):
            response = http_a.post(f"{API}/adapters/shared-name/call",
                                   json={"method": "forward_backward", "args": {"inputs": {"input_ids": inputs}}})
            assert response.status_code == 400 and message in response.json()["error"], response.text
        out_of_vocab = dict(batch, input_ids=batch["input_ids"] + 1000)
        with pytest.raises(BadRequest, match="vocabulary"):
            alice.forward_backward(inputs=out_of_vocab, adapter_name="shared-name")

        # unknown names: method, loss, optimizer, LoRA options beyond the base's limits
        response = http_a.post(f"{API}/adapters/shared-name/call", json={"method": "__init__"})
        assert response.status_code == 400 and "forward_backward" in response.json()["error"]
        with pytest.raises(BadRequest, match="registered losss?.*cross_entropy"):
            alice.set_loss("no_such_loss", adapter_name="shared-name")
        with pytest.raises(BadRequest, match="AdamW"):
            alice.set_optimizer("Lion", adapter_name="shared-name")
        with pytest.raises(BadRequest, match="'too-big' asks for LoRA rank 32, above max_lora_rank=16"):
            alice.add_adapter_to_model("too-big", {"r": 32, "target_modules": "all-linear"})
        with pytest.raises(BadRequest, match="shared base"):
            alice.add_adapter_to_model("biased", {"r": 4, "target_modules": "all-linear", "bias": "all"})
        assert "too-big" not in alice.adapters()
        with pytest.raises(BadRequest, match="returnable: logits"):  # the base's hidden states stay on the server
            alice.forward_only(inputs=batch, adapter_name="shared-name", return_outputs=["hidden_states"])

        # nothing of that reached alice's adapter
        assert_same_weights(alice.get_state_dict(adapter_name="shared-name"), before)
        assert alice.get_train_configs(adapter_name="shared-name")["step"] == 1

        # a call that outlasts wait_s is a future the client polls
        response = http_a.post(f"{API}/adapters/shared-name/call", json={
            "method": "forward_only", "wait_s": 0, "args": tensor_wire.encode({"inputs": batch})})
        assert response.status_code in (200, 202)
        future = response.json()["future"]
        result = http_a.get(f"{API}/futures/{future}", params={"wait_s": 30}).json()
        assert result["status"] == "done"
        assert http_b.get(f"{API}/futures/{future}").status_code == 404  # not bob's
    finally:
        http_a.close()
        http_b.close()
        alice.close()


# ---------------------------------------------------------------------------------------------- the wire format
def test_tensor_wire_round_trips_and_refuses_what_it_cannot_trust():
    values = {"f": torch.randn(2, 3), "bf": torch.randn(4).to(torch.bfloat16), "i": torch.arange(6).view(2, 3),
              "b": torch.tensor([True, False]), "u8": torch.tensor([0, 255], dtype=torch.uint8),
              "empty": torch.zeros(0, 4), "scalar": torch.tensor(1.5), "nested": [1, "x", None, {"t": torch.ones(1)}]}
    back = tensor_wire.decode(tensor_wire.encode(values))
    for key in ("f", "bf", "i", "b", "u8", "empty", "scalar"):
        assert back[key].dtype == values[key].dtype and torch.equal(back[key], values[key]), key
    assert back["nested"][:3] == [1, "x", None] and torch.equal(back["nested"][3]["t"], torch.ones(1))

    def spec(**fields):
        return {"$tensor": {"dtype": "float32", "shape": [2], "data": base64.b64encode(b"\0" * 8).decode(), **fields}}

    for bad, message in ((spec(dtype="complex64"), "not accepted"), (spec(shape=[3]), "needs 12 bytes"),
                         (spec(shape=[-1]), "non-negative"), (spec(shape=[1 << 40]), "over the limit"),
                         (spec(data="%%%"), "base64"), ({"$tensor": {"dtype": "float32"}}, "exactly dtype"),
                         ({"$tensor": spec()["$tensor"], "x": 1}, "no other key"),
                         (spec(dtype="bool", shape=[8]), None)):
        if message is None:  # eight zero bytes are a valid bool tensor
            assert tensor_wire.decode(bad).dtype == torch.bool
            continue
        with pytest.raises(BadRequest, match=message):
            tensor_wire.decode(bad)
    with pytest.raises(BadRequest, match="0 or 1"):
        tensor_wire.decode({"$tensor": {"dtype": "bool", "shape": [1], "data": base64.b64encode(b"\x07").decode()}})
    with pytest.raises(TypeError, match="reserved"):
        tensor_wire.encode({"$tensor": 1})
    with pytest.raises(TypeError, match="complex"):
        tensor_wire.encode(torch.zeros(1, dtype=torch.complex64))
