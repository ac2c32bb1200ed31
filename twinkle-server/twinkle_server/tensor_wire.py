"""Tensors on the wire, safely: JSON documents whose tensors are ``{"$tensor": {"dtype", "shape", "data"}}``.

``data`` is the tensor's raw little-endian bytes in base64 (row-major, contiguous). Nothing is ever pickled:
decoding builds tensors from a dtype on a fixed list, a shape and exactly ``prod(shape) * itemsize`` bytes,
and refuses anything else (:class:`~twinkle_server.errors.BadRequest`, naming the path of the bad value)::

    body = encode({"inputs": {"input_ids": torch.tensor([[1, 2, 3]])}, "lr": 1e-4})   # JSON-safe dict
    decode(body)["inputs"]["input_ids"]                                               # the same tensor

Everything else JSON carries (dicts with string keys, lists, str, int, float, bool, None) passes as it is;
tuples become lists and numpy arrays become tensors. ``Limits`` bounds one document: dimensions, elements per
tensor, elements in all, nesting depth.
"""

from __future__ import annotations

import base64
import binascii
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from twinkle_server.errors import BadRequest

TENSOR_KEY = "$tensor"

#: the dtypes a tensor may have on the wire (name -> torch dtype); anything else is refused both ways
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Limits:
    """What one decoded document may hold."""

    max_dims: int = 8
    max_elements: int = 1 << 28          # per tensor
    max_total_elements: int = 1 << 30    # over the document
    max_depth: int = 32


DEFAULT_LIMITS = Limits()


# ---------------------------------------------------------------------------------------------- encoding
def encode_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """One tensor as ``{"$tensor": {...}}`` (moved to the CPU, detached, made contiguous)."""
    name = _NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"tensor dtype {tensor.dtype} cannot go on the wire; supported: {', '.join(DTYPES)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    if sys.byteorder != "little" and flat.element_size() > 1:
        raw = _swap_bytes(raw, flat.element_size())
    return {TENSOR_KEY: {"dtype": name, "shape": list(tensor.shape), "data": base64.b64encode(raw).decode("ascii")}}


def encode(value: Any) -> Any:
    """``value`` (tensors, numpy arrays, dicts with str keys, lists, tuples, JSON scalars) made JSON-safe."""
    if isinstance(value, torch.Tensor):
        return encode_tensor(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"dict keys must be strings on the wire, got {key!r}")
            out[key] = encode(item)
        if TENSOR_KEY in out:
            raise TypeError(f"a dict key {TENSOR_KEY!r} is reserved on the wire (it marks a tensor)")
        return out
    if isinstance(value, (list, tuple)):
        return [encode(item) for item in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        if isinstance(value, numpy.ndarray):
            return encode_tensor(torch.from_numpy(value.copy()))
        if isinstance(value, numpy.generic):
            return value.item()
    raise TypeError(f"{type(value).__name__} cannot go on the wire (tensors, dicts, lists, numbers, strings)")


def jsonable(value: Any) -> Any:
    """Like :func:`encode`, but what cannot go on the wire becomes something that can (for descriptions such as
    ``get_train_configs``: a config object's ``to_dict()``, a set as a sorted list, else its ``str``)."""
    if isinstance(value, torch.Tensor):
        return encode_tensor(value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((jsonable(v) for v in value), key=repr)
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        try:
            return jsonable(to_dict())
        except Exception:  # noqa: BLE001 - a description falls back to the text
            pass
    try:
        return encode(value)
    except TypeError:
        return str(value)


# ---------------------------------------------------------------------------------------------- decoding
def decode(value: Any, *, limits: Limits = DEFAULT_LIMITS, where: str = "body") -> Any:
    """A JSON document from :func:`encode` back to tensors; :class:`BadRequest` for anything malformed."""
    budget = [limits.max_total_elements]
    return _decode(value, limits, where, 0, budget)


def _decode(value: Any, limits: Limits, where: str, depth: int, budget: list[int]) -> Any:
    if depth > limits.max_depth:
        raise BadRequest(f"{where}: nested deeper than {limits.max_depth} levels")
    if isinstance(value, dict):
        if TENSOR_KEY in value:
            if len(value) != 1:
                raise BadRequest(f"{where}: a tensor is {{{TENSOR_KEY!r}: {{dtype, shape, data}}}} with no other key, "
                                 f"got keys {sorted(value)}")
            return decode_tensor(value[TENSOR_KEY], limits=limits, where=where, budget=budget)
        return {k: _decode(v, limits, f"{where}.{k}", depth + 1, budget) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, limits, f"{where}[{i}]", depth + 1, budget) for i, v in enumerate(value)]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise BadRequest(f"{where}: unexpected {type(value).__name__}")


def decode_tensor(spec: Any, *, limits: Limits = DEFAULT_LIMITS, where: str = "tensor",
                  budget: list[int] | None = None) -> torch.Tensor:
    """One ``{"dtype", "shape", "data"}`` spec to a tensor, every field checked before any memory is taken."""
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data"}:
        keys = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
        raise BadRequest(f"{where}: a tensor needs exactly dtype, shape and data, got {keys}")
    dtype_name, shape, data = spec["dtype"], spec["shape"], spec["data"]
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise BadRequest(f"{where}: dtype {dtype_name!r} is not accepted; use one of {', '.join(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > limits.max_dims
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise BadRequest(f"{where}: shape must be a list of at most {limits.max_dims} non-negative integers, "
                         f"got {shape!r}")
    numel = math.prod(shape)
    if numel > limits.max_elements:
        raise BadRequest(f"{where}: shape {shape} holds {numel} elements, over the limit of {limits.max_elements} "
                         f"per tensor; send smaller batches")
    if budget is not None:
        budget[0] -= numel
        if budget[0] < 0:
            raise BadRequest(f"{where}: the request holds more than {limits.max_total_elements} tensor elements in "
                             f"all; send smaller batches")
    if not isinstance(data, str):
        raise BadRequest(f"{where}: data must be a base64 string of the raw little-endian bytes")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = numel * itemsize
    if len(data) > 4 * (expected // 3 + 1) + 4:  # checked before decoding: no huge allocation on a lie
        raise BadRequest(f"{where}: {len(data)} base64 characters for shape {shape} {dtype_name} "
                         f"({expected} bytes)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: data is not valid base64") from None
    if len(raw) != expected:
        raise BadRequest(f"{where}: shape {shape} of {dtype_name} needs {expected} bytes, data holds {len(raw)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if sys.byteorder != "little" and itemsize > 1:
        raw = _swap_bytes(raw, itemsize)
    if dtype is torch.bool and raw.translate(None, b"\x00\x01"):
        raise BadRequest(f"{where}: a bool tensor's bytes must be 0 or 1")
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)


def _swap_bytes(raw: bytes, itemsize: int) -> bytes:
    swapped = bytearray(raw)
    for start in range(0, len(raw), itemsize):
        swapped[start:start + itemsize] = raw[start:start + itemsize][::-1]
    return bytes(swapped)


__all__ = ["DEFAULT_LIMITS", "DTYPES", "Limits", "TENSOR_KEY", "decode", "decode_tensor", "encode", "encode_tensor",
           "jsonable"]
