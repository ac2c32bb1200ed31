"""Which distribution provides a well-known plugin name, so a missing one gets a `pip install` hint.

This is data for error messages only; the core never branches on it.
"""

from __future__ import annotations

_HF = "twinkle-backend-hf"
_MEGATRON = "twinkle-backend-megatron"
_NPU = "twinkle-backend-npu"
_RL = "twinkle-rl"

PROVIDERS: dict[tuple[str, str], str] = {
    ("model", "TransformersModel"): _HF,
    ("model", "MultiLoraTransformersModel"): _HF,
    ("model", "MegatronModel"): _MEGATRON,
    ("model", "MultiLoraMegatronModel"): _MEGATRON,
    ("strategy", "ddp"): _HF,
    ("strategy", "native_fsdp"): _HF,
    ("strategy", "accelerate"): _HF,
    ("strategy", "deepspeed"): _HF,
    ("strategy", "megatron"): _MEGATRON,
    ("accelerator", "npu"): _NPU,
    ("task", "embedding"): "twinkle-embedding",
    ("loss", "infonce"): "twinkle-embedding",
    ("task", "vlm"): "twinkle-vlm",
    ("task", "preference"): _RL,
    ("loss", "dpo"): _RL,
    ("loss", "simpo"): _RL,
    ("loss", "orpo"): _RL,
    ("task", "grpo"): _RL,
    ("task", "ppo"): _RL,
    ("loss", "grpo"): _RL,
    ("loss", "dapo"): _RL,
    ("loss", "dr_grpo"): _RL,
    ("loss", "gspo"): _RL,
    ("loss", "ppo"): _RL,
    ("loss", "ppo_value"): _RL,
    ("reward", "exact_match"): _RL,
    ("reward", "numeric_answer"): _RL,
    ("sampler", "hf_generate"): _RL,
    ("conformance", "hf"): _HF,
    ("conformance", "megatron"): _MEGATRON,
}

# Python packages behind optional built-ins (e.g. the ``ms://`` source needs modelscope).
EXTRAS: dict[str, str] = {
    "modelscope": "pip install modelscope",
    "huggingface_hub": "pip install huggingface_hub",
    "datasets": "pip install datasets",
    "tensorboard": "pip install tensorboard",
    "matplotlib": "pip install matplotlib",
    "torchao": "pip install torchao",
}


def install_hint(kind: str, name: str) -> str | None:
    dist = PROVIDERS.get((kind, name))
    return f"pip install {dist}" if dist else None
