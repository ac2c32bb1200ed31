"""The ``hf_generate`` sampler: behaviour log-probs, seeding, greedy decoding, filters, stopping, weight sync.

A tiny Qwen2 (hidden 32, 2 layers, the bundled tokenizer's vocabulary) under ``TransformersModel``; the
distributed cases (DDP; FSDP2 and ZeRO-3 in lockstep) run ``scripts/sample_dist.py`` under torchrun, 2 ranks, gloo.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from twinkle_core.errors import ConfigError
from twinkle_core.sampling import Completion, SamplingParams, sample_seed
from twinkle_core.testing.torchrun import run_torchrun, thread_env

SCRIPT = Path(__file__).resolve().parent / "scripts" / "sample_dist.py"
TEXTS = ["hello there", "a", "the quick brown fox jumps", "what is 12 * 3?"]
#: zero3: deepspeed with stage 3 (scripts/sample_dist.py), where deepspeed is installed
STRATEGIES = ("ddp", "native_fsdp") + (("zero3",) if importlib.util.find_spec("deepspeed") else ())
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "init_lora_weights": False}


def make_model(tokenizer: Any, seed: int = 0, **options: Any) -> Any:
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_backend_hf.testing import tiny_qwen2_config

    return TransformersModel(config=tiny_qwen2_config(vocab_size=len(tokenizer)), seed=seed, tokenizer=tokenizer,
                             **options)


def make_sampler(model: Any, tokenizer: Any, adapter_name: str | None = None, **options: Any) -> Any:
    from twinkle_rl.samplers import HFGenerateSampler

    sampler = HFGenerateSampler(**options)
    sampler.bind(model, tokenizer, adapter_name=adapter_name)
    return sampler


def seeds_for(prompts: int, n: int, base: int = 0) -> list[list[int]]:
    return [[sample_seed(base, i, j) for j in range(n)] for i in range(prompts)]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One torch thread unless TWINKLE_TEST_THREADS says otherwise: decoding runs thousands of tiny ops, and
    on a loaded 2-core machine two spinning OpenMP threads made this module 5-80x slower (measured)."""
    if os.environ.get("TWINKLE_TEST_THREADS"):
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in TEXTS]


@pytest.fixture(scope="module")
def policy(tokenizer) -> Any:
    return make_model(tokenizer)


def teacher_forced_logprobs(model: Any, prompt: list[int], completion: Completion, params: SamplingParams,
                            adapter_name: str | None = None) -> list[float]:
    """Log-probs of the completion's tokens from one cache-less forward of prompt + completion."""
    from twinkle_rl.samplers.processing import process_logits

    ids = torch.tensor([prompt + completion.token_ids])
    kwargs = {"adapter_name": adapter_name} if adapter_name else {}
    logits = model.forward_only(inputs={"input_ids": ids}, **kwargs)["logits"][0].float()
    steps = logits[len(prompt) - 1:-1]
    logprobs = process_logits(steps, params)
    return logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1).tolist()


def assert_same(a: Completion, b: Completion, tol: float = 1e-5) -> None:
    assert a.token_ids == b.token_ids
    assert a.finish_reason == b.finish_reason
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= tol


# ---------------------------------------------------------------------- behaviour log-probs
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_new_tokens=10),
                                    SamplingParams(temperature=0.7, max_new_tokens=10),
                                    SamplingParams(temperature=1.3, top_k=12, top_p=0.8, max_new_tokens=10),
                                    SamplingParams(temperature=0.0, max_new_tokens=6)],
                         ids=["t1", "t0.7", "topk_topp", "greedy"])
def test_logprobs_equal_teacher_forced_forward(policy, tokenizer, prompts, params) -> None:
    sampler = make_sampler(policy, tokenizer)
    out = sampler.sample(prompts, n=2, params=params, seeds=seeds_for(len(prompts), 2))
    for prompt, per_prompt in zip(prompts, out, strict=True):
        assert len(per_prompt) == 2
        for completion in per_prompt:
            assert len(completion.logprobs) == len(completion.token_ids) >= 1
            expected = teacher_forced_logprobs(policy, prompt, completion, params)
            assert max(abs(a - b) for a, b in zip(completion.logprobs, expected)) <= 1e-5
            assert all(math.isfinite(x) and x <= 0 for x in completion.logprobs)


