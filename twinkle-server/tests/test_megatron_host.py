"""A base model hosted through ``MultiLoraMegatronModel``, driven by the unmodified Tinker SDK against a real
``twinkle serve``: the same tiny Qwen2 directory is hosted twice, on the HF backend and on megatron-core (CPU, one
process), and the Megatron base gives the HF base's log-probs, learns, keeps tenants apart, samples on its Hugging
Face twin exactly like plain ``transformers`` + ``peft`` on the downloaded adapter, and resumes a saved state."""

from __future__ import annotations

import json
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest
from twinkle_server.testing import TINY_QWEN, ServerProcess, quickstart_tokenizer, tiny_server_config

tinker = pytest.importorskip("tinker")
pytest.importorskip("twinkle_backend_megatron")
pytest.importorskip("megatron.core")
types = tinker.types

pytestmark = [pytest.mark.timeout(300)]

ALICE = "tml-alice-megatron-key-1"
BOB = "tml-bob-megatron-key-22"
MEGATRON_BASE, HF_BASE = "tiny/qwen2-megatron", "tiny/qwen2-hf"
TEXTS = ["upper: abc -> ABC", "reverse: abcd -> dcba", "upper: xyz -> XYZ"]
PROMPT = "reverse: abcd ->"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2 (hidden 32, 2 layers) as a Hugging Face directory: both hosts load it."""
    from twinkle_backend_hf.model import TransformersModel

    directory = tmp_path_factory.mktemp("tiny-qwen2")
    TransformersModel(config=dict(TINY_QWEN), seed=0).network.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory, base_dir):
    def entry(name: str, class_name: str) -> dict:
        return {"name": name, "max_lora_rank": 8,
                "model": {"class_name": class_name, "path": str(base_dir), "tokenizer": quickstart_tokenizer()}}

    config = tiny_server_config(tmp_path_factory.mktemp("megatron-serve"), tenants={"alice": ALICE, "bob": BOB},
                                base_models=[entry(MEGATRON_BASE, "MultiLoraMegatronModel"),
                                             entry(HF_BASE, "TransformersModel")])
    with ServerProcess(config) as process:  # stopped (SIGTERM, then SIGKILL) however the module ends
        yield process


@pytest.fixture(scope="module")
def alice(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=ALICE)
    yield client
    client.close("success").result(timeout=60)


@pytest.fixture(scope="module")
def bob(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=BOB)
    yield client
    client.close("success").result(timeout=60)


@pytest.fixture(scope="module")
def tokenizer(alice):
    client = alice.create_lora_training_client(base_model=MEGATRON_BASE, rank=2, seed=0).result()
    return client.get_tokenizer()


@pytest.fixture(scope="module")
def hf_network(base_dir):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()


def datum(tokenizer, text: str):
    ids = tokenizer.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def batch(tokenizer, offset: int) -> list:
    return [datum(tokenizer, TEXTS[(offset + i) % len(TEXTS)]) for i in range(2)]


def train(client, tokenizer, steps: int, *, offset: int = 0, lr: float = 1e-2) -> list[float]:
    losses = []
    for step in range(steps):
        backward = client.forward_backward(batch(tokenizer, offset + step), "cross_entropy")
        stepped = client.optim_step(types.AdamParams(learning_rate=lr, weight_decay=0.01, grad_clip_norm=10.0))
        losses.append(backward.result().metrics["loss:sum"])
        stepped.result()
    return losses


def logprobs(client, tokenizer) -> np.ndarray:
    out = client.forward(batch(tokenizer, 0), "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs]).astype(np.float64)


def test_first_forward_equals_the_hf_hosted_base(alice, tokenizer, hf_network):
    import torch

    from twinkle_core.testing.tolerance import forward_tolerance

    megatron = alice.create_lora_training_client(base_model=MEGATRON_BASE, rank=4, seed=0).result()
    assert megatron.get_info().model_data.arch == "qwen2"  # the Megatron model's Hugging Face config
    hf = alice.create_lora_training_client(base_model=HF_BASE, rank=4, seed=0).result()
    got, want = logprobs(megatron, tokenizer), logprobs(hf, tokenizer)  # B = 0: both are the base model
    # two implementations of one float32 forward: the logits differ by at most forward_tolerance, a log-prob
    # (logit - logsumexp) by at most twice that
    with torch.no_grad():
        magnitude = max(float(hf_network(torch.tensor([tokenizer.encode(t)])).logits.abs().max()) for t in TEXTS[:2])
    bound = 2 * forward_tolerance(magnitude, width=max(TINY_QWEN["hidden_size"],
                                  TINY_QWEN["intermediate_size"]), depth=TINY_QWEN["num_hidden_layers"])
    difference = float(np.abs(got - want).max())
    print(f"megatron vs hf base log-probs: max |diff| {difference:.3g} (bound {bound:.3g})")
    assert difference <= bound, (difference, bound)


def test_sft_learns_and_tenants_stay_isolated(server, alice, bob, tokenizer):
    mine = alice.create_lora_training_client(base_model=MEGATRON_BASE, rank=8, seed=1).result()
    theirs = bob.create_lora_training_client(base_model=MEGATRON_BASE, rank=8, seed=1).result()
    bob_before = logprobs(theirs, tokenizer)
    losses = train(mine, tokenizer, 5)
    assert losses[-1] < 0.7 * losses[0] and sum(b < a for a, b in zip(losses, losses[1:])) >= 4, losses
    np.testing.assert_array_equal(logprobs(theirs, tokenizer), bob_before)  # alice's steps never reach bob
    alice_now = logprobs(mine, tokenizer)
    train(theirs, tokenizer, 2, offset=1)
    np.testing.assert_array_equal(logprobs(mine, tokenizer), alice_now)
    assert np.abs(logprobs(theirs, tokenizer) - bob_before).max() > 1e-3  # bob's own steps do change bob
    with pytest.raises(tinker.NotFoundError):  # nor can bob see alice's run
        tinker.RestClient(base_url=server.base_url, api_key=BOB).get_training_run(mine.model_id).result()


def test_sampler_greedy_equals_peft_on_the_downloaded_adapter(server, alice, tokenizer, base_dir, tmp_path):
    import torch
    import transformers
    from peft import PeftModel

    client = alice.create_lora_training_client(base_model=MEGATRON_BASE, rank=8, seed=2).result()
    train(client, tokenizer, 4, lr=2e-2)
    sampler_path = client.save_weights_for_sampler("for-sampling").result().path
    export_path = client.save_weights_external("for-download").result().path
    urls = tinker.RestClient(base_url=server.base_url, api_key=ALICE).get_external_weights_urls(export_path).result()
    for name, url in urls.urls.items():  # the SDK's download path: signed per-file URLs
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=30) as response:
            (tmp_path / name).write_bytes(response.read())
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path)).eval()  # a plain PEFT adapter, the LM head's included
    assert any("lm_head.lora_A" in name for name, _ in model.named_parameters())

    prompt_ids, n = tokenizer.encode(PROMPT), 12
    ids, local_lp = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(n):
            step = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            ids.append(int(torch.argmax(step)))
            local_lp.append(float(step[ids[-1]]))
    sampler = alice.create_sampling_client(model_path=sampler_path).result()
    params = types.SamplingParams(max_tokens=n, temperature=0.0, stop=[])
    sequence = sampler.sample(types.ModelInput.from_ints(prompt_ids), 1, params).result().sequences[0]
    assert list(sequence.tokens) == ids[len(prompt_ids):]
    np.testing.assert_allclose(sequence.logprobs, local_lp, rtol=1e-4, atol=1e-4)
    # the twin scores what the Megatron model trains: compute_logprobs equals the training forward's log-probs
    text = tokenizer.encode(TEXTS[0])
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(text)).result()
    trained = client.forward([datum(tokenizer, TEXTS[0])], "cross_entropy").result()
    np.testing.assert_allclose(scored[1:], trained.loss_fn_outputs[0]["logprobs"].to_numpy(), rtol=1e-4, atol=1e-4)


def test_native_client_samples_a_megatron_adapter_with_its_current_weights(server, base_dir, tmp_path):
    """The native client trains an adapter of the Megatron base, then samples it: the host exports the adapter's
    current weights to its Hugging Face twin for the call, so greedy tokens equal plain transformers + peft on the
    adapter the client downloads."""
    import torch
    import transformers
    from peft import PeftModel
    from twinkle_server.client import TransformersModel

    from twinkle_core.constants import IGNORE_INDEX

    ids = torch.randint(1, 262, (2, 8), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    batch["labels"][:, :2] = IGNORE_INDEX
    remote = TransformersModel(model_id=MEGATRON_BASE, base_url=server.base_url, api_key=ALICE)
    try:
        remote.add_adapter_to_model("n", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "lm_head"]},
                                    seed=1)
        remote.set_loss("cross_entropy")
        remote.set_optimizer("AdamW", lr=5e-2)
        for _ in range(3):
            remote.forward_backward(inputs=batch)
            remote.clip_grad_and_step(max_grad_norm=1.0)
        path = remote.save("native-final", output_dir=str(tmp_path), save_optimizer=False)
        prompt, n = [5, 6, 7], 6
        got = remote.sample([prompt], max_new_tokens=n, temperature=0.0, seed=0)[0][0]
    finally:
        remote.close()
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, path).eval()
    want = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            want.append(int(model(torch.tensor([want])).logits[0, -1].argmax()))
    assert list(got.token_ids) == want[len(prompt):]


def test_save_state_then_load_state_repeats_the_same_losses(alice, tokenizer):
    client = alice.create_lora_training_client(base_model=MEGATRON_BASE, rank=8, seed=3).result()
    train(client, tokenizer, 2)
    saved = client.save_state("after-2").result().path
    continued = train(client, tokenizer, 3, offset=2)
    with warnings.catch_warnings():  # load_state* are deprecated in the SDK, still sent as load_weights
        warnings.simplefilter("ignore", FutureWarning)
        client.load_state_with_optimizer(saved).result()
    assert train(client, tokenizer, 3, offset=2) == pytest.approx(continued, rel=1e-6)
    resumed = alice.create_training_client_from_state_with_optimizer(saved).result()
    assert train(resumed, tokenizer, 3, offset=2) == pytest.approx(continued, rel=1e-6)


def test_lora_switches_pick_the_megatron_layers_of_their_kind(server, alice):
    import safetensors.torch

    rest = tinker.RestClient(base_url=server.base_url, api_key=ALICE)
    for switches, leaves in (({"train_mlp": False, "train_unembed": False}, {"q_proj", "k_proj", "v_proj", "o_proj"}),
                             ({"train_attn": False, "train_unembed": False}, {"gate_proj", "up_proj", "down_proj"}),
                             ({"train_attn": False, "train_mlp": False}, {"lm_head"})):
        client = alice.create_lora_training_client(base_model=MEGATRON_BASE, rank=2, **switches).result()
        urls = rest.get_external_weights_urls(client.save_weights_external("switches").result().path).result().urls
        with urllib.request.urlopen(urls["adapter_config.json"], timeout=30) as response:
            assert set(json.loads(response.read())["target_modules"]) == leaves, switches
        with urllib.request.urlopen(urls["adapter_model.safetensors"], timeout=30) as response:
            adapted = {key.split(".lora_")[0].rsplit(".", 1)[-1] for key in safetensors.torch.load(response.read())}
        assert adapted == leaves, switches


def test_a_config_built_megatron_base_samples_on_a_twin_of_its_weights(tmp_path):
    """In process: a ``config`` base (random init) gets the Megatron model's own tensors in its twin."""
    import torch
    from twinkle_server.host import ModelHost

    from twinkle_core.testing.isolation import process_group_scope

    def end_megatron_groups() -> None:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()

    with process_group_scope(before_destroy=end_megatron_groups):  # the backend's one-rank group ends with the test
        host = ModelHost("tiny", {"class_name": "MegatronModel", "config": dict(TINY_QWEN), "seed": 5,
                                  "tokenizer": quickstart_tokenizer()}, state_dir=tmp_path, max_lora_rank=4)
        assert type(host.model).__name__ == "MultiLoraMegatronModel"
        twin = host.samplers.model
        assert twin is not host.model and type(twin).__name__ == "MultiLoraTransformersModel"
        mine = host.model.get_state_dict()
        for key, value in twin.network.state_dict().items():
            if "lora_" not in key:  # the pool's base adapter (B = 0) is the twin's own
                assert torch.equal(value, mine[key.replace(".base_layer", "")]), key
