"""Conformance factories: tiny Megatron models built from Hugging Face configs (no download)."""

from __future__ import annotations

from typing import Any

from twinkle_core.testing.conformance import CONFORMANCE_VOCAB_SIZE


def tiny_qwen2_config(vocab_size: int = CONFORMANCE_VOCAB_SIZE, **overrides: Any) -> dict[str, Any]:
    """The same tiny Qwen2 as the HF backend's ``tiny_qwen2_config`` (so weights and losses compare)."""
    return {"model_type": "qwen2", "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "tie_word_embeddings": False, **overrides}


def tiny_llama_config(vocab_size: int = CONFORMANCE_VOCAB_SIZE, **overrides: Any) -> dict[str, Any]:
    return {"model_type": "llama", "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 256, "tie_word_embeddings": False, **overrides}


def make_tiny_model(*, seed: int = 0, config: dict[str, Any] | None = None, **options: Any) -> Any:
    from twinkle_backend_megatron.model import MegatronModel

    return MegatronModel(config=config or tiny_qwen2_config(), seed=seed, **options)


def make_tiny_multi_lora_model(*, seed: int = 0, config: dict[str, Any] | None = None, **options: Any) -> Any:
    from twinkle_backend_megatron.multi_lora import MultiLoraMegatronModel

    return MultiLoraMegatronModel(config=config or tiny_qwen2_config(), seed=seed, **options)
