"""The unmodified Tinker SDK (0.38) against a real ``twinkle serve`` process: an SFT loop that learns, every built-in
loss equal to its documented formula, save/load that resumes exactly, sampling that reproduces in-process greedy
decoding of the downloaded PEFT adapter, and tenants that cannot see each other."""

from __future__ import annotations

import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest
from twinkle_server.testing import TINY_BASE, TINY_QWEN, ServerProcess, tiny_server_config

tinker = pytest.importorskip("tinker")
types = tinker.types

pytestmark = [pytest.mark.timeout(300)]

ALICE = "tml-alice-sdk-key-1"
BOB = "tml-bob-sdk-key-22"
PROMPT, COMPLETION = "upper: abc ->", " ABC"
TEXTS = ["upper: abc -> ABC", "reverse: abcd -> dcba", "upper: xyz -> XYZ"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tiny_server_config(tmp_path_factory.mktemp("tinker-sdk"), tenants={"alice": ALICE, "bob": BOB})
    with ServerProcess(config) as process:  # stopped (SIGTERM, then SIGKILL) however the module ends
        yield process


@pytest.fixture(scope="module")
def alice(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=ALICE)
    yield client
    client.close("success").result(timeout=60)  # /sessions/<id>/finish and the telemetry flush


@pytest.fixture(scope="module")
def tokenizer(alice):
    # get_info's tokenizer_id names the server's local tokenizer directory: the SDK loads it without a hub
    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=0).result()
    return client.get_tokenizer()


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def sft_datum(tokenizer, prompt: str, completion: str):
    """As tinker-cookbook builds one: inputs tokens[:-1], targets tokens[1:], weight 1 on the completion only."""
    prompt_ids = tokenizer.encode(prompt)
    ids = prompt_ids + tokenizer.encode(completion)
    weights = [0.0] * len(prompt_ids) + [1.0] * (len(ids) - len(prompt_ids))
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": types.TensorData(data=ids[1:], dtype="int64"),
                                       "weights": types.TensorData(data=weights[1:], dtype="float32")})


def text_datum(tokenizer, text: str):
    ids = tokenizer.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def train(client, tokenizer, steps: int, *, lr: float = 1e-2, offset: int = 0) -> list[float]:
    losses = []
    for step in range(steps):
        batch = [text_datum(tokenizer, TEXTS[(offset + step + i) % len(TEXTS)]) for i in range(2)]
        backward = client.forward_backward(batch, "cross_entropy")
        stepped = client.optim_step(types.AdamParams(learning_rate=lr, weight_decay=0.01, grad_clip_norm=10.0))
        losses.append(backward.result().metrics["loss:sum"])
        stepped.result()
    return losses


def greedy(sampler, prompt_ids: list[int], n: int) -> list[int]:
    params = types.SamplingParams(max_tokens=n, temperature=0.0, stop=[])  # stop=[]: no EOS stop, exactly n tokens
    return list(sampler.sample(types.ModelInput.from_ints(prompt_ids), 1, params).result().sequences[0].tokens)


