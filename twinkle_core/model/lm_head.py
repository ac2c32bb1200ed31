"""Run a network without its LM head, keeping what a loss needs to apply the head itself.

Used by ``TorchTwinkleModel.forward_backward`` when the loss fuses the head (``Loss.fuses_lm_head``): the
head's ``forward`` is replaced, for one call of the network, by one that records its input and returns an
empty ``[..., 0]`` tensor, so the ``[N, V]`` logits are never computed. Works for any network whose logits
are ``head(final hidden states)``; the backend vouches for that (``TorchTwinkleModel.output_layer``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["deferred", "fusable"]


@contextlib.contextmanager
def deferred(head: torch.nn.Linear) -> Iterator[dict[str, Any]]:
    """Yield a mapping that, after the network ran, holds ``hidden_states``, ``lm_head_weight`` and
    ``lm_head_bias`` in the dtype the head would have computed in (the autocast dtype under autocast), cast
    inside autograd so gradients reach the parameters as they would through the head."""
    captured: dict[str, Any] = {}

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        captured.update(hidden_states=hidden.to(dtype), lm_head_weight=head.weight.to(dtype),
                        lm_head_bias=None if head.bias is None else head.bias.to(dtype))
        return hidden.new_empty(*hidden.shape[:-1], 0)

    head.forward = capture  # an instance attribute shadows the class's forward for this call only
    try:
        yield captured
    finally:
        del head.forward
    if not captured:
        raise RuntimeError(f"the network never called its LM head ({type(head).__name__}); the backend's "
                           f"output_layer() names the wrong module")


def fusable(head: torch.nn.Linear | None, loss: Any, readers: list[Any], *,
            forward_is_collective: bool) -> torch.nn.Linear | None:
    """``head`` when the loss applies it itself (``Loss.fuses_lm_head``) and no one else needs the logits;
    ``None`` otherwise. ``readers``: the task and metrics, each of which reads logits unless it says not."""
    fuses = getattr(loss, "fuses_lm_head", None)
    if head is None or fuses is None or not fuses(head.out_features):
        return None
    # a sharding strategy gathers the head's weight only inside its forward; a task or metric may read logits
    if forward_is_collective or any(getattr(r, "reads_logits", True) for r in readers if r):
        return None
    return head
