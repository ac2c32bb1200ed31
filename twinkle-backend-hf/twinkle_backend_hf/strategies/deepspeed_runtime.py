"""Importing DeepSpeed for :class:`~twinkle_backend_hf.strategies.deepspeed.DeepSpeedStrategy`.

The import picks DeepSpeed's accelerator, quiets its logger and, on CPU, keeps DeepSpeed from compiling an
op ZeRO training never uses. The strategy module re-exports both functions.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from twinkle_core.errors import ConfigError

_INSTALL_HINT = "pip install 'twinkle-backend-hf[deepspeed]' (deepspeed>=0.16 and ninja)"


def _import_deepspeed(accelerator_name: str | None = None) -> Any:
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


def _skip_cpu_inference_comm_op() -> None:
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