# ---------------------------------------------------------------------------------------------------------------
# 1. SFT
# ---------------------------------------------------------------------------------------------------------------
def test_sft_loop_learns_and_greedy_samples_improve(server, alice, tokenizer):
    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=8, seed=0).result()
    info = client.get_info()
    assert info.model_data.model_name == TINY_BASE and info.lora_rank == 8 and info.is_lora
    prompt_ids, target = tokenizer.encode(PROMPT), tokenizer.encode(COMPLETION)
    datum = sft_datum(tokenizer, PROMPT, COMPLETION)
    full = types.ModelInput.from_ints(prompt_ids + target)

    before = client.save_weights_and_get_sampling_client().result()  # an ephemeral snapshot of the fresh adapter
    greedy_before = greedy(before, prompt_ids, len(target))
    target_lp_before = sum(before.compute_logprobs(full).result()[-len(target):])

    losses = []
    for _ in range(10):
        backward = client.forward_backward([datum], "cross_entropy")
        stepped = client.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(backward.result().metrics["loss:sum"])
        assert stepped.result().metrics["learning_rate"] == pytest.approx(1e-2)
    assert losses[-1] < 0.3 * losses[0], losses
    # the snapshot scores the target as the first forward did: the sampling and training paths agree
    assert target_lp_before == pytest.approx(-losses[0], rel=1e-4)
    assert sum(b < a for a, b in zip(losses, losses[1:])) >= 7, losses

    saved = client.save_weights_for_sampler("sft-final").result()
    assert saved.path.startswith("tinker://") and saved.path.endswith("/sampler_weights/sft-final")
    after = alice.create_sampling_client(model_path=saved.path).result()
    assert after.get_base_model() == TINY_BASE
    greedy_after = greedy(after, prompt_ids, len(target))
    target_lp_after = sum(after.compute_logprobs(full).result()[-len(target):])
    assert target_lp_after > target_lp_before + 2.0
    matched = lambda tokens: sum(a == b for a, b in zip(tokens, target))  # noqa: E731
    assert matched(greedy_after) > matched(greedy_before) or greedy_after == target, (greedy_before, greedy_after)

    # the checkpoint listing shows it; the snapshot taken before training is unchanged by the steps since
    listed = tinker.RestClient(base_url=server.base_url, api_key=ALICE).list_checkpoints(client.model_id).result()
    assert [c.checkpoint_id for c in listed.checkpoints] == ["sampler_weights/sft-final"]
    assert listed.checkpoints[0].checkpoint_type == "sampler" and listed.checkpoints[0].size_bytes > 0
    assert greedy(before, prompt_ids, len(target)) == greedy_before


# ---------------------------------------------------------------------------------------------------------------
# 2. every built-in loss equals its documented formula on the returned logprobs
# ---------------------------------------------------------------------------------------------------------------
def _expected(loss_fn: str, lp: np.ndarray, x: dict[str, np.ndarray], config: dict[str, float]) -> np.ndarray:
    """The per-token terms of Tinker's documented losses (their sum is ``loss:sum``)."""
    if loss_fn == "cross_entropy":
        return -x["weights"] * lp
    q, adv = x["logprobs"], x["advantages"]
    ratio = np.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -ratio * adv
    if loss_fn == "ppo":
        lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        return -np.minimum(ratio * adv, np.clip(ratio, lo, hi) * adv)
    if loss_fn == "cispo":
        lo, hi = config.get("clip_low_threshold", 0.0), config.get("clip_high_threshold", 4.0)
        return -np.clip(ratio, lo, hi) * lp * adv
    if loss_fn == "dro":
        beta = config.get("beta", 0.05)
        return -(lp * adv - 0.5 * beta * (lp - q) ** 2)
    if loss_fn == "gspo":
        marked = x["sequence_ratio_mask"] != 0
        seq_ratio = np.exp(np.mean((lp - q)[marked]))
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        return -np.minimum(seq_ratio * adv, np.clip(seq_ratio, lo, hi) * adv)
    raise AssertionError(loss_fn)


LOSSES = [("cross_entropy", None), ("importance_sampling", None), ("ppo", None),
          ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}), ("cispo", None),
          ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}), ("dro", None), ("dro", {"beta": 0.3}),
          ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02})]


