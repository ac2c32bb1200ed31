"""The long-context memory model (:mod:`twinkle_core.memory_model`): hand-computed terms, the 7B/128k example of
its docstring, a measured tiny model, and what ``twinkle train --dry-run`` prints."""

from __future__ import annotations

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.memory_model import GIB, ModelShape, estimate_memory, recipe_estimate_lines
from twinkle_core.mesh import DeviceMesh
from twinkle_core.strategy import Strategy

#: hidden 8, 2 heads of 4, 1 key/value head, MLP 16, vocabulary 10, one layer
SMALL = ModelShape(hidden=8, layers=1, heads=2, kv_heads=1, vocab=10, intermediate=16)
#: Qwen2.5-7B's shape (config.json of Qwen/Qwen2.5-7B)
QWEN_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "vocab_size": 152064, "intermediate_size": 18944, "tie_word_embeddings": False}


def test_terms_match_the_hand_computed_numbers():
    # linears 8x8 + 2 x 8x4 + 8x8 + 2 x 8x16 + 16x8 = 576, two norms 16, embedding and head 2 x 80, final norm 8
    assert SMALL.parameter_count() == 576 + 16 + 160 + 8
    assert SMALL.lora_parameter_count(2) == 2 * (16 + 12 + 12 + 16 + 24 + 24 + 24)
    hybrid = estimate_memory(SMALL, rows=1, seq_len=16, mesh=DeviceMesh(cp=2, sp=2), precision="bf16", flash=False)
    assert hybrid.tokens_per_rank == 4  # 16 tokens over cp x sp = 4 ranks
    assert (hybrid.parameters, hybrid.gradients, hybrid.optimizer_states) == (760 * 4, 760 * 4, 760 * 8)
    assert hybrid.activations == 4 * 2 * (4 * 8 + 2 * 8 + 2 * 4 + 4 * 16)  # tokens x bf16 x per-token elements
    assert hybrid.attention_scores == 1 * (2 // 2) * (16 // 2) ** 2 * 8  # one ring block: fp32 scores and probs
    assert hybrid.logits == 4 * 10 * 8  # fp32 logits and their gradient
    ulysses = estimate_memory(SMALL, rows=1, seq_len=16, mesh=DeviceMesh(sp=2), precision="bf16", flash=False)
    assert ulysses.attention_scores == 1 * 1 * 16 * 16 * 4  # Ulysses keeps H/sp heads x the whole sequence
    lora = estimate_memory(SMALL, rows=1, seq_len=16, lora_rank=2, gradient_checkpointing=True)
    assert (lora.gradients, lora.optimizer_states) == (256 * 4, 256 * 8)
    assert lora.activations == 16 * 2 * (1 * 8 + 120)  # each layer's input, plus one layer during its recompute
    assert lora.total == sum((lora.parameters, lora.gradients, lora.optimizer_states, lora.activations, lora.logits))


def test_sharding_and_vocabulary_parallel_loss_divide_their_terms():
    fsdp = estimate_memory(SMALL, rows=1, seq_len=16, mesh=DeviceMesh(fsdp=4), state_shards=4)
    assert fsdp.parameters == 760 * 4 // 4
    tp = estimate_memory(SMALL, rows=1, seq_len=16, mesh=DeviceMesh(tp=2), vocab_parallel_loss=True)
    assert tp.logits == 16 * 10 * 8 // 2 and tp.parameters == 760 * 4 // 2


def test_128k_tokens_of_a_7b_model_fit_80_gb_under_cp8_only():
    shape = ModelShape.from_config(QWEN_7B)
    assert shape.parameter_count() == pytest.approx(7.62e9, rel=0.01)  # Qwen2.5-7B has 7.61 billion
    budget = 80e9

    def per_rank(cp, sp=1, fused_ring=True):
        return estimate_memory(shape, rows=1, seq_len=131072, mesh=DeviceMesh(cp=cp, sp=sp), precision="bf16",
                               lora_rank=8, gradient_checkpointing=True, fused_ring=fused_ring)

    single, cp8 = per_rank(1), per_rank(8)
    assert not single.fits(budget) and cp8.fits(budget)
    assert single.logits > budget  # the [131072, 152064] fp32 logits alone: 159 GB
    assert 50e9 < cp8.total < 65e9 and 230e9 < single.total < 250e9  # the docstring's numbers
    # Twinkle's ring computes each block with matmuls: at cp=8 one block is 28 x 16384^2 x 8 bytes = 60 GB, which
    # Ulysses inside (sp=4: 7 heads per rank) brings back under the budget
    assert per_rank(8, fused_ring=False).attention_scores == 28 * 16384 ** 2 * 8
    assert not per_rank(8, fused_ring=False).fits(budget) and per_rank(8, sp=4, fused_ring=False).fits(budget)


def test_estimate_is_the_measured_size_of_a_tiny_models_saved_activations():
    """The bytes autograd keeps for backward (every saved tensor not sharing a parameter's storage) of a tiny Qwen2
    on 2 x 512 tokens in fp32, against the activations + logits terms: the same order (measured: 10.9 MB vs 10.0)."""
    import torch
    import transformers

    config = {**QWEN_7B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "intermediate_size": 128}
    hf_config = transformers.AutoConfig.for_model("qwen2", max_position_embeddings=1024, **config)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(hf_config)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, 256, (2, 512))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=ids, labels=ids)
    estimate = estimate_memory(ModelShape.from_config(config), rows=2, seq_len=512, precision="no")
    measured = sum(saved.values())
    assert 0.5 < (estimate.activations + estimate.logits) / measured < 2, (estimate, measured)


def test_unknown_configs_and_precisions_are_refused():
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelShape.from_config({"num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="unknown precision"):
        estimate_memory(SMALL, rows=1, seq_len=8, precision="fp4")


def test_dry_run_lines_come_from_the_recipe(tmp_path):
    from types import SimpleNamespace

    (tmp_path / "config.json").write_text(__import__("json").dumps(QWEN_7B))
    recipe = SimpleNamespace(
        model=SimpleNamespace(config=None, model_id=str(tmp_path), adapter={"type": "lora", "r": 8},
                              attn_implementation=None, gradient_checkpointing=True),
        data=SimpleNamespace(max_length=131072, batch_size=1), mesh={"cp": 8}, precision="bf16",
        strategy=SimpleNamespace(options={}))
    lines = recipe_estimate_lines(recipe, Strategy, 8)
    assert lines[0].startswith("memory model (cp=8; 1 x 131072 tokens") and "16384 tokens per rank" in lines[0]
    total = estimate_memory(ModelShape.from_config(QWEN_7B), rows=1, seq_len=131072, mesh=DeviceMesh(cp=8),
                            lora_rank=8, gradient_checkpointing=True).total
    assert f"total {total / GIB:.2f} GiB" in lines[1]
    recipe.data.max_length = None
    assert "set data.max_length" in recipe_estimate_lines(recipe, Strategy, 8)[0]
    recipe.data.max_length, recipe.model.config = 1024, {"model_type": "bert", "hidden_size": 8}
    assert "not available for this model" in recipe_estimate_lines(recipe, Strategy, 8)[0]
