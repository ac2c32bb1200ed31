"""Conformance factories: tiny Transformers models built from configs (no download)."""

from __future__ import annotations

from typing import Any

from twinkle_core.testing.conformance import CONFORMANCE_VOCAB_SIZE


def tiny_qwen2_config(vocab_size: int = CONFORMANCE_VOCAB_SIZE, **overrides: Any) -> dict[str, Any]:
    return {"model_type": "qwen2", "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "tie_word_embeddings": False, **overrides}


def make_tiny_model(*, seed: int = 0, config: dict[str, Any] | None = None, **options: Any) -> Any:
    from twinkle_backend_hf.model import TransformersModel

    return TransformersModel(config=config or tiny_qwen2_config(), seed=seed, **options)


def make_tiny_multi_lora_model(*, seed: int = 0, config: dict[str, Any] | None = None, **options: Any) -> Any:
    from twinkle_backend_hf.multi_lora import MultiLoraTransformersModel

    return MultiLoraTransformersModel(config=config or tiny_qwen2_config(), seed=seed, **options)
