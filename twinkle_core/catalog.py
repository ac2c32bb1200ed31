"""Which distribution provides a well-known plugin name, so a missing one gets a `pip install` hint.

This is data for error messages only; the core never branches on it.
"""

from __future__ import annotations

import difflib

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
    ("runtime", "ray"): "twinkle-ray",
    ("command", "chat"): _HF,
    ("command", "export"): _HF,
    ("command", "eval"): _HF,
    ("command", "serve-model"): _HF,
    ("task", "embedding"): "twinkle-embedding",
    ("loss", "infonce"): "twinkle-embedding",
    ("task", "vlm"): "twinkle-vlm",
    ("task", "vlm_preference"): "twinkle-vlm",
    ("task", "preference"): _RL,
    ("loss", "dpo"): _RL,
    ("loss", "simpo"): _RL,
    ("loss", "orpo"): _RL,
    ("task", "grpo"): _RL,
    ("environment", "calculator"): _RL,
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
    "wandb": "pip install wandb",
    "mlflow": "pip install mlflow",
    "swanlab": "pip install swanlab",
}


#: distributions named above that do not exist yet: the hint says so instead of sending users to pip
PLANNED: frozenset[str] = frozenset()


def install_hint(kind: str, name: str) -> str | None:
    dist = PROVIDERS.get((kind, name))
    if dist in PLANNED:
        return f"nothing provides it yet: {dist} is planned but not released (see the README's 'What runs where')"
    return f"pip install {dist}" if dist else None


# Names users write for a plugin that is registered under another (other frameworks' spellings).
ALIASES: dict[tuple[str, str], str] = {
    ("precision", "fp32"): "no",
    ("precision", "float32"): "no",
    ("precision", "none"): "no",
    ("precision", "bfloat16"): "bf16",
    ("precision", "float16"): "fp16",
    ("precision", "half"): "fp16",
    ("strategy", "fsdp"): "native_fsdp",
    ("strategy", "fsdp2"): "native_fsdp",
    ("strategy", "zero"): "deepspeed",
    ("strategy", "zero2"): "deepspeed",
    ("strategy", "zero3"): "deepspeed",
    ("loss", "ce"): "cross_entropy",
    ("tracker", "tb"): "tensorboard",
    ("tracker", "tensorboardx"): "tensorboard",
    ("tracker", "weights_and_biases"): "wandb",
    ("tracker", "weightsandbiases"): "wandb",
    ("tracker", "ml_flow"): "mlflow",
    ("tracker", "swan"): "swanlab",
}

_PLURALS = {"strategy": "strategies", "loss": "losses", "conformance": "conformance targets"}


def plural(kind: str) -> str:
    return _PLURALS.get(kind, f"{kind}s")


def did_you_mean(kind: str, name: str, available: list[str]) -> str | None:
    """The installed name a user most likely meant: the same name in another case (``adamw`` for ``AdamW``), a
    well-known alias (``fp32`` for ``no``, ``fsdp`` for ``native_fsdp``), or the closest spelling."""
    folded = {a.lower(): a for a in available}
    if name.lower() in folded:
        return folded[name.lower()]
    alias = ALIASES.get((kind, name.lower()))
    if alias is not None and alias in available:
        return alias
    close = difflib.get_close_matches(name.lower(), list(folded), n=1, cutoff=0.75)
    return folded[close[0]] if close else None
