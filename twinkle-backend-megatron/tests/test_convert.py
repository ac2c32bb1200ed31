"""Hugging Face <-> Megatron: every supported family gives HF's logits, saves what plain transformers loads, and
round-trips losslessly; the TP sharding rules invert exactly (also with a padded vocabulary)."""

from __future__ import annotations

import pytest
import torch
import transformers
from twinkle_backend_hf.model import TransformersModel
from twinkle_backend_megatron import convert
from twinkle_backend_megatron.model import MegatronModel

from twinkle_core.errors import ConfigError
from twinkle_core.testing.conformance import make_batch

_DENSE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "tie_word_embeddings": False}
FAMILIES = {
    "qwen2": {"model_type": "qwen2", **_DENSE},  # q/k/v bias
    "qwen2-tied": {"model_type": "qwen2", **_DENSE, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", **_DENSE, "head_dim": 16},  # qk-norm, head_dim != hidden / heads
    "llama": {"model_type": "llama", **_DENSE, "head_dim": 8},
    "mistral": {"model_type": "mistral", **_DENSE, "head_dim": 8, "sliding_window": None},
    "qwen3_moe": {"model_type": "qwen3_moe", **_DENSE, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True},
    "qwen3_moe-unnormalised": {"model_type": "qwen3_moe", **_DENSE, "head_dim": 8, "num_experts": 4,
                               "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False},
}


def _hf_logits(module, batch):
    module.eval()
    with torch.no_grad():
        return module(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_hf_saves_for_plain_transformers_and_round_trips(family, tmp_path):
    config = FAMILIES[family]
    hf = TransformersModel(config=dict(config), seed=3)
    model = MegatronModel(config=dict(config), seed=3)
    batch = make_batch(0, rows=2, length=10)
    # same seed, same initial weights (the random init is the HF model's), same keys
    expected = hf.get_state_dict()
    got = model.get_state_dict()
    assert got.keys() == expected.keys()
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    logits = model.forward_only(inputs=batch)["logits"]
    torch.testing.assert_close(logits, hf.forward_only(inputs=batch)["logits"], atol=1e-5, rtol=0)
    # save() writes an HF directory that plain transformers loads with the same logits
    model.set_optimizer("AdamW", lr=1e-2)
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step()
    path = model.save("hf", output_dir=str(tmp_path), save_optimizer=False)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trained = model.forward_only(inputs=batch)["logits"]
    torch.testing.assert_close(_hf_logits(reloaded, batch), trained, atol=1e-5, rtol=0)
    # HF -> Megatron -> HF is lossless
    again = MegatronModel(model_id=path)
    before, after = model.get_state_dict(), again.get_state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_padding_and_packed_rows_match_hf():
    config = FAMILIES["qwen3"]
    hf = TransformersModel(config=dict(config), seed=0)
    model = MegatronModel(config=dict(config), seed=0)
    padded = make_batch(1, rows=3, length=10)
    padded["attention_mask"][0, :4] = 0  # left padding
    padded["attention_mask"][1, 7:] = 0  # right padding
    keep = padded["attention_mask"].bool()
    got, want = model.forward_only(inputs=padded)["logits"], hf.forward_only(inputs=padded)["logits"]
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=0)
    # packed row: three sequences, positions restart at each one
    ids = make_batch(2, rows=1, length=12)["input_ids"]
    packed = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])}
    got, want = model.forward_only(inputs=packed)["logits"], hf.forward_only(inputs=packed)["logits"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # and each packed sequence on its own gives the same logits
    alone = model.forward_only(inputs={"input_ids": ids[:, 4:7]})["logits"]
    torch.testing.assert_close(got[:, 4:7], alone, atol=1e-5, rtol=0)


def _megatron_names(layers: int, moe: bool = False) -> list[str]:
    names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight"]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight",
                  p + "self_attention.linear_qkv.weight", p + "self_attention.linear_qkv.bias",
                  p + "self_attention.linear_proj.weight", p + "self_attention.q_layernorm.weight",
                  p + "self_attention.k_layernorm.weight"]
        names += ([p + "mlp.router.weight", p + "mlp.experts.local_experts.0.linear_fc1.weight",
                   p + "mlp.experts.local_experts.1.linear_fc2.weight"] if moe
                  else [p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"])
    return names


_PARTITION = {"embedding.word_embeddings.weight": 0, "output_layer.weight": 0, "linear_qkv.weight": 0,
              "linear_qkv.bias": 0, "linear_fc1.weight": 0, "linear_proj.weight": 1, "linear_fc2.weight": 1}


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_sharding_rules_invert_exactly(tp):
    hf_config = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=50, hidden_size=24, intermediate_size=36, num_hidden_layers=2, num_attention_heads=12,
        num_key_value_heads=6, head_dim=2, tie_word_embeddings=False)
    spec = convert.model_spec(hf_config, tp)
    assert spec.padded_vocab_size % tp == 0 and spec.padded_vocab_size >= 50
    hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    state = {k: torch.randn_like(v) for k, v in hf.state_dict().items()}
    state["model.layers.0.self_attn.q_proj.bias"] = torch.randn(24)  # exercise the bias path too
    state["model.layers.0.self_attn.k_proj.bias"] = torch.randn(12)
    state["model.layers.0.self_attn.v_proj.bias"] = torch.randn(12)
    weights = convert.WeightMap(spec)
    for name in _megatron_names(2):
        if name.endswith("linear_qkv.bias") and ".layers.1." in name:
            continue
        rule = weights.rule(name)
        dim = next((d for suffix, d in _PARTITION.items() if name.endswith(suffix)), None) if tp > 1 else None
        shards = [weights.to_local(rule, state.__getitem__, tp_rank=r, tp_size=tp, partition_dim=dim)
                  for r in range(tp)]
        assert len({s.shape for s in shards}) == 1
        back = weights.to_hf(rule, shards, dim)
        assert set(back) == set(rule.hf_keys)
        for key, value in back.items():
            assert torch.equal(value, state[key]), (name, key)


def test_qkv_layout_is_megatrons_per_group_order():
    hf_config = transformers.AutoConfig.for_model("llama", hidden_size=8, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=2, intermediate_size=8)
    weights = convert.WeightMap(convert.model_spec(hf_config))
    q = torch.arange(8.0)[:, None].expand(8, 8) + 100  # heads q0..q3, 2 rows each
    k = torch.arange(4.0)[:, None].expand(4, 8) + 200
    v = torch.arange(4.0)[:, None].expand(4, 8) + 300
    fused = weights._interleave_qkv(q, k, v)[:, 0].tolist()
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    assert fused == [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]


def test_unsupported_architectures_are_clear_errors():
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        convert.model_spec(transformers.AutoConfig.for_model("gpt2"))
    with pytest.raises(ConfigError, match="tensor parallel size 4 must divide"):
        convert.model_spec(transformers.AutoConfig.for_model("qwen2", num_attention_heads=4,
                                                             num_key_value_heads=2), tp_size=4)
    yarn = transformers.AutoConfig.for_model("llama", rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                                       "rope_theta": 10000.0})
    with pytest.raises(ConfigError, match="rope_type 'yarn'"):
        convert.model_spec(yarn)
