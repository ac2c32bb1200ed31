"""Activation recompute under autocast.

Twinkle's ``bf16`` / ``fp16`` precision on Megatron is autocast over float32 weights. megatron-core's
``tensor_parallel.checkpoint`` (``CheckpointFunction``) re-runs the checkpointed forward during backward, which
runs outside the forward's autocast context, and unlike ``torch.utils.checkpoint`` it does not restore the autocast
state: the recomputed layer would multiply bf16 activations with float32 weights and fail with a dtype error. The
wrapper installed here records the autocast state when the checkpointed function is called and re-enters it
around every run of that function (the first run, where it is a no-op, and the recompute). It is the same on
every device.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import torch

__all__ = ["SETTINGS", "install"]

#: ``MegatronModel(recompute=...)``: the megatron-core ``TransformerConfig`` options of each choice
SETTINGS: dict[str | None, dict[str, Any]] = {
    None: {},
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},
}

_lock = threading.Lock()
_DEVICE_TYPES = ("cpu", "cuda", "xpu", "npu")


def _autocast_state() -> list[tuple[str, torch.dtype]]:
    state = []
    for device_type in _DEVICE_TYPES:
        try:
            if torch.is_autocast_enabled(device_type):
                state.append((device_type, torch.get_autocast_dtype(device_type)))
        except RuntimeError:  # a device type this torch build does not know
            continue
    return state


def _with_autocast(function: Any, state: list[tuple[str, torch.dtype]]) -> Any:
    @functools.wraps(function)
    def run(*args: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for device_type, dtype in state:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            return function(*args)

    return run


def install() -> None:
    """Wrap ``megatron.core.tensor_parallel.checkpoint`` once per process (every caller looks it up there)."""
    from megatron.core import tensor_parallel

    with _lock:
        original = tensor_parallel.checkpoint
        if getattr(original, "_twinkle_keeps_autocast", False):
            return

        @functools.wraps(original)
        def checkpoint(function: Any, distribute_saved_activations: bool, *args: Any) -> Any:
            state = _autocast_state()
            if state:
                function = _with_autocast(function, state)
            return original(function, distribute_saved_activations, *args)

        checkpoint._twinkle_keeps_autocast = True
        tensor_parallel.checkpoint = checkpoint
