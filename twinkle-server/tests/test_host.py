"""``ModelHost`` on a tiny qwen2 built from its config: Tinker's training semantics (sum losses, Adam's parameters),
checkpoints, plain-PEFT export, sampling, tenant isolation and the refusal of bad requests."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from twinkle_backend_hf.testing import tiny_qwen2_config
from twinkle_server.errors import BadRequest, NotFound, TooManyRequests
from twinkle_server.host import STATE_MARKER, AdamStep, Datum, ModelHost, SampleParams
from twinkle_server.tinker_losses import UnsupportedLoss

TOKENIZER = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart" / "tokenizer")
CONFIG = tiny_qwen2_config(vocab_size=262)
STEP = AdamStep(learning_rate=5e-3)


def make_host(tmp_path: Path, **options) -> ModelHost:
    return ModelHost("tiny", {"config": dict(CONFIG), "tokenizer": TOKENIZER}, state_dir=tmp_path,
                     max_lora_rank=8, **options)


@pytest.fixture
def host(tmp_path):
    return make_host(tmp_path)


def tokens(host, text):
    return host.tokenizer(text)["input_ids"]


def sft(host, text="hello twinkle, hello tinker", weights=None):
    """A next-token datum: targets are the following token (aligned with the positions, no shift)."""
    ids = tokens(host, text)
    weights = [1.0] * (len(ids) - 1) if weights is None else weights
    return Datum(tokens=ids[:-1], loss_fn_inputs={"target_tokens": ids[1:], "weights": weights})


def rl(host, text="reward me", advantage=1.0, logprob=-2.0):
    ids = tokens(host, text)
    n = len(ids) - 1
    return Datum(tokens=ids[:-1], loss_fn_inputs={"target_tokens": ids[1:], "logprobs": [logprob] * n,
                                                  "advantages": [advantage] * n})


def weights(host, adapter):
    name = host.model_adapter_name(adapter)
    # keyed without the adapter's name inside the model, so that two adapters' weights compare
    return {k.replace(f".{name}.", "."): v.detach().clone()
            for k, v in host.model.get_state_dict(adapter_name=name).items()}


def params(host, adapter):
    return host.model.trainable_parameters(adapter_name=host.model_adapter_name(adapter))


def assert_bitwise(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def assert_changed(a, b):
    assert any(not torch.equal(a[k], b[k]) for k in a)


def train(host, adapter, steps, data=None, step=STEP):
    losses = []
    for _ in range(steps):
        result = host.forward_backward(adapter, data or [sft(host)], "cross_entropy")
        host.optim_step(adapter, step)
        losses.append(result.metrics["loss:sum"])
    return losses


def manual_logprobs(host, adapter_name, ids, targets):
    """log_softmax(logits)[t, target_t] of one unpadded sequence, by the model's public forward."""
    logits = host.model.forward_only(inputs={"input_ids": torch.tensor([ids])}, adapter_name=adapter_name)["logits"]
    return torch.log_softmax(logits[0].float(), -1).gather(-1, torch.tensor(targets)[:, None]).squeeze(-1)


def expected_after_step(host, adapter, step: AdamStep):
    """AdamW by hand (decoupled weight decay, bias correction) from the host's optimizer state and the accumulated
    gradients, clipped as ``clip_grad_norm_`` clips them: the weights ``optim_step`` must produce, and the norm."""
    live = params(host, adapter)
    state = host.model.train_state(host.model_adapter_name(adapter)).optimizer.state
    grads = [p.grad.detach().clone() for p in live]
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    if step.grad_clip_norm > 0:
        grads = [g * min(1.0, step.grad_clip_norm / (norm + 1e-6)) for g in grads]
    b1, b2, lr = step.beta1, step.beta2, step.learning_rate
    expected = []
    for p, g in zip(live, grads):
        s = state[p]
        t = float(s["step"]) + 1
        m = b1 * s["exp_avg"] + (1 - b1) * g
        v = b2 * s["exp_avg_sq"] + (1 - b2) * g * g
        update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + step.eps)
        expected.append(p.detach() * (1 - lr * step.weight_decay) - lr * update)
    return expected, norm


# ---------------------------------------------------------------------------------------------------- training
def test_sft_with_cross_entropy_makes_the_loss_fall(host):
    host.create_adapter("a", rank=4, seed=0)
    losses = train(host, "a", 8)
    assert losses[-1] < 0.6 * losses[0]
    assert host.adapter_settings("a")["step"] == 8


