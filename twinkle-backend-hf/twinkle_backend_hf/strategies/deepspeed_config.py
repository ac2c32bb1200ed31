"""The DeepSpeed configuration that :class:`~twinkle_backend_hf.strategies.deepspeed.DeepSpeedStrategy` generates.

Twinkle owns the optimizer, the learning-rate schedule, gradient normalisation and clipping, so the
generated config leaves those to Twinkle: no ``optimizer`` / ``scheduler`` sections, ``gradient_clipping``
0, and ``zero_allow_untested_optimizer`` so any ``torch.optim`` optimizer can be used. A user ``config``
dict is merged on top (nested dicts key by key) and checked for settings that would contradict that.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from twinkle_core.errors import ConfigError

if TYPE_CHECKING:
    from twinkle_core.precision import Precision

#: sections Twinkle manages itself; setting them in ``config`` would silently fight Twinkle's own
_OWNED_SECTIONS = {
    "optimizer": "pass the optimizer to set_optimizer() instead",
    "scheduler": "use set_lr_scheduler() instead",
}


_FP16_UNSUPPORTED = ("precision 'fp16' is not supported with strategy 'deepspeed' (its torch GradScaler cannot see "
                     "DeepSpeed's partitioned gradients); use precision 'bf16' or 'no'")


def engine_bf16(precision: Precision | None, user_config: dict[str, Any]) -> bool:
    """Whether the engine runs DeepSpeed's bf16 mode: bf16 autocast means it does; fp16 is refused (DeepSpeed
    owns the loss scaling). A ``bf16`` section of the user config has the last word, as it has in the
    generated config."""
    autocast_dtype = precision.autocast_dtype if precision is not None else None
    if autocast_dtype == "float16":
        raise ConfigError(_FP16_UNSUPPORTED)
    configured = (user_config.get("bf16") or {}).get("enabled")
    return bool(autocast_dtype == "bfloat16" if configured is None else configured)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``override``; nested dicts are merged key by key (neither input is changed)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def build_config(*, stage: int, offload_optimizer: bool, offload_param: bool, gradient_accumulation_steps: int,
                 bf16: bool, user_config: dict[str, Any] | None) -> dict[str, Any]:
    """The DeepSpeed config dict for one engine."""
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 2:
        # Twinkle reads the partitioned gradients between backward and step; keep reduction on the
        # main stream so they are complete when it does.
        zero["overlap_comm"] = False
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    config: dict[str, Any] = {
        # One "micro-batch" per backward; Twinkle counts tokens, not samples, so the batch size
        # DeepSpeed derives from these is only bookkeeping.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": int(gradient_accumulation_steps),
        # Twinkle clips (and reports the true pre-clip norm) itself.
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": bool(bf16)},
        "fp16": {"enabled": False},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if user_config:
        if not isinstance(user_config, dict):
            raise ConfigError(f"strategy_options.config must be a dict (a DeepSpeed config), "
                              f"got {type(user_config).__name__}")
        config = deep_merge(config, user_config)
    validate_config(config, stage=stage)
    return config


def validate_config(config: dict[str, Any], *, stage: int) -> None:
    for section, hint in _OWNED_SECTIONS.items():
        if section in config:
            raise ConfigError(f"strategy_options.config.{section} is managed by Twinkle with strategy 'deepspeed'; "
                              f"{hint}")
    if float(config.get("gradient_clipping") or 0.0) != 0.0:
        raise ConfigError("strategy_options.config.gradient_clipping must be 0 with strategy 'deepspeed': Twinkle "
                          "clips gradients itself; pass max_grad_norm to clip_grad_and_step()/clip_grad_norm()")
    if (config.get("fp16") or {}).get("enabled"):
        raise ConfigError("strategy_options.config.fp16 is not supported with strategy 'deepspeed'; use "
                          "precision 'bf16' (DeepSpeed bf16 with fp32 master weights) or 'no'")
    zero = config.get("zero_optimization") or {}
    if int(zero.get("stage", stage)) != stage:
        raise ConfigError(f"strategy_options.config.zero_optimization.stage={zero.get('stage')} contradicts "
                          f"strategy_options.stage={stage}; set only strategy_options.stage")