# ---------------------------------------------------------------------- seeding
def test_same_seed_same_completion_alone_or_batched(policy, tokenizer, prompts) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12)
    seeds = seeds_for(len(prompts), 3)
    batched = make_sampler(policy, tokenizer).sample(prompts, n=3, params=params, seeds=seeds)
    one_by_one = make_sampler(policy, tokenizer, batch_size=1).sample(prompts, n=3, params=params, seeds=seeds)
    for i, prompt in enumerate(prompts):
        alone = make_sampler(policy, tokenizer).sample([prompt], n=3, params=params, seeds=[seeds[i]])[0]
        for j in range(3):
            assert_same(alone[j], batched[i][j])
            assert_same(alone[j], one_by_one[i][j])
    # other seeds, other completions (12 tokens from a ~uniform 262-way distribution never all agree)
    other = make_sampler(policy, tokenizer).sample(prompts, n=3, params=params,
                                                   seeds=seeds_for(len(prompts), 3, base=1))
    assert all(other[i][j].token_ids != batched[i][j].token_ids for i in range(len(prompts)) for j in range(3))
    assert batched[0][0].token_ids != batched[0][1].token_ids  # the n samples of a prompt differ


def test_rows_finishing_early_leave_the_others_unchanged(tokenizer, prompts) -> None:
    """Rows that hit EOS leave the batch (their cache rows are dropped) mid-decoding; the rest go on as alone."""
    model = make_model(tokenizer, seed=6)
    sampler = make_sampler(model, tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    seeds = seeds_for(len(prompts), 3)
    free = sampler.sample(prompts, n=3, params=params, seeds=seeds)
    model.hf_model.generation_config.eos_token_id = free[0][0].token_ids[4]  # a token this policy does sample
    try:
        batched = sampler.sample(prompts, n=3, params=params, seeds=seeds)
        alone = [sampler.sample([p], n=3, params=params, seeds=[s])[0] for p, s in zip(prompts, seeds)]
    finally:
        model.hf_model.generation_config.eos_token_id = None
    reasons = {c.finish_reason for per_prompt in batched for c in per_prompt}
    assert reasons == {"stop", "length"}
    for per_alone, per_batched in zip(alone, batched, strict=True):
        for a, b in zip(per_alone, per_batched, strict=True):
            assert_same(a, b)


def test_greedy_equals_hf_generate(policy, tokenizer, prompts) -> None:
    out = make_sampler(policy, tokenizer).sample(prompts, n=1, params=SamplingParams(temperature=0, max_new_tokens=8),
                                                 seeds=seeds_for(len(prompts), 1))
    for prompt, (completion,) in zip(prompts, out, strict=True):
        generated = policy.hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                             do_sample=False, max_new_tokens=8, use_cache=True,
                                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        assert completion.token_ids == generated[0, len(prompt):].tolist()[:len(completion.token_ids)]
        assert len(completion.token_ids) == 8 or completion.finish_reason == "stop"


def test_top_k_1_is_greedy(policy, tokenizer, prompts) -> None:
    sampler = make_sampler(policy, tokenizer)
    greedy = sampler.sample(prompts, n=1, params=SamplingParams(temperature=0, max_new_tokens=8),
                            seeds=seeds_for(len(prompts), 1))
    top1 = sampler.sample(prompts, n=2, params=SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8),
                          seeds=seeds_for(len(prompts), 2))
    for g, t in zip(greedy, top1, strict=True):
        assert g[0].token_ids == t[0].token_ids == t[1].token_ids
        assert all(x == 0.0 for x in t[0].logprobs)  # a point mass