def test_two_forward_backward_calls_sum_their_gradients_until_optim_step(host):
    host.create_adapter("a", rank=4, seed=0)
    train(host, "a", 1)  # LoRA's B starts at 0 (A's gradient too): one step makes every gradient non-zero
    first, second = [sft(host, "first batch")], [sft(host, "the second, longer batch"), sft(host, "and a third")]
    name = host.model_adapter_name("a")
    # by hand: d(sum of both requests' summed losses) / d(weights)
    total = 0.0
    for datum in [*first, *second]:
        logits = host.model.forward(inputs={"input_ids": torch.tensor([datum.tokens])}, adapter_name=name)["logits"]
        picked = torch.log_softmax(logits[0].float(), -1).gather(
            -1, torch.tensor(datum.loss_fn_inputs["target_tokens"])[:, None]).squeeze(-1)
        total = total - (picked * torch.tensor(datum.loss_fn_inputs["weights"])).sum()
    manual = torch.autograd.grad(total, params(host, "a"))
    r1 = host.forward_backward("a", first, "cross_entropy")
    r2 = host.forward_backward("a", second, "cross_entropy")
    assert math.isclose(r1.metrics["loss:sum"] + r2.metrics["loss:sum"], float(total.detach()), rel_tol=1e-5)
    for p, g in zip(params(host, "a"), manual):
        # padded batches vs one row at a time: float32 sums in another order over O(100) terms per element, so an
        # element may be off by ~100 ulps of the tensor's largest entry (cancellation makes small ones relative-wide)
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=float(g.abs().max()) * 2.0**-16)
    step = AdamStep(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1)
    expected, norm = expected_after_step(host, "a", step)
    metrics = host.optim_step("a", step)
    assert math.isclose(metrics["grad_norm"], norm, rel_tol=1e-5)
    for p, e in zip(params(host, "a"), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in params(host, "a"))  # the step clears the window


def test_learning_rate_zero_leaves_the_weights_bitwise_unchanged(host):
    host.create_adapter("a", rank=4, seed=0)
    train(host, "a", 2)
    before = weights(host, "a")
    host.forward_backward("a", [sft(host)], "cross_entropy")
    host.optim_step("a", AdamStep(learning_rate=0.0, weight_decay=0.5))
    assert_bitwise(weights(host, "a"), before)


def test_grad_clip_norm_clips_the_summed_gradient_and_zero_does_not_clip(host):
    for adapter in ("clipped", "free"):
        host.create_adapter(adapter, rank=4, seed=3)
        train(host, adapter, 1)
        host.forward_backward(adapter, [sft(host)], "cross_entropy")
    # eps = 1 makes Adam's update depend on the gradient's size, so the clipping shows in the weights
    clipped = AdamStep(learning_rate=1e-2, eps=1.0, grad_clip_norm=1e-3)
    expected, norm = expected_after_step(host, "clipped", clipped)
    metrics = host.optim_step("clipped", clipped)
    assert metrics["grad_norm"] > 1.0 and math.isclose(metrics["grad_norm"], norm, rel_tol=1e-5)  # before clipping
    for p, e in zip(params(host, "clipped"), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-7)
    free = AdamStep(learning_rate=1e-2, eps=1.0, grad_clip_norm=0.0)
    expected_free, _ = expected_after_step(host, "free", free)
    host.optim_step("free", free)
    for p, e in zip(params(host, "free"), expected_free):
        torch.testing.assert_close(p.detach(), e, rtol=1e-5, atol=1e-7)
    assert_changed(weights(host, "clipped"), weights(host, "free"))


def test_forward_only_returns_per_token_logprobs_trimmed_per_datum_without_gradients(host):
    host.create_adapter("a", rank=4, seed=0)
    train(host, "a", 2)
    data = [sft(host, "a short one"), sft(host, "and a noticeably longer datum")]
    result = host.forward_backward("a", data, "cross_entropy", backward=False)
    assert all(p.grad is None for p in params(host, "a"))
    name = host.model_adapter_name("a")
    for datum, out in zip(data, result.per_datum):
        assert len(out["logprobs"]) == len(datum.tokens) == len(out["elementwise_loss"])
        manual = manual_logprobs(host, name, datum.tokens, datum.loss_fn_inputs["target_tokens"])
        torch.testing.assert_close(torch.tensor(out["logprobs"]), manual, rtol=1e-5, atol=1e-5)
    with_grads = host.forward_backward("a", data, "cross_entropy")
    for x, y in zip(with_grads.per_datum, result.per_datum):
        assert x["logprobs"] == pytest.approx(y["logprobs"], abs=1e-5)


