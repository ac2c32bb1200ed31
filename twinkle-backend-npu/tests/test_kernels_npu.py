"""The NPU fused kernels on the fake torch_npu: for each family they give the untouched Hugging Face model's outputs
and gradients, packed sequences through npu_fusion_attention equal the unpacked run, and the switch and the
accelerator decide what is applied.

Tolerance: fp32 throughout. The reference runs transformers' eager attention, whose arithmetic (scaled q k^T,
float32 softmax, times v) the fake npu_fusion_attention repeats, and RMSNorm, rotary and SwiGLU repeat the modules'
operations in order, so the kernels' wiring (layouts, masks, scale, grouped heads, packing) is all that could
differ: they agree to the bit today. The bound is 1e-6 relative to each tensor's largest element (a few fp32 ulp
through two layers), with weights initialised at std 0.2 so that logits and gradients are O(0.01-5) and a wiring
error shows. (Against sdpa, which sums in another order, the difference is ~3e-6 of the largest element.)
"""

from __future__ import annotations

import pytest
import torch
import transformers
from twinkle_backend_npu.testing import fake_ops, install_fake_torch_npu

from twinkle_core.kernels import apply_kernels
from twinkle_core.plugins import TwinklePlugins, reset_plugins

LAYERS = 2
COMMON = {"initializer_range": 0.2, "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "tie_word_embeddings": False}
FAMILIES = {
    "qwen2": {},  # Qwen2 and Qwen2.5 share the model type qwen2
    "qwen3": {"head_dim": 16},
    # layer 0 dense (Qwen3MoeMLP, swapped), layer 1 routed experts (left to transformers)
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "mlp_only_layers": [0]},
    "llama": {},
    "mistral": {"head_dim": 16},
}
# modules each kernel replaces per family: norms (2 per layer + final; Qwen3 adds q/k norms), one rotary call and
# one attention per layer, one gated MLP per dense layer; the ring block kernel is attached to each attention layer
# (idle here: no ring runs; tests/test_ring_block_npu.py runs it)
EXPECTED_SITES = {
    "qwen2": {"npu_rms_norm": 5, "npu_rotary_mul": 2, "npu_swiglu": 2, "npu_fusion_attention": 2,
              "npu_ring_block_attention": 2},
    "qwen3": {"npu_rms_norm": 9, "npu_rotary_mul": 2, "npu_swiglu": 2, "npu_fusion_attention": 2,
              "npu_ring_block_attention": 2},
    "qwen3_moe": {"npu_rms_norm": 9, "npu_rotary_mul": 2, "npu_swiglu": 1, "npu_fusion_attention": 2,
                  "npu_ring_block_attention": 2},
    "llama": {"npu_rms_norm": 5, "npu_rotary_mul": 2, "npu_swiglu": 2, "npu_fusion_attention": 2,
              "npu_ring_block_attention": 2},
    "mistral": {"npu_rms_norm": 5, "npu_rotary_mul": 2, "npu_swiglu": 2, "npu_fusion_attention": 2,
                "npu_ring_block_attention": 2},
}
OPS = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention")


@pytest.fixture
def npu(monkeypatch):
    """Install the fake torch_npu and the NPU plugin's kernels; yields how often each fused op ran."""
    reset_plugins(TwinklePlugins(extra_modules=["twinkle_backend_npu.plugin"]))
    with install_fake_torch_npu():
        import torch_npu

        calls = dict.fromkeys(OPS, 0)  # how often each fused op ran
        for op in OPS:
            def counted(*args, _op=op, **kwargs):
                calls[_op] += 1
                return getattr(fake_ops, _op)(*args, **kwargs)

            monkeypatch.setattr(torch_npu, op, counted, raising=False)
        yield calls
    reset_plugins()


def close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale, msg=lambda m: f"{what}: {m}")


def build(family: str, seed: int = 0, attention: str | None = None) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(family, **COMMON, **FAMILIES[family])
    torch.manual_seed(seed)
    extra = {"attn_implementation": attention} if attention else {}
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra).train()


