"""What runs inside each rank of a base model's worker group (the front is :mod:`twinkle_server.ray_host`): the
rank's own :class:`~twinkle_server.host.ModelHost`, and the calls the front makes on it.

The functions are module-level, so Ray pickles them by reference and ``TwinkleWorker.apply`` runs them in the
actor. A refusal (the caller's mistake: a :class:`~twinkle_server.errors.ServiceError`, or an error of the kinds
the native API reports as one) comes back as a :class:`Refused` value, so the group stays up; any other exception
is the rank's failure, and the worker group stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from twinkle_core.errors import ConfigError, DataFormatError, PluginNotFoundError
from twinkle_core.loss.base import Loss, LossOutput
from twinkle_server.errors import ServiceError

#: what a rank returns instead of raising: the caller's mistakes (the native API's ``user_errors`` kinds)
REFUSALS = (ServiceError, ConfigError, DataFormatError, PluginNotFoundError, ValueError, TypeError, KeyError,
            IndexError)

_host: Any = None  # this process's ModelHost (one base model per worker group, one rank per process)


@dataclass
class Refused:
    """A call a rank refused; the front raises ``error``."""

    error: BaseException


def refusals_returned(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except REFUSALS as exc:
        return Refused(exc)


def start(name: str, model: dict[str, Any], state_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    """Build this rank's host (its model joins the group's process group); what the front needs to know of it."""
    global _host
    from twinkle_server.host import ModelHost

    _host = ModelHost(name, model, state_dir=state_dir, **options)
    view = _host.model.data_parallel
    return {"dp_rank": view.rank, "dp_size": view.size, "vocab_size": _host.vocab_size,
            "max_positions": _host.max_positions, "eos_ids": sorted(_host.eos_ids), "tokenizer": _host.tokenizer}


def host() -> Any:
    if _host is None:
        raise RuntimeError("no model host in this rank: ray_rank.start was not called")
    return _host


def model() -> Any:
    """This rank's model (what the front's proxy drives: ``RemoteModel.attach``)."""
    return host().model


def call_host(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return refusals_returned(getattr(host(), method), *args, **kwargs)


def call_model(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return refusals_returned(getattr(host().model, method), *args, **kwargs)


def forward_backward(data: list[Any], share: tuple[int, int], adapter_id: str, loss_fn: str,
                     loss_fn_config: dict | None, backward: bool) -> Any:
    """This rank's share ``data[share[0]:share[1]]`` of a Tinker ``forward_backward`` (``forward``: ``backward``
    False). Every rank first checks the *whole* request, so either every rank refuses it, before any rank has
    touched the model, or none does. A rank without a datum of its own (fewer datums than ranks) returns ``None``;
    under ``backward`` it still joins the step's collectives with a backward that adds exactly zero."""
    def run() -> Any:
        h = host()
        h.check_data(data, loss_fn, loss_fn_config)
        start_, stop = share
        if start_ < stop:
            return h.forward_backward(adapter_id, data[start_:stop], loss_fn, loss_fn_config, backward=backward)
        name = h.model_adapter_name(adapter_id)  # NotFound on every rank alike
        if backward:
            zero_backward(h.model, name)
        return None
    return refusals_returned(run)


class ZeroLoss(Loss):
    """``0 x sum(logits)``: a backward whose gradient is exactly zero, counted as ``num_tokens=0``."""

    name = "zero"

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any], context: Any = None) -> LossOutput:
        return LossOutput(loss=outputs["logits"].float().sum() * 0.0, num_tokens=0)


def zero_backward(model: Any, adapter_name: str) -> None:
    """One ``forward_backward`` of adapter ``adapter_name`` on a one-token batch with :class:`ZeroLoss`: the rank
    takes part in the step's collectives and adds nothing to the gradients. The adapter's loss is put back."""
    kept = model.train_state(adapter_name).loss
    model.set_loss(ZeroLoss(), adapter_name=adapter_name)
    try:
        batch = {"input_ids": torch.zeros(1, 1, dtype=torch.long, device=model.device),
                 "attention_mask": torch.ones(1, 1, dtype=torch.long, device=model.device)}
        model.forward_backward(inputs=batch, adapter_name=adapter_name)
    finally:
        model.set_loss(kept, adapter_name=adapter_name)