def test_rl_losses_run_through_the_host(host):
    host.create_adapter("a", rank=4, seed=0)
    before = weights(host, "a")
    for loss in ("importance_sampling", "ppo", "cispo", "dro"):
        result = host.forward_backward("a", [rl(host), rl(host, "another", advantage=-0.5)], loss)
        assert math.isfinite(result.metrics["loss:sum"])
        host.optim_step("a", STEP)
    assert_changed(weights(host, "a"), before)


# ---------------------------------------------------------------------------------------------------- checkpoints
def test_load_state_with_optimizer_resumes_bitwise_and_without_it_does_not(host, tmp_path):
    host.create_adapter("a", rank=4, seed=1)
    train(host, "a", 3)
    saved = tmp_path / "ckpt" / "state-3"
    host.save_state("a", saved)
    assert (saved / STATE_MARKER).is_file()
    uninterrupted = train(host, "a", 3)
    host.load_state("resumed", saved)  # a new adapter, created from the saved settings
    assert host.adapter_settings("resumed") == {**host.adapter_settings("a"), "step": 3}
    assert train(host, "resumed", 3) == uninterrupted
    host.load_state("weights_only", saved, optimizer=False)
    assert train(host, "weights_only", 3) != uninterrupted
    # loading over an existing adapter with pending gradients: they are dropped, the state is the saved one
    host.forward_backward("resumed", [sft(host, "pending")], "cross_entropy")
    host.load_state("resumed", saved)
    assert train(host, "resumed", 3) == uninterrupted


def test_state_saved_without_optimizer_loads_weights_only(host, tmp_path):
    host.create_adapter("a", rank=4, seed=1)
    train(host, "a", 2)
    saved = tmp_path / "weights"
    host.save_state("a", saved, optimizer=False)
    with pytest.raises(BadRequest, match="without optimizer state"):
        host.load_state("b", saved)
    host.load_state("b", saved, optimizer=False)
    assert_bitwise(weights(host, "b"), weights(host, "a"))