def loss_and_grads(network: torch.nn.Module, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    network.zero_grad()
    out = network(**inputs, use_cache=False)
    out.logits.square().mean().backward()  # every logit (not only the sampled labels) drives the gradients
    return out.logits.detach(), {name: p.grad.clone() for name, p in network.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_kernels_give_the_untouched_models_outputs_and_gradients(npu, family):
    reference, patched = build(family, attention="eager"), build(family)
    applied = apply_kernels(patched, "npu")
    assert applied.counts == EXPECTED_SITES[family]
    input_ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    expected_logits, expected_grads = loss_and_grads(reference, input_ids=input_ids)
    assert not any(npu.values())  # the untouched model runs none of the kernels
    logits, grads = loss_and_grads(patched, input_ids=input_ids)
    assert all(npu[op] > 0 for op in OPS), npu
    close(logits, expected_logits, "logits")
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        close(grad, expected_grads[name], name)


def test_packed_and_padded_sequences_equal_the_unpacked_runs(npu):
    network = build("qwen2")
    apply_kernels(network, "npu")
    first, second = torch.arange(3, 8)[None], torch.arange(20, 27)[None]  # lengths 5 and 7
    with torch.no_grad():
        alone = [network(input_ids=ids, use_cache=False).logits[0] for ids in (first, second)]
        packed = network(input_ids=torch.cat((first, second), 1), use_cache=False,
                         position_ids=torch.cat((torch.arange(5), torch.arange(7)))[None]).logits[0]
        padded_ids = torch.zeros(2, 7, dtype=torch.long)
        padded_ids[0, :5], padded_ids[1] = first[0], second[0]
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[0, 5:] = 0
        padded = network(input_ids=padded_ids, attention_mask=mask, use_cache=False).logits
    close(packed, torch.cat(alone), "packed")
    close(padded[0, :5], alone[0], "right-padded row")
    close(padded[1], alone[1], "full row")


def test_a_sliding_window_shorter_than_the_sequence_is_refused(npu):
    network = build("mistral")
    network.config.sliding_window = 4
    apply_kernels(network, "npu")
    with pytest.raises(ValueError, match="npu_fusion_attention: false"):
        network(input_ids=torch.arange(6)[None], use_cache=False)


def test_the_switch_turns_one_kernel_off_and_the_cpu_accelerator_applies_none(npu):
    applied = apply_kernels(build("llama"), "npu", {"npu_swiglu": False})
    assert "npu_swiglu" not in applied.counts and "npu_rms_norm" in applied.counts
    assert apply_kernels(build("llama"), "npu", False).counts == {}
    assert apply_kernels(build("llama"), "cpu").counts == {}


def test_transformers_model_applies_them_on_the_npu_accelerator_only(npu, monkeypatch):
    from twinkle_backend_hf.model import TransformersModel

    config = {"model_type": "llama", **COMMON}
    monkeypatch.setenv("TWINKLE_ACCELERATOR", "npu")
    on_npu = TransformersModel(config=config, seed=0, kernels={"npu_rms_norm": False})
    assert on_npu.applied_kernels.counts == {"npu_rotary_mul": 2, "npu_swiglu": 2, "npu_fusion_attention": 2,
                                             "npu_ring_block_attention": 2}
    monkeypatch.setenv("TWINKLE_ACCELERATOR", "cpu")
    assert TransformersModel(config=config, seed=0).applied_kernels.counts == {}


def test_generation_with_a_cache_and_left_padding_matches_the_untouched_model(npu):
    reference, patched = build("qwen3", attention="eager").eval(), build("qwen3").eval()
    apply_kernels(patched, "npu")
    prompts = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    runs = [network.generate(input_ids=prompts, attention_mask=mask, max_new_tokens=3, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            for network in (reference, patched)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for step, (expected, got) in enumerate(zip(runs[0].logits, runs[1].logits)):
        close(got, expected, f"step {step}")