# ---------------------------------------------------------------------- processing unit tests
def test_process_logits_filters() -> None:
    from twinkle_rl.samplers.processing import choose_tokens, process_logits

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    nucleus = process_logits(logits, SamplingParams(top_p=0.75))
    assert torch.allclose(nucleus[0, :2].exp(), torch.tensor([0.5 / 0.8, 0.3 / 0.8]))
    assert torch.isneginf(nucleus[0, 2:]).all()
    top2 = process_logits(logits, SamplingParams(top_k=2))
    assert torch.allclose(top2, nucleus)
    # the top token alone exceeds top_p: it stays, alone
    assert torch.isneginf(process_logits(logits, SamplingParams(top_p=0.1))[0, 1:]).all()
    tempered = process_logits(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(tempered, torch.log_softmax(logits / 2.0, dim=-1))
    greedy = process_logits(logits, SamplingParams(temperature=0.0))
    assert torch.allclose(greedy, torch.log_softmax(logits, dim=-1))

    rows = nucleus.expand(4000, -1)
    generators = [torch.Generator().manual_seed(s) for s in range(4000)]
    chosen, chosen_logprobs = choose_tokens(rows, generators, greedy=False)
    assert set(chosen.tolist()) == {0, 1}  # never outside the nucleus
    assert abs((chosen == 0).float().mean().item() - 0.625) < 0.03
    assert torch.allclose(chosen_logprobs, nucleus[0, chosen])


# ---------------------------------------------------------------------- stopping
def test_eos_stop_string_and_length(tokenizer, prompts) -> None:
    model = make_model(tokenizer, seed=1)
    sampler = make_sampler(model, tokenizer)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    reference = sampler.sample(prompts[:1], n=1, params=greedy, seeds=[[0]])[0][0]
    assert reference.finish_reason == "length" and len(reference.token_ids) == 10
    tokens = reference.token_ids

    # an EOS id from the generation config ends the completion at its first occurrence, EOS kept
    eos = tokens[3]
    model.hf_model.generation_config.eos_token_id = eos
    try:
        stopped = sampler.sample(prompts[:1], n=1, params=greedy, seeds=[[0]])[0][0]
    finally:
        model.hf_model.generation_config.eos_token_id = None
    first = tokens.index(eos)
    assert stopped.token_ids == tokens[:first + 1] and stopped.finish_reason == "stop"
    assert stopped.logprobs == pytest.approx(reference.logprobs[:first + 1], abs=1e-6)

    # a stop string ends it at the token that completes the string (kept)
    stop = next(text for text in (tokenizer.decode(tokens[k:k + 2]) for k in range(2, 8)) if text.strip())
    end = next(k for k in range(1, 11) if stop in tokenizer.decode(tokens[:k]))
    by_string = sampler.sample(prompts[:1], n=1, params=SamplingParams(temperature=0, max_new_tokens=10, stop=(stop,)),
                               seeds=[[0]])[0][0]
    assert by_string.token_ids == tokens[:end] and by_string.finish_reason == "stop"
    assert stop in by_string.text
    assert by_string.text == tokenizer.decode(tokens[:end], skip_special_tokens=True)
    assert by_string.policy_step == 0

    short = sampler.sample(prompts[:1], n=1, params=SamplingParams(temperature=0, max_new_tokens=3),
                           seeds=[[0]])[0][0]
    assert short.token_ids == tokens[:3] and short.finish_reason == "length"


def test_tokenizer_eos_ends_completions(tokenizer, prompts) -> None:
    """Make the tokenizer's EOS the most likely token: every completion is just EOS, finish 'stop'."""
    model = make_model(tokenizer, seed=2)
    network = model.hf_model
    with torch.no_grad():  # a constant residual stream of ones, and an EOS row aligned with it
        network.model.embed_tokens.weight.fill_(1.0)
        for layer in network.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        network.lm_head.weight[tokenizer.eos_token_id] = 10.0
    out = make_sampler(model, tokenizer).sample(prompts, n=2, params=SamplingParams(max_new_tokens=5),
                                                seeds=seeds_for(len(prompts), 2))
    for per_prompt in out:
        for completion in per_prompt:
            assert completion.token_ids == [tokenizer.eos_token_id] and completion.finish_reason == "stop"
            assert completion.text == ""


# ---------------------------------------------------------------------- through TwinkleModel
def test_lora_adapter_logprobs_and_weight_changes(tokenizer, prompts) -> None:
    model = make_model(tokenizer, seed=4)
    model.add_adapter_to_model("default", dict(LORA))
    params = SamplingParams(temperature=0.9, max_new_tokens=8)
    seeds = seeds_for(len(prompts), 2)
    sampler = make_sampler(model, tokenizer, adapter_name="default")
    before = sampler.sample(prompts, n=2, params=params, seeds=seeds)
    for prompt, per_prompt in zip(prompts, before, strict=True):
        for completion in per_prompt:
            expected = teacher_forced_logprobs(model, prompt, completion, params, adapter_name="default")
            assert max(abs(a - b) for a, b in zip(completion.logprobs, expected)) <= 1e-5
    assert model.module.training  # training mode is back after sampling
    with torch.no_grad():
        for name, parameter in model.module.named_parameters():
            if "lora_B" in name:
                parameter.mul_(3.0)
    after = sampler.sample(prompts, n=2, params=params, seeds=seeds)
    assert any(a.logprobs != b.logprobs for pa, pb in zip(before, after) for a, b in zip(pa, pb))
    with pytest.raises(ConfigError, match="LoRA"):
        make_sampler(model, tokenizer, adapter_name="default", copy_weights=True)


def test_copy_weights_matches_in_process(tokenizer, prompts) -> None:
    model = make_model(tokenizer, seed=5)
    params = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=8)
    seeds = seeds_for(len(prompts), 2)
    in_process = make_sampler(model, tokenizer)
    pushed = make_sampler(model, tokenizer, copy_weights=True, batch_size=3)
    assert (in_process.weight_sync, pushed.weight_sync) == ("in_process", "push")
    with pytest.raises(ConfigError, match="sync_weights"):
        pushed.sample(prompts, n=2, params=params, seeds=seeds)
    for step in (0, 1):
        if step:  # the policy moves on; the copy follows only through sync_weights
            with torch.no_grad():
                for parameter in model.module.parameters():
                    parameter.add_(0.05 * torch.randn_like(parameter))
        in_process.sync_weights(model, step=step)
        pushed.sync_weights(model, step=step)
        a = in_process.sample(prompts, n=2, params=params, seeds=seeds)
        b = pushed.sample(prompts, n=2, params=params, seeds=seeds)
        for pa, pb in zip(a, b, strict=True):
            for ca, cb in zip(pa, pb, strict=True):
                assert_same(ca, cb, tol=1e-6)
                assert ca.policy_step == cb.policy_step == step
    pushed.close()


