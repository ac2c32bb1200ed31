"""Importing DeepSpeed and creating its engines for :class:`~twinkle_backend_hf.strategies.deepspeed.DeepSpeedStrategy`.

The import picks DeepSpeed's accelerator, quiets its logger and, on CPU, keeps DeepSpeed from compiling an
op ZeRO training never uses. The engines are built from an :class:`EngineSettings` and the wrapped module:
one training engine for every optimizer registered on it, or (ZeRO-3, a frozen model) an engine without
optimizer that only partitions the weights.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twinkle_backend_hf.strategies.deepspeed_config import build_config
from twinkle_backend_hf.strategies.deepspeed_optimizer_group import OptimizerGroup
from twinkle_backend_hf.strategies.model_parts import requiring_grad
from twinkle_core.errors import ConfigError

if TYPE_CHECKING:
    from twinkle_backend_hf.strategies.deepspeed_module import DeepSpeedModule

_INSTALL_HINT = "pip install 'twinkle-backend-hf[deepspeed]' (deepspeed>=0.16 and ninja)"


def import_deepspeed(accelerator_name: str | None = None) -> Any:
    if accelerator_name == "cpu":
        # DeepSpeed picks its accelerator once, at import; on a CPU-only job make that the CPU one.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(f"strategy 'deepspeed' needs DeepSpeed, which is not installed: {_INSTALL_HINT}") from exc
    if not os.environ.get("TWINKLE_DEEPSPEED_VERBOSE"):
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
    return deepspeed


def skip_cpu_inference_comm_op() -> None:
    """Do not JIT-compile DeepSpeed's CPU shared-memory all-reduce (``deepspeed_shm_comm``).

    DeepSpeed's torch comm backend builds it when it starts, but only ``inference_all_reduce`` (AutoTP
    inference) uses it; ZeRO training goes through gloo. Building it takes g++, ninja and a minute or
    two on a cold cache. ``deepspeed.ops.__compatible_ops__`` is DeepSpeed's editable per-process table
    of usable ops. ``TWINKLE_DEEPSPEED_SHM_COMM=1`` keeps the op.
    """
    if os.environ.get("TWINKLE_DEEPSPEED_SHM_COMM", "") not in ("", "0"):
        return
    try:
        import deepspeed.ops

        table = deepspeed.ops.__compatible_ops__
    except Exception:  # pragma: no cover - an older layout: leave DeepSpeed alone
        return
    if isinstance(table, dict) and "deepspeed_shm_comm" in table:
        table["deepspeed_shm_comm"] = False


@dataclass(frozen=True)
class EngineSettings:
    """What every engine of one strategy is built with (``bf16``: DeepSpeed's bf16 mode, from the precision)."""

    stage: int
    offload_optimizer: bool
    offload_param: bool
    bf16: bool
    user_config: dict[str, Any] = field(default_factory=dict)


def create_training_engine(deepspeed: Any, settings: EngineSettings, wrapped: DeepSpeedModule) -> tuple[Any, Any]:
    """The one engine for every optimizer registered on ``wrapped``, and the :class:`OptimizerGroup` presenting
    them to it (``None`` with a single optimizer)."""
    if not wrapped.handles:
        raise ConfigError("strategy 'deepspeed' needs an optimizer: call set_optimizer(...) first")
    module = wrapped.module
    if any(p.grad is not None for p in module.parameters()):
        raise ConfigError("strategy 'deepspeed': gradients were computed before set_optimizer(); call "
                          "set_optimizer before the first forward_backward")
    optimizers = [handle.optimizer for handle in wrapped.handles]
    steps = {handle.gradient_accumulation_steps for handle in wrapped.handles}
    config = build_config(stage=settings.stage, offload_optimizer=settings.offload_optimizer,
                          offload_param=settings.offload_param,
                          gradient_accumulation_steps=steps.pop() if len(steps) == 1 else 1,
                          bf16=settings.bf16, user_config=settings.user_config)
    group = optimizers[0] if len(optimizers) == 1 else OptimizerGroup(optimizers)
    # DeepSpeed takes the parameters that require grad *now*; adapters that are not active
    # (PEFT freezes them) must be included too.
    with requiring_grad(wrapped.owned_parameters()):
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=group, config=config,
                                               dist_init_required=False)
    return engine, group if isinstance(group, OptimizerGroup) else None


def create_inference_engine(deepspeed: Any, settings: EngineSettings, module: Any) -> Any:
    """A ZeRO-3 engine without optimizer that partitions ``module``'s weights (evaluation mode)."""
    config = build_config(stage=3, offload_optimizer=False, offload_param=settings.offload_param,
                          gradient_accumulation_steps=1, bf16=settings.bf16, user_config=settings.user_config)
    engine, _, _, _ = deepspeed.initialize(model=module, config=config, dist_init_required=False)
    engine.eval()
    return engine