def test_a_failed_save_leaves_no_torn_checkpoint_and_keeps_the_previous_one(host, tmp_path, monkeypatch):
    host.create_adapter("a", rank=4, seed=1)
    target = tmp_path / "state"
    host.save_state("a", target)
    train(host, "a", 1)

    def crash(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(host.model, "save", crash)
    with pytest.raises(OSError):
        host.save_state("a", target)
    with pytest.raises(OSError):
        host.save_state("a", tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert host.state_info(target)["adapter"]["rank"] == 4  # the first save, intact and verified


def test_load_state_refuses_a_damaged_or_mismatched_state(host, tmp_path):
    host.create_adapter("a", rank=4, seed=1)
    host.create_adapter("other", rank=2, seed=1)
    saved = tmp_path / "state"
    host.save_state("a", saved)
    with pytest.raises(BadRequest, match="same LoRA settings"):
        host.load_state("other", saved)
    weights_file = next(saved.rglob("adapter_model.safetensors"))
    weights_file.write_bytes(weights_file.read_bytes()[:-8])
    with pytest.raises(BadRequest, match="not a usable saved state"):
        host.load_state("a", saved)


def test_export_adapter_loads_in_plain_peft_with_the_same_logits(host, tmp_path):
    import peft
    from twinkle_backend_hf.model import TransformersModel

    host.create_adapter("a", rank=4, seed=0)
    train(host, "a", 3)
    exported = tmp_path / "export"
    host.export_adapter("a", exported)
    assert (exported / "adapter_config.json").is_file() and (exported / "adapter_model.safetensors").is_file()
    base = TransformersModel(config=dict(CONFIG), seed=0).network  # the same base, built the same way
    plain = peft.PeftModel.from_pretrained(base, str(exported)).eval()
    ids = tokens(host, "check the exported adapter")
    with torch.no_grad():
        theirs = plain(input_ids=torch.tensor([ids])).logits
    ours = host.model.forward_only(inputs={"input_ids": torch.tensor([ids])},
                                   adapter_name=host.model_adapter_name("a"))["logits"]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    # greedy sampling from the exported adapter equals argmax decoding by hand with plain PEFT
    host.load_sampler("s", exported)
    prompt = tokens(host, "hello")
    [seq] = host.sample("s", prompt, 1, SampleParams(max_tokens=6, temperature=0.0, stop=[]))
    by_hand, logprobs, sequence = [], [], list(prompt)
    with torch.no_grad():
        for _ in range(6):
            logits = plain(input_ids=torch.tensor([sequence])).logits[0, -1].float()
            token = int(torch.argmax(logits))
            by_hand.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            sequence.append(token)
    assert seq.tokens == by_hand and seq.stop_reason == "length"
    assert seq.logprobs == pytest.approx(logprobs, abs=1e-5)


# ---------------------------------------------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_and_logprobs_match_compute_logprobs(host):
    host.create_adapter("a", rank=4, seed=0)
    train(host, "a", 2)
    exported = host.state_dir / "export"
    host.export_adapter("a", exported)
    host.load_sampler("s", exported)
    prompt = tokens(host, "hello")
    params = SampleParams(max_tokens=8, temperature=1.0, top_p=0.95, top_k=50, seed=1234, stop=[])
    first = host.sample("s", prompt, 3, params)
    assert [s.tokens for s in host.sample("s", prompt, 3, params)] == [s.tokens for s in first]
    assert len({tuple(s.tokens) for s in first}) > 1  # each sample draws its own noise
    other = host.sample("s", prompt, 3, SampleParams(max_tokens=8, seed=99, stop=[]))
    assert [s.tokens for s in other] != [s.tokens for s in first]
    for seq in first:
        assert len(seq.tokens) == len(seq.logprobs) == 8 and seq.stop_reason == "length"
        scored = host.compute_logprobs("s", prompt + seq.tokens)
        assert scored[0] is None and len(scored) == len(prompt) + 8
        assert seq.logprobs == pytest.approx(scored[len(prompt):], abs=1e-4)


def test_compute_logprobs_of_the_base_equal_a_manual_log_softmax(host):
    from twinkle_backend_hf.model import TransformersModel

    host.create_adapter("a", rank=4, seed=0)
    train(host, "a", 1)  # an adapter exists and differs from the base: the base must still be the base
    ids = tokens(host, "the base model scores this")
    base = TransformersModel(config=dict(CONFIG), seed=0)
    logits = base.forward_only(inputs={"input_ids": torch.tensor([ids])})["logits"][0, :-1]
    manual = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    scored = host.compute_logprobs(None, ids)
    assert scored[0] is None
    torch.testing.assert_close(torch.tensor(scored[1:]), manual, rtol=1e-5, atol=1e-5)
    host.load_sampler("base", None)
    assert host.compute_logprobs("base", ids) == scored


def test_stop_tokens_strings_and_eos(host):
    prompt = tokens(host, "hello")
    [free] = host.sample(None, prompt, 1, SampleParams(max_tokens=6, temperature=0.0, stop=[]))
    third = free.tokens[2]
    first_at = free.tokens.index(third)
    [stopped] = host.sample(None, prompt, 1, SampleParams(max_tokens=6, temperature=0.0, stop=[third]))
    assert stopped.tokens == free.tokens[:first_at + 1] and stopped.stop_reason == "stop"
    text = host.tokenizer.decode(free.tokens[:2])
    if text:
        [by_string] = host.sample(None, prompt, 1, SampleParams(max_tokens=6, temperature=0.0, stop=[text]))
        assert by_string.stop_reason == "stop" and len(by_string.tokens) <= 2
    host.eos_ids = {free.tokens[0]}
    [eos] = host.sample(None, prompt, 1, SampleParams(max_tokens=6, temperature=0.0))  # stop=None: EOS ends it
    assert eos.tokens == free.tokens[:1] and eos.stop_reason == "stop"


def test_least_recently_used_samplers_are_reloaded_from_disk(tmp_path):
    host = make_host(tmp_path, max_loaded_samplers=1)
    host.create_adapter("a", rank=4, seed=0)
    train(host, "a", 2)
    host.export_adapter("a", tmp_path / "e1")
    host.load_sampler("one", tmp_path / "e1")
    host.load_sampler("two", None)
    ids = tokens(host, "reload me")
    scored = host.compute_logprobs("one", ids)
    host.load_sampler("three", tmp_path / "e1")  # evicts "one"
    assert host.compute_logprobs("one", ids) == scored
    host.unload_sampler("one")
    with pytest.raises(NotFound):
        host.compute_logprobs("one", ids)


# ---------------------------------------------------------------------------------------------------- tenancy
def test_training_one_adapter_never_changes_another(host):
    host.create_adapter("a", rank=4, seed=0)
    host.create_adapter("b", rank=8, seed=0, train_unembed=False)
    train(host, "b", 2)
    before = weights(host, "b")
    optimizer_before = {k: v.clone() for k, v in host.model.train_state(host.model_adapter_name("b")).optimizer
                        .state_dict()["state"][0].items()}
    train(host, "a", 3, data=[sft(host), sft(host, "more data for a")])
    host.forward_backward("a", [rl(host)], "ppo")
    with pytest.raises(BadRequest):
        host.forward_backward("a", [sft(host, weights=[float("nan")] * (len(tokens(host, "hello twinkle, "
                                                                                         "hello tinker")) - 1))],
                              "cross_entropy")
    host.optim_step("a", STEP)
    host.remove_adapter("a")
    assert_bitwise(weights(host, "b"), before)
    after = host.model.train_state(host.model_adapter_name("b")).optimizer.state_dict()["state"][0]
    assert all(torch.equal(after[k], v) for k, v in optimizer_before.items())
    assert all(p.grad is None for p in params(host, "b"))
    host.create_adapter("a", rank=4, seed=0)  # the id is free again; a re-created adapter starts afresh
    assert host.adapter_settings("a")["step"] == 0


def test_the_same_seed_gives_the_same_initial_adapter(host):
    host.create_adapter("a", rank=4, seed=7)
    host.create_adapter("b", rank=4, seed=7)
    host.create_adapter("c", rank=4, seed=8)
    assert_bitwise(weights(host, "a"), weights(host, "b"))
    assert_changed(weights(host, "a"), weights(host, "c"))


def test_adapter_limits(tmp_path):
    host = make_host(tmp_path, max_adapters=1)
    with pytest.raises(BadRequest, match="max_lora_rank=8"):
        host.create_adapter("a", rank=16)
    with pytest.raises(BadRequest, match="max_lora_rank"):
        host.create_adapter("a", rank=0)
    host.create_adapter("a", rank=8)
    with pytest.raises(BadRequest, match="already exists"):
        host.create_adapter("a", rank=4)
    with pytest.raises(TooManyRequests):
        host.create_adapter("b", rank=4)
    with pytest.raises(NotFound):
        host.forward_backward("missing", [sft(host)], "cross_entropy")
    with pytest.raises(NotFound):
        host.optim_step("missing", STEP)


# ---------------------------------------------------------------------------------------------------- bad requests
def _bad_requests(host):
    good = sft(host)
    n = len(good.tokens)
    ok_targets = good.loss_fn_inputs["target_tokens"]
    yield "empty", [], "cross_entropy", "no data"
    yield "token", [Datum([*good.tokens[:-1], 262], good.loss_fn_inputs)], "cross_entropy", "not a token id"
    yield "negative", [Datum([-1, *good.tokens[1:]], good.loss_fn_inputs)], "cross_entropy", "not a token id"
    yield "target", [Datum(good.tokens, {"target_tokens": [*ok_targets[:-1], 10_000], "weights": [1.0] * n})], \
        "cross_entropy", "not a token id"
    yield "length", [good, Datum(good.tokens, {"target_tokens": ok_targets, "weights": [1.0] * (n - 1)})], \
        "cross_entropy", "one value per token"
    yield "nan", [Datum(good.tokens, {"target_tokens": ok_targets, "weights": [float("nan")] + [1.0] * (n - 1)})], \
        "cross_entropy", "not a finite number"
    bad_rl = rl(host)
    bad_rl.loss_fn_inputs["advantages"][0] = float("inf")
    yield "inf", [rl(host), bad_rl], "importance_sampling", "not a finite number"
    yield "missing", [Datum(good.tokens, {"target_tokens": ok_targets})], "cross_entropy", "weights"
    yield "unread", [Datum(good.tokens, {**good.loss_fn_inputs, "mask": [1.0] * n})], "cross_entropy", "mask"
    yield "no tokens", [Datum([], {"target_tokens": [], "weights": []})], "cross_entropy", "no tokens"


def test_each_bad_request_is_refused_before_the_adapter_is_touched(host):
    host.create_adapter("a", rank=4, seed=0)
    host.create_adapter("twin", rank=4, seed=0)
    for adapter in ("a", "twin"):
        train(host, adapter, 1)
        host.forward_backward(adapter, [sft(host)], "cross_entropy")  # a half-accumulated window
    for _what, data, loss, message in _bad_requests(host):
        with pytest.raises(BadRequest, match=message):
            host.forward_backward("a", data, loss)
        with pytest.raises(BadRequest, match=message):
            host.forward_backward("a", data, loss, backward=False)
    with pytest.raises(UnsupportedLoss):
        host.forward_backward("a", [sft(host)], "no_such_loss")
    with pytest.raises(BadRequest):
        host.forward_backward("a", [sft(host)], "cross_entropy", {"beta": 1.0})
    for bad in (AdamStep(learning_rate=-1.0), AdamStep(beta1=1.0), AdamStep(eps=0.0), AdamStep(grad_clip_norm=-1),
                AdamStep(learning_rate=float("nan"))):
        with pytest.raises(BadRequest, match="out of range"):
            host.optim_step("a", bad)
    for adapter in ("a", "twin"):
        host.optim_step(adapter, STEP)
    assert_bitwise(weights(host, "a"), weights(host, "twin"))


def test_bad_sampling_requests(host):
    prompt = tokens(host, "hi")
    for params, message in [(SampleParams(temperature=-1.0), "temperature"), (SampleParams(top_p=0.0), "top_p"),
                            (SampleParams(max_tokens=0), "max_tokens"), (SampleParams(max_tokens=10_000), "context"),
                            (SampleParams(stop=[""]), "empty string"), (SampleParams(stop=["a", 1]), "not a mix")]:
        with pytest.raises(BadRequest, match=message):
            host.sample(None, prompt, 1, params)
    with pytest.raises(BadRequest, match="not a token id"):
        host.sample(None, [999], 1, SampleParams(max_tokens=2))
    with pytest.raises(BadRequest, match="empty"):
        host.sample(None, [], 1, SampleParams(max_tokens=2))
    with pytest.raises(BadRequest, match="num_samples"):
        host.sample(None, prompt, 0, SampleParams(max_tokens=2))
    with pytest.raises(NotFound):
        host.sample("never_loaded", prompt, 1, SampleParams(max_tokens=2))
    with pytest.raises(NotFound):
        host.load_sampler("s", host.state_dir / "nothing_here")
    with pytest.raises(BadRequest, match="not a token id"):
        host.compute_logprobs(None, [0, 262])


def test_an_adapter_that_does_not_fit_the_base_is_refused(host, tmp_path):
    import json

    host.create_adapter("a", rank=4, seed=0)
    exported = tmp_path / "export"
    host.export_adapter("a", exported)
    config = json.loads((exported / "adapter_config.json").read_text())
    (exported / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["no_such_proj"]}))
    with pytest.raises(BadRequest, match="does not fit"):
        host.load_sampler("s", exported)
    (exported / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    with pytest.raises(BadRequest, match="max_lora_rank"):
        host.load_sampler("s", exported)
    with pytest.raises(NotFound):
        host.compute_logprobs("s", [1, 2])
    assert host.compute_logprobs(None, [1, 2])[0] is None  # the host still works


def test_a_model_directory_with_its_tokenizer_is_a_model_section(tmp_path):
    import shutil

    from twinkle_backend_hf.model import TransformersModel

    from twinkle_core.errors import ConfigError

    model_dir = tmp_path / "tiny"
    TransformersModel(config=dict(CONFIG), seed=0).network.save_pretrained(model_dir)
    for name in Path(TOKENIZER).iterdir():
        shutil.copy(name, model_dir / name.name)
    host = ModelHost("tiny", {"path": str(model_dir)}, state_dir=tmp_path / "state", max_lora_rank=4)
    assert host.vocab_size == 262 and host.tokenizer is not None
    ids = tokens(host, "the same base")
    assert host.compute_logprobs(None, ids) == pytest.approx(make_host(tmp_path).compute_logprobs(None, ids), abs=1e-6)
    host.create_adapter("a", rank=4, seed=0)
    losses = train(host, "a", 3)
    assert losses[-1] < losses[0]
    with pytest.raises(ConfigError, match="unknown key"):
        ModelHost("tiny", {"path": str(model_dir), "adaptor": {}}, state_dir=tmp_path)