class WeightsOnlyPolicy:
    """A policy that cannot lend its network (as MegatronModel): only gathered Hugging Face weights."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def get_state_dict(self, *, adapter_name: str | None = None) -> dict[str, torch.Tensor]:
        return self.state

    def generation_module(self, *, adapter_name: str | None = None) -> Any:
        from twinkle_core.model.base import TwinkleModel

        return TwinkleModel.generation_module(self, adapter_name=adapter_name)


def test_copy_weights_from_config_option(tokenizer, policy, prompts) -> None:
    from twinkle_backend_hf.testing import tiny_qwen2_config

    params = SamplingParams(temperature=0.8, max_new_tokens=6)
    seeds = seeds_for(len(prompts), 2)
    stub = WeightsOnlyPolicy({k: v.clone() for k, v in policy.hf_model.state_dict().items()})
    with pytest.raises(ConfigError, match="copy_weights: true"):
        make_sampler(stub, tokenizer).sample(prompts, n=2, params=params, seeds=seeds)
    with pytest.raises(ConfigError, match="config"):
        make_sampler(stub, tokenizer, copy_weights=True)
    pushed = make_sampler(stub, tokenizer, copy_weights=True, config=tiny_qwen2_config(vocab_size=len(tokenizer)))
    pushed.sync_weights(stub, step=3)
    expected = make_sampler(policy, tokenizer).sample(prompts, n=2, params=params, seeds=seeds)
    for pa, pb in zip(expected, pushed.sample(prompts, n=2, params=params, seeds=seeds), strict=True):
        for a, b in zip(pa, pb, strict=True):
            assert_same(a, b, tol=1e-6)
            assert b.policy_step == 3


def test_push_refuses_mismatched_weights(tokenizer, policy) -> None:
    from twinkle_core.sampling import WeightUpdate

    sampler = make_sampler(policy, tokenizer, copy_weights=True)
    with pytest.raises(ConfigError, match="empty state dict"):
        sampler.receive_weights(WeightUpdate(step=1, state_dict={}))
    with pytest.raises(ConfigError, match="do not fit"):
        sampler.receive_weights(WeightUpdate(step=1, state_dict={"model.embed_tokens.weight": torch.zeros(3, 3)}))
    with pytest.raises(ConfigError, match="adapter"):
        sampler.receive_weights(WeightUpdate(step=1, state_dict={"x": torch.zeros(1)}, adapter_name="default"))


# ---------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_config_errors(policy, tokenizer, prompts) -> None:
    from twinkle_rl.samplers import HFGenerateSampler

    sampler = make_sampler(policy, tokenizer)
    params = SamplingParams(max_new_tokens=10)
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        sampler.sample([prompts[0], []], n=1, params=params, seeds=seeds_for(2, 1))
    too_long = [5] * 250  # max_position_embeddings of the tiny config is 256
    with pytest.raises(ConfigError, match=r"prompt 1 has 250 tokens.*max_new_tokens=10.*\(256\)"):
        sampler.sample([prompts[0], too_long], n=1, params=params, seeds=seeds_for(2, 1))
    with pytest.raises(ConfigError, match="seeds"):
        sampler.sample(prompts, n=2, params=params, seeds=seeds_for(len(prompts), 1))
    with pytest.raises(ConfigError, match="empty string"):
        sampler.sample(prompts, n=1, params=SamplingParams(stop=("",)), seeds=seeds_for(len(prompts), 1))
    with pytest.raises(ConfigError, match="batch_size"):
        HFGenerateSampler(batch_size=0)
    with pytest.raises(ConfigError, match="unknown hf_generate option"):
        HFGenerateSampler(temperature=1.0)
    with pytest.raises(ConfigError, match="bind"):
        HFGenerateSampler().sample(prompts, n=1, params=params, seeds=seeds_for(len(prompts), 1))
    assert sampler.sample([], n=1, params=params, seeds=[]) == []


# ---------------------------------------------------------------------- 2 ranks
def _env() -> dict[str, str]:
    return {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TWINKLE_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu"}


def test_two_ranks_ddp_fsdp_zero3_match_single_process(tmp_path) -> None:
    """Each rank samples its share (one sequence per batch: uneven batch and step counts per rank, and a
    request where one rank has no prompts); FSDP2 and ZeRO-3 decode in lockstep and must not hang."""
    import os

    single_out, dist_out = tmp_path / "single.json", tmp_path / "dist.json"
    env = {**os.environ, **thread_env(), **_env(), "WORLD_SIZE": "1"}
    for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    single = subprocess.run([sys.executable, str(SCRIPT), "--out", str(single_out)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert single.returncode == 0, single.stderr[-4000:]
    job = run_torchrun([SCRIPT, "--out", dist_out, "--strategies", *STRATEGIES], nproc=2, timeout=180,
                       env=_env())
    assert job.returncode == 0, job.output
    reference = json.loads(single_out.read_text())["single"]
    results = json.loads(dist_out.read_text())
    for strategy in STRATEGIES:
        for request, by_prompt in reference.items():
            assert results[strategy][request].keys() == by_prompt.keys()
            for index, samples in by_prompt.items():
                for (ids, logprobs, reason), (ids2, logprobs2, reason2) in zip(
                        samples, results[strategy][request][index], strict=True):
                    assert (ids, reason) == (ids2, reason2), (strategy, request, index)
                    assert max(abs(a - b) for a, b in zip(logprobs, logprobs2)) <= 1e-5