def test_each_loss_equals_its_formula_on_the_returned_logprobs(alice, tokenizer):
    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=3).result()
    base = alice.create_sampling_client(base_model=TINY_BASE).result()
    rng = np.random.default_rng(0)
    ids = [tokenizer.encode(t) for t in TEXTS[:2]]  # two lengths: the server pads, the outputs come back trimmed
    inputs = []
    for tokens in ids:
        n = len(tokens) - 1
        inputs.append({"target_tokens": np.array(tokens[1:], dtype=np.int64),
                       "weights": rng.uniform(0.0, 1.0, n).astype(np.float32),
                       "logprobs": rng.uniform(-6.0, -4.0, n).astype(np.float32),
                       "advantages": rng.normal(0.0, 1.0, n).astype(np.float32),
                       "sequence_ratio_mask": (np.arange(n) >= n // 2).astype(np.float32)})
    needs = {"cross_entropy": ("target_tokens", "weights")}
    rl = ("target_tokens", "logprobs", "advantages")
    reference_lp = None
    for loss_fn, config in LOSSES:
        keys = needs.get(loss_fn, rl + (("sequence_ratio_mask",) if loss_fn == "gspo" else ()))
        data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={k: types.TensorData.from_numpy(x[k]) for k in keys})
                for tokens, x in zip(ids, inputs)]
        out = client.forward_backward(data, loss_fn, config).result()  # no optim_step: the weights never change
        total = 0.0
        for datum_out, x, tokens in zip(out.loss_fn_outputs, inputs, ids):
            lp = datum_out["logprobs"].to_numpy()
            assert lp.shape == (len(tokens) - 1,)
            expected = _expected(loss_fn, lp.astype(np.float64), {k: v.astype(np.float64) for k, v in x.items()},
                                 config or {})
            np.testing.assert_allclose(datum_out["elementwise_loss"].to_numpy(), expected, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{loss_fn} {config}")
            total += float(expected.sum())
        assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-4, abs=1e-4), (loss_fn, config)
        joined = np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
        if reference_lp is None:
            reference_lp = joined
            # a fresh adapter is the base model (B = 0): the sampler's prompt logprobs are the same numbers,
            # one position later (Tinker's targets are aligned with the inputs, compute_logprobs' are not)
            for datum_out, tokens in zip(out.loss_fn_outputs, ids):
                scored = base.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
                assert scored[0] is None
                np.testing.assert_allclose(datum_out["logprobs"].to_numpy(), scored[1:], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(joined, reference_lp, rtol=1e-6, atol=1e-6)

    forward = client.forward([data[0]], "gspo", LOSSES[-1][1]).result()  # forward: same numbers, no gradient
    assert forward.metrics["loss:sum"] == pytest.approx(
        float(forward.loss_fn_outputs[0]["elementwise_loss"].to_numpy().sum()), rel=1e-5, abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# 3. save_state / load_state
# ---------------------------------------------------------------------------------------------------------------
def test_save_state_then_load_state_repeats_the_same_losses(server, alice, tokenizer):
    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=8, seed=1).result()
    train(client, tokenizer, 2)
    saved = client.save_state("after-2", user_metadata={"note": "two steps"}).result().path
    assert saved.endswith("/weights/after-2")
    continued = train(client, tokenizer, 3, offset=2)

    with warnings.catch_warnings():  # load_state* are deprecated in the SDK, still sent as load_weights
        warnings.simplefilter("ignore", FutureWarning)
        client.load_state_with_optimizer(saved).result()
        assert train(client, tokenizer, 3, offset=2) == pytest.approx(continued, rel=1e-6)
        client.load_state(saved).result()  # weights only: a fresh Adam
        fresh_adam = train(client, tokenizer, 3, offset=2)
    assert fresh_adam[0] == pytest.approx(continued[0], rel=1e-6)  # same weights at the first step
    assert fresh_adam[1:] != pytest.approx(continued[1:], rel=1e-6)  # the optimizer state was not restored

    resumed = alice.create_training_client_from_state_with_optimizer(saved).result()
    assert resumed.model_id != client.model_id and resumed.get_info().lora_rank == 8
    assert train(resumed, tokenizer, 3, offset=2) == pytest.approx(continued, rel=1e-6)
    weights_only = alice.create_training_client_from_state(saved).result()
    assert train(weights_only, tokenizer, 3, offset=2) == pytest.approx(fresh_adam, rel=1e-6)

    rest = tinker.RestClient(base_url=server.base_url, api_key=ALICE)
    listed = rest.list_checkpoints(client.model_id).result().checkpoints
    assert [(c.checkpoint_type, c.checkpoint_id) for c in listed] == [("training", "weights/after-2")]
    assert listed[0].user_metadata == {"note": "two steps"}
    run = rest.get_training_run_by_tinker_path(saved).result()
    assert run.training_run_id == client.model_id and run.last_checkpoint.tinker_path == saved
    assert rest.get_weights_info_by_tinker_path(saved).result().lora_rank == 8
    with pytest.raises(tinker.BadRequestError, match="already exists"):
        client.save_state("after-2").result()


# ---------------------------------------------------------------------------------------------------------------
# 4. sampling reproduces in-process greedy decoding of the downloaded adapter
# ---------------------------------------------------------------------------------------------------------------
def test_sampling_matches_in_process_greedy_of_the_downloaded_adapter(server, alice, tokenizer, tmp_path: Path):
    import torch
    import transformers
    from peft import PeftModel

    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=8, seed=2).result()
    train(client, tokenizer, 4, lr=2e-2)
    sampler_path = client.save_weights_for_sampler("for-sampling").result().path
    export_path = client.save_weights_external("for-download").result().path

    # the SDK's download path (what `tinker checkpoint download` does): signed per-file URLs, fetched without a key
    rest = tinker.RestClient(base_url=server.base_url, api_key=ALICE)
    urls = rest.get_external_weights_urls(export_path).result().urls
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(urls)
    for name, url in urls.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url, timeout=30) as response:
            (tmp_path / name).write_bytes(response.read())

    torch.manual_seed(0)  # the server's base: the same config, built with seed 0
    config = transformers.AutoConfig.for_model(**TINY_QWEN)
    model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_config(config), str(tmp_path)).eval()

    prompt_ids = tokenizer.encode("reverse: abcd ->")
    n = 12
    ids, local_lp = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(n):
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            token = int(torch.argmax(logprobs))
            local_lp.append(float(logprobs[token]))
            ids.append(token)
        full_lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    local_tokens = ids[len(prompt_ids):]

    sampler = alice.create_sampling_client(model_path=sampler_path).result()
    params = types.SamplingParams(max_tokens=n, temperature=0.0, stop=[])
    result = sampler.sample(types.ModelInput.from_ints(prompt_ids), 2, params).result()
    for seq in result.sequences:
        assert list(seq.tokens) == local_tokens
        assert seq.stop_reason == "length"
        np.testing.assert_allclose(seq.logprobs, local_lp, rtol=1e-4, atol=1e-4)
    assert len({s.sequence_id for s in result.sequences}) == 2

    scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    expected = [float(full_lp[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert scored[0] is None
    np.testing.assert_allclose(scored[1:], expected, rtol=1e-4, atol=1e-4)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(ids), prompt_logprobs_last_n=3).result()
    assert last[:-3] == [None] * (len(ids) - 3)
    np.testing.assert_allclose(last[-3:], expected[-3:], rtol=1e-4, atol=1e-4)

    # a seed fixes a temperature-1 sample; a stop token ends it (kept, stop_reason "stop")
    seeded = types.SamplingParams(max_tokens=8, temperature=1.0, seed=1234, stop=[])
    first, second = (sampler.sample(types.ModelInput.from_ints(prompt_ids), 1, seeded).result() for _ in range(2))
    assert first.sequences[0].tokens == second.sequences[0].tokens
    stop_at = local_tokens[2]
    stopped = sampler.sample(types.ModelInput.from_ints(prompt_ids), 1, types.SamplingParams(
        max_tokens=n, temperature=0.0, stop=[stop_at])).result().sequences[0]
    assert stopped.stop_reason == "stop" and list(stopped.tokens) == local_tokens[:local_tokens.index(stop_at) + 1]


# ---------------------------------------------------------------------------------------------------------------
# 5. tenants, authentication, refusals
# ---------------------------------------------------------------------------------------------------------------
def test_tenants_are_isolated_and_keys_required(server, alice, tokenizer):
    import httpx

    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=4).result()
    state_path = client.save_state("private").result().path
    sampler_path = client.save_weights_for_sampler("private-sampler").result().path
    export_path = client.save_weights_external("private-export").result().path

    bob = tinker.ServiceClient(base_url=server.base_url, api_key=BOB)
    try:
        bob_rest = tinker.RestClient(base_url=server.base_url, api_key=BOB)
        with pytest.raises(tinker.NotFoundError):
            bob_rest.get_training_run(client.model_id).result()
        with pytest.raises(tinker.NotFoundError):
            bob_rest.list_checkpoints(client.model_id).result()
        with pytest.raises(tinker.NotFoundError):
            bob_rest.get_external_weights_urls(export_path).result()
        with pytest.raises(tinker.NotFoundError):
            bob.create_sampling_client(model_path=sampler_path).result()
        with pytest.raises(tinker.NotFoundError):
            bob.create_training_client_from_state(state_path).result()
        assert bob_rest.list_training_runs().result().training_runs == []
        assert bob_rest.list_user_checkpoints().result().checkpoints == []
    finally:
        bob.close("success").result(timeout=60)

    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        alice_headers, bob_headers = {"X-API-Key": ALICE}, {"X-API-Key": BOB}
        missing = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"})
        assert missing.status_code == 401 and "API key" in missing.json()["error"]
        assert http.post("/api/v1/get_info", json={"model_id": client.model_id},
                         headers={"X-API-Key": "tml-nobody-key-000"}).status_code == 401
        assert http.post("/api/v1/get_info", json={"model_id": client.model_id},
                         headers=bob_headers).status_code == 404
        # a future is its tenant's: another tenant's retrieve answers 404, as for an unknown id
        prompt = {"chunks": [{"type": "encoded_text", "tokens": tokenizer.encode("abc")}]}
        submitted = http.post("/api/v1/asample", headers=alice_headers, json={
            "base_model": TINY_BASE, "prompt": prompt, "num_samples": 1,
            "sampling_params": {"max_tokens": 2, "temperature": 0.0}}).json()
        assert http.post("/api/v1/retrieve_future", json={"request_id": submitted["request_id"]},
                         headers=bob_headers).status_code == 404
        done = http.post("/api/v1/retrieve_future", json={"request_id": submitted["request_id"]},
                         headers=alice_headers)
        assert done.status_code == 200 and done.headers["content-type"] == "application/x-protobuf"
        # a tampered download link is refused
        url = tinker.RestClient(base_url=server.base_url, api_key=ALICE).get_external_weights_urls(
            export_path).result().urls["adapter_config.json"]
        token = url.split("/checkpoint_files/")[1].split("/")[0]
        forged = url.replace(token, token[:-1] + ("0" if token[-1] != "0" else "1"))
        assert http.get(forged).status_code == 404

    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.base_url, api_key="tml-nobody-key-000").create_lora_training_client(
            base_model=TINY_BASE, rank=4).result()


