"""The batches of the native API's compute calls: checked before they reach the shared model, and the outputs a
caller may get back.

Token ids and labels must lie inside the vocabulary, shapes must match, and a batch holds at most
``limits.max_tokens_per_request`` tokens: an out-of-range index would be a device-side assert on a GPU, which breaks
the process for every tenant.
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_server import tensor_wire
from twinkle_server.errors import BadRequest, PayloadTooLarge

#: network inputs a batch may carry (the rest of a batch is for the loss)
NETWORK_INPUTS = ("input_ids", "attention_mask", "position_ids")
IGNORE_INDEX = -100
#: per-token outputs a caller may ask for (``return_outputs``); others (hidden states, the LM head's weight when a
#: loss fuses it) stay on the server. ``label_logprobs`` / ``label_mask`` (``[B, T - 1]``): the log-probability of
#: each next label under ``softmax(logits / temperature)``, computed on the server (a fraction of the logits' size)
RETURNABLE = ("logits", "label_logprobs", "label_mask")


def host_vocab_size(host: Any) -> int:
    size = getattr(host, "vocab_size", None)
    if size is None:
        size = host.model.export_config().get_text_config().vocab_size
    return int(size)


def host_max_positions(host: Any) -> int | None:
    if hasattr(host, "max_positions"):
        return host.max_positions
    config = host.model.export_config()
    return getattr(config.get_text_config() if config is not None else None, "max_position_embeddings", None)


def check_batch(inputs: Any, *, vocab_size: int, max_tokens: int, max_positions: int | None,
                network_inputs: tuple[str, ...], method: str) -> dict[str, Any]:
    """Refuse a batch the shared model must never see: token ids or labels outside the vocabulary, index tensors
    out of range, shapes that do not match, more than ``max_tokens`` tokens."""
    where = f"{method}(inputs=...)"
    if not isinstance(inputs, dict):
        raise BadRequest(f"{where}: inputs must be a dict of tensors (a collated batch)")
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise BadRequest(f"{where}: input_ids must be an int64 tensor [batch, length], got "
                         f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    rows, length = ids.shape
    if rows == 0 or length == 0:
        raise BadRequest(f"{where}: input_ids is empty {tuple(ids.shape)}")
    if ids.numel() > max_tokens:
        raise BadRequest(f"{where}: {ids.numel()} tokens, over the server's limit of {max_tokens} "
                         f"(limits.max_tokens_per_request); send smaller batches")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise BadRequest(f"{where}: input_ids must be in [0, {vocab_size}) (the vocabulary), got "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    for key in network_inputs:
        if key in inputs and key not in NETWORK_INPUTS:
            raise BadRequest(f"{where}: the native API takes {', '.join(NETWORK_INPUTS)} as network inputs, not "
                             f"{key!r}")

    def same_shape(key: str, integer: bool = True) -> torch.Tensor | None:
        value = inputs.get(key)
        if value is None:
            return None
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (rows, length):
            raise BadRequest(f"{where}: {key} must be a tensor shaped like input_ids {[rows, length]}, got "
                             f"{list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
        if integer and (value.is_floating_point() or value.is_complex()):
            raise BadRequest(f"{where}: {key} must be an integer tensor, got {value.dtype}")
        return value

    mask = same_shape("attention_mask")
    if mask is not None and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise BadRequest(f"{where}: attention_mask must hold 0 and 1 only")
    positions = same_shape("position_ids")
    if positions is not None:
        high = max_positions if max_positions is not None else length
        if int(positions.min()) < 0 or int(positions.max()) >= max(high, 1):
            raise BadRequest(f"{where}: position_ids must be in [0, {high}), got [{int(positions.min())}, "
                             f"{int(positions.max())}]")
    labels = same_shape("labels")
    if labels is not None:
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))
        if bool(bad.any()):
            raise BadRequest(f"{where}: labels must be token ids in [0, {vocab_size}) or {IGNORE_INDEX} (ignored)")
    sequence_index = same_shape("sequence_index")
    if sequence_index is not None:
        pair_index = inputs.get("pair_index")
        count = pair_index.numel() if isinstance(pair_index, torch.Tensor) else rows * length
        if int(sequence_index.min()) < -1 or int(sequence_index.max()) >= count:
            raise BadRequest(f"{where}: sequence_index must be in [-1, {count}) (-1: padding)")
    return inputs


def checked_batch(call_args: dict[str, Any], host: Any, service: Any, method: str) -> dict[str, Any]:
    """``call_args["inputs"]``, checked against ``host``'s model and the server's limits."""
    limits = service.config.limits
    return check_batch(call_args.get("inputs"), vocab_size=host_vocab_size(host),
                       max_tokens=limits.max_tokens_per_request, max_positions=host_max_positions(host),
                       network_inputs=tuple(host.model.network_input_keys), method=method)


def _small(value: Any) -> bool:
    """A scalar output (the loss, a token count, a metric) rather than a per-token tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() <= 1
    return value is None or isinstance(value, (bool, int, float, str))


def wanted_outputs(value: Any, method: str, batch: dict[str, Any], host: Any, service: Any) -> list[str]:
    """The per-token outputs ``return_outputs`` asks for, refused when they cannot be returned."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"{method}: return_outputs must be a list of output names such as ['logits']")
    unknown = sorted(set(value) - set(RETURNABLE))
    if unknown:
        raise BadRequest(f"{method}: return_outputs {unknown} cannot be returned; returnable: {', '.join(RETURNABLE)}")
    if {"label_logprobs", "label_mask"} & set(value) and not isinstance(batch.get("labels"), torch.Tensor):
        raise BadRequest(f"{method}: label_logprobs needs labels in the batch")
    if "logits" in value:
        rows, length = batch["input_ids"].shape
        size, limit = rows * length * host_vocab_size(host) * 4, 4 * service.config.limits.max_body_bytes
        if size > limit:
            raise PayloadTooLarge(f"{method}: the logits of {rows} x {length} tokens are {size >> 20} MiB, over the "
                                  f"server's response limit of {limit >> 20} MiB (4 x limits.max_body_mb); ask for "
                                  f"return_outputs=['label_logprobs'] (the labels' log-probs only) or send fewer "
                                  f"tokens")
    return value


def encode_outputs(result: dict[str, Any], batch: dict[str, Any], wanted: list[str],
                   temperature: float) -> dict[str, Any]:
    """The scalars of ``result`` (loss, token count, metrics) and the per-token outputs asked for that exist."""
    out = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in result.items()
           if (k in wanted and k in RETURNABLE) or _small(v)}
    if {"label_logprobs", "label_mask"} & set(wanted) and isinstance(result.get("logits"), torch.Tensor):
        from twinkle_core.loss.logprobs import token_logprobs

        with torch.no_grad():
            logps, mask = token_logprobs(result["logits"].detach(), batch["labels"], temperature=temperature)
        out["label_logprobs"], out["label_mask"] = logps, mask
    return tensor_wire.encode({k: v for k, v in out.items() if k in wanted or _small(v)})

