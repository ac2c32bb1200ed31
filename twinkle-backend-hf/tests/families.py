"""Tiny configs (hidden <= 64, 2 layers) of the model families the seed table names."""

from __future__ import annotations

from typing import Any

VOCAB = 64
_DENSE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "tie_word_embeddings": False}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": {"model_type": "qwen2", **_DENSE},                       # Qwen2 / Qwen2.5
    "qwen3": {"model_type": "qwen3", **_DENSE, "head_dim": 8},
    "qwen3_moe": {"model_type": "qwen3_moe", **_DENSE, "head_dim": 8, **_MOE, "decoder_sparse_step": 1},
    "qwen3_5_text": {"model_type": "qwen3_5_text", **_DENSE, "head_dim": 8,
                     "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                     "linear_value_head_dim": 8, "layer_types": ["linear_attention", "full_attention"]},
    "qwen3_5_moe_text": {"model_type": "qwen3_5_moe_text", **_DENSE, "head_dim": 8, **_MOE,
                         "shared_expert_intermediate_size": 32,
                         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                         "linear_value_head_dim": 8, "layer_types": ["linear_attention", "full_attention"]},
    "llama": {"model_type": "llama", **_DENSE},                       # Llama 3, and Yi (same architecture)
    "mistral": {"model_type": "mistral", **_DENSE},
    "glm4": {"model_type": "glm4", **_DENSE, "head_dim": 8, "pad_token_id": 0},
    "deepseek_v3": {"model_type": "deepseek_v3", **_DENSE, "moe_intermediate_size": 32, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4},
    "deepseek_v4": {"model_type": "deepseek_v4", "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "qk_rope_head_dim": 8,
                    "q_lora_rank": 16, "o_lora_rank": 16, "o_groups": 2, "moe_intermediate_size": 32,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "index_n_heads": 2, "index_head_dim": 8,
                    "index_topk": 8, "sliding_window": 8, "max_position_embeddings": 128,
                    "tie_word_embeddings": False},
    "internlm3": {"model_type": "internlm3", **_DENSE, "head_dim": 8},
}