def test_unsupported_requests_are_refused_by_name(alice, tokenizer):
    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=5).result()
    datum = text_datum(tokenizer, TEXTS[0])
    with pytest.raises(tinker.BadRequestError, match="custom"):
        client.forward_backward([datum], "custom").result()
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce"):
        client.forward_backward([datum], "stable_reinforce").result()
    with pytest.raises(tinker.BadRequestError, match="unknown loss_fn_config"):
        client.forward_backward([datum], "cross_entropy", {"beta": 1.0}).result()
    with pytest.raises(tinker.BadRequestError, match="dimuon"):
        alice.create_lora_training_client(base_model=TINY_BASE, rank=4,
                                          optimizer=types.DimuonOptimizerConfig()).result()
    with pytest.raises(tinker.NotFoundError, match="not hosted"):
        alice.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="max_lora_rank"):
        alice.create_lora_training_client(base_model=TINY_BASE, rank=64).result()
    sampler = alice.create_sampling_client(base_model=TINY_BASE).result()
    with pytest.raises(tinker.BadRequestError, match="top-k"):
        sampler.sample(types.ModelInput.from_ints(tokenizer.encode("abc")), 1, types.SamplingParams(max_tokens=2),
                       topk_prompt_logprobs=2).result()
    # the client that saw the refusals still trains
    assert train(client, tokenizer, 1)[0] > 0


# ---------------------------------------------------------------------------------------------------------------
# 6. wire details the SDK relies on: zstd bodies, retried POSTs, the retrieve_futures poller
# ---------------------------------------------------------------------------------------------------------------
def test_zstd_bodies_retried_posts_and_retrieve_futures(server, alice, tokenizer):
    import time

    import httpx
    import zstandard
    from tinker.proto.request_conv import forward_backward_request_to_proto
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=6).result()
    data = [text_datum(tokenizer, text) for text in TEXTS]
    expected = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
    message = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
        model_id=client.model_id, seq_id=10_000))
    message.forward_only = True
    headers = {"X-API-Key": ALICE, "Content-Type": "application/x-protobuf"}

    def retrieve(http, request_id: str) -> httpx.Response:
        for _ in range(100):
            response = http.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)
            if response.headers["content-type"] != "application/json" or "try_again" not in response.text:
                return response
            time.sleep(0.05)
        raise AssertionError(f"{request_id} never finished")

    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        body = zstandard.ZstdCompressor().compress(message.SerializeToString())
        first = http.post("/api/v1/forward_backward", content=body, headers={**headers, "Content-Encoding": "zstd"})
        again = http.post("/api/v1/forward_backward", content=body, headers={**headers, "Content-Encoding": "zstd"})
        assert first.status_code == 200 and again.json()["request_id"] == first.json()["request_id"]  # not run twice
        out = deserialize_forward_backward_output(retrieve(http, first.json()["request_id"]).content)
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
        assert [len(o["logprobs"].data) for o in out.loss_fn_outputs] == [len(d.model_input.to_ints()) for d in data]

        # retrieve_futures: the per-session completion queue the SDK polls when its client config asks for it
        session_id = http.post("/api/v1/create_session", headers=headers, json={
            "tags": [], "user_metadata": {}, "sdk_version": tinker.__version__}).json()["session_id"]
        sampler = http.post("/api/v1/create_sampling_session", headers=headers, json={
            "session_id": session_id, "sampling_session_seq_id": 0, "base_model": TINY_BASE}).json()
        prompt = {"chunks": [{"type": "encoded_text", "tokens": tokenizer.encode("abc")}]}
        submitted = []
        for seq_id in (1, 2):
            response = http.post("/api/v1/asample", headers=headers, json={
                "sampling_session_id": sampler["sampling_session_id"], "seq_id": seq_id, "num_samples": 2,
                "prompt": prompt, "sampling_params": {"max_tokens": 3, "temperature": 0.0}}).json()
            assert len(response["sample_sequence_ids"]) == 2
            submitted.append(response["request_id"])
        seen, cursor = [], 0
        target = {"type": "sampling_session", "sampling_session_id": sampler["sampling_session_id"]}
        while len(seen) < 2:
            polled = http.post("/api/v1/retrieve_futures", headers=headers,
                               json={"target": target, "prev_cursor": cursor}).json()
            seen += [(c["state"], c["request_id"]) for c in polled["completions"]]
            cursor = polled["cursor"]
        assert sorted(seen) == sorted(("finished", r) for r in submitted)
        idle = http.post("/api/v1/retrieve_futures", headers=headers,
                         json={"target": target, "prev_cursor": cursor, "timeout": 0}).json()
        assert idle == {"completions": [], "cursor": cursor}
        sampled = deserialize_sample_response(retrieve(http, submitted[0]).content)
        assert len(sampled.sequences) == 2 and all(len(s.tokens) == 3 for s in sampled.sequences)


# ---------------------------------------------------------------------------------------------------------------
# 7. inflight sampling clients, checkpoint management, sessions
# ---------------------------------------------------------------------------------------------------------------
def test_inflight_samplers_checkpoint_management_and_sessions(server, alice, tokenizer):
    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=4, seed=7).result()
    probe = types.ModelInput.from_ints(tokenizer.encode(TEXTS[0]))
    first = client.save_weights_and_get_sampling_client(kind="inflight").result()
    before = first.compute_logprobs(probe).result()
    train(client, tokenizer, 2)
    second = client.save_weights_and_get_sampling_client(kind="inflight").result()
    # inflight: a later save updates the weights of the run's earlier inflight clients too
    after_two = second.compute_logprobs(probe).result()
    assert first.compute_logprobs(probe).result() == after_two != before
    snapshot = client.save_weights_and_get_sampling_client().result()
    train(client, tokenizer, 1)
    client.save_weights_and_get_sampling_client(kind="inflight").result()
    assert first.compute_logprobs(probe).result() == second.compute_logprobs(probe).result() != after_two
    assert snapshot.compute_logprobs(probe).result() == after_two  # a snapshot keeps its weights

    rest = tinker.RestClient(base_url=server.base_url, api_key=ALICE)
    path = client.save_weights_for_sampler("to-delete").result().path
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(client.model_id).result().checkpoints == []
    with pytest.raises(tinker.NotFoundError):
        alice.create_sampling_client(model_path=path).result()
    again = client.save_weights_for_sampler("to-delete").result().path  # the name is free again, fresh weights
    assert alice.create_sampling_client(model_path=again).result().compute_logprobs(probe).result() == \
        first.compute_logprobs(probe).result()

    session_id = alice.holder.get_session_id()
    session = rest.get_session(session_id).result()
    assert client.model_id in session.training_run_ids and session.sampler_ids
    assert session_id in rest.list_sessions().result().sessions
    runs = rest.list_training_runs(limit=100).result()
    assert client.model_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count == len(runs.training_runs)
