"""The Tinker SDK's wire formats, decoded into the host's dataclasses and encoded back.

The wire is read with the SDK's own generated types (``tinker.types`` pydantic models for JSON bodies,
``tinker.proto.tinker_public_pb2`` for protobuf ones), so nothing here re-declares it. What the SDK (0.38) sends
and expects, as its code shows:

- ``forward_backward`` bodies are protobuf (``application/x-protobuf``), zstd-compressed when the request carries
  ``Content-Encoding: zstd`` (the client config's ``proto_compress_fwdbwd``; ours says no, both are read).
- every other body is JSON, dumped from the SDK's ``StrictBase`` request models (unknown keys are errors there too).
- a future's result is fetched from ``/api/v1/retrieve_future``. For ``ForwardBackwardOutput`` and ``SampleResponse``
  the SDK accepts ONLY protobuf (``application/x-protobuf``; a JSON body is refused as "the server predates proto
  response serialization"); every other result is JSON validated against its response model.
- a pending future answers ``{"type": "try_again", ...}``; a failed one ``{"error": ..., "category": "user"|"server"}``
  (``RequestFailedResponse``), both with HTTP 200.
- metric names carry their cross-chunk reduction after one colon (``loss:sum``): the SDK splits every key on ``:``
  when it combines the chunks of one ``forward_backward`` call, so a key without exactly one colon breaks the client.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pydantic
from tinker import types as ttypes
from tinker.proto import tinker_public_pb2 as pb

from twinkle_server.errors import BadRequest, PayloadTooLarge, ServiceError
from twinkle_server.host import AdamStep, Datum, ForwardResult, SampledSequence, SampleParams

PROTO_MEDIA_TYPE = "application/x-protobuf"
JSON_MEDIA_TYPE = "application/json"

M = TypeVar("M", bound=pydantic.BaseModel)


# ---------------------------------------------------------------------------------------------------------------
# what a future's work returns: the encoded body retrieve_future answers with
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WireResult:
    """A finished Tinker future's response body, encoded on the worker thread."""

    body: bytes
    media_type: str

    @classmethod
    def json(cls, payload: Mapping[str, Any]) -> WireResult:
        return cls(json.dumps(payload, allow_nan=False).encode(), JSON_MEDIA_TYPE)

    @classmethod
    def proto(cls, message: Any) -> WireResult:
        return cls(message.SerializeToString(), PROTO_MEDIA_TYPE)


def try_again(request_id: str) -> dict[str, Any]:
    """``TryAgainResponse``: the future is still queued or running."""
    return {"type": "try_again", "request_id": request_id, "queue_state": "active"}


def request_failed(error: ServiceError) -> dict[str, Any]:
    """``RequestFailedResponse``: the SDK raises ``RequestFailedError(message, category=...)``."""
    category = error.category if error.category in ("user", "server") else "unknown"
    return {"error": error.message, "category": category}


def error_body(error: ServiceError) -> dict[str, Any]:
    """An HTTP error's JSON body. The SDK's ``APIStatusError`` shows ``Error code: <status> - <body>``, so the
    message is the first key; ``category`` mirrors ``RequestFailedResponse``."""
    return {"error": error.message, "category": error.category, "status": error.status}


# ---------------------------------------------------------------------------------------------------------------
# JSON request bodies
# ---------------------------------------------------------------------------------------------------------------
def parse_json(body: bytes) -> Any:
    if not body:
        return {}
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON ({exc}); the Tinker SDK sends JSON for this "
                         f"endpoint") from None


def parse_model(model_cls: type[M], body: bytes | Mapping[str, Any]) -> M:
    """Validate a JSON body against the SDK's own request model; a mismatch is a 400 naming the fields."""
    data = parse_json(body) if isinstance(body, (bytes, bytearray)) else body
    try:
        return model_cls.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<body>'}: {e['msg']}"
                             for e in exc.errors()[:8])
        raise BadRequest(f"{model_cls.__name__}: {problems} (the request does not match tinker 0.38's wire "
                         f"format)") from None


# ---------------------------------------------------------------------------------------------------------------
# model inputs and tensors
# ---------------------------------------------------------------------------------------------------------------
def check_tokens(tokens: list[int], *, vocab_size: int, what: str) -> None:
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        bad = next(t for t in tokens if t < 0 or t >= vocab_size)
        raise BadRequest(f"{what} holds token id {bad}, outside the base model's vocabulary [0, {vocab_size})")


def model_input_tokens(model_input: ttypes.ModelInput, *, what: str = "model_input") -> list[int]:
    """The tokens of a JSON ``ModelInput`` (text chunks concatenated); image/audio chunks are refused."""
    tokens: list[int] = []
    for index, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, ttypes.EncodedTextChunk):
            raise BadRequest(f"{what}.chunks[{index}] is a {type(chunk).__name__}: this server hosts text-only "
                             f"models and accepts only EncodedTextChunk (ModelInput.from_ints)")
        tokens.extend(int(t) for t in chunk.tokens)
    return tokens


_NP_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def _tensor_from_proto(msg: pb.Tensor, *, what: str) -> np.ndarray:
    """A proto ``Tensor`` as a dense numpy array (sparse CSR is densified with 0 in the unlisted cells)."""
    np_dtype = _NP_DTYPES.get(msg.dtype)
    if np_dtype is None:
        name = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else msg.dtype
        raise BadRequest(f"{what}: unsupported tensor dtype {name}; send float32 or int64 (TensorData)")
    shape = list(msg.shape)
    try:
        if msg.WhichOneof("encoding") == "sparse_csr":
            csr = msg.sparse_csr
            values = np.frombuffer(csr.values, dtype=np_dtype)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            col = np.frombuffer(csr.col_indices, dtype=np.int64)
            if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
                raise ValueError(f"a sparse CSR tensor needs a 2-D shape, {shape[0] + 1 if shape else '?'} row "
                                 f"pointers and one column index per value")
            dense = np.zeros(shape, dtype=np_dtype)
            for row in range(shape[0]):
                start, end = int(crow[row]), int(crow[row + 1])
                dense[row, col[start:end]] = values[start:end]
            return dense
        flat = np.frombuffer(msg.dense, dtype=np_dtype)
        if not shape:
            shape = [flat.size]
        return flat.reshape(shape)
    except ValueError as exc:
        raise BadRequest(f"{what}: malformed tensor ({exc})") from None


def _datum_from_proto(msg: pb.Datum, index: int) -> Datum:
    tokens: list[int] = []
    for c, chunk in enumerate(msg.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise BadRequest(f"data[{index}].model_input.chunks[{c}] is a {kind or 'empty'} chunk: this server "
                             f"hosts text-only models and accepts only token chunks (ModelInput.from_ints)")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    if not tokens:
        raise BadRequest(f"data[{index}] has an empty model_input")
    inputs: dict[str, list[float] | list[int]] = {}
    for name, tensor in msg.loss_fn_inputs.items():
        what = f"data[{index}].loss_fn_inputs[{name!r}]"
        array = _tensor_from_proto(tensor, what=what)
        if array.ndim != 1:
            raise BadRequest(f"{what} has shape {list(array.shape)}: this server's losses take one value per "
                             f"input position, a 1-D tensor of length {len(tokens)}")
        if array.shape[0] != len(tokens):
            raise BadRequest(f"{what} has {array.shape[0]} values for {len(tokens)} input tokens: Tinker's "
                             f"loss_fn_inputs are aligned with model_input, one value per position")
        if np.issubdtype(array.dtype, np.integer):
            inputs[name] = [int(v) for v in array.tolist()]
        else:
            if not np.all(np.isfinite(array)):
                raise BadRequest(f"{what} holds a NaN or infinite value")
            inputs[name] = [float(v) for v in array.tolist()]
    return Datum(tokens=tokens, loss_fn_inputs=inputs)


# ---------------------------------------------------------------------------------------------------------------
# forward_backward / forward
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None
    forward_only: bool
    data: list[Datum]


def decompress(body: bytes, content_encoding: str | None, *, max_bytes: int) -> bytes:
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise BadRequest(f"Content-Encoding {content_encoding!r} is not supported; send the body uncompressed or "
                         f"zstd-compressed")
    import zstandard

    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        out = reader.read(max_bytes + 1)
    except zstandard.ZstdError as exc:
        raise BadRequest(f"the zstd-compressed body cannot be decompressed ({exc})") from None
    if len(out) > max_bytes:
        raise PayloadTooLarge(f"the decompressed request body is over the server's limit of {max_bytes} bytes "
                              f"(limits.max_body_mb); send fewer datums per request")
    return out


def check_vocab(data: list[Datum], *, vocab_size: int) -> None:
    """Token ids (inputs and ``target_tokens``) inside the base model's vocabulary."""
    for index, datum in enumerate(data):
        check_tokens(datum.tokens, vocab_size=vocab_size, what=f"data[{index}].model_input")
        if "target_tokens" in datum.loss_fn_inputs:
            check_tokens([int(t) for t in datum.loss_fn_inputs["target_tokens"]], vocab_size=vocab_size,
                         what=f"data[{index}].loss_fn_inputs['target_tokens']")


def decode_forward_backward(body: bytes, *, max_tokens: int) -> ForwardBackwardCall:
    """A ``ForwardBackwardRequest`` protobuf (already decompressed)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # google.protobuf.message.DecodeError
        raise BadRequest(f"the forward_backward body is not a tinker ForwardBackwardRequest protobuf ({exc}); "
                         f"send it with the Tinker SDK (Content-Type: application/x-protobuf)") from None
    if not msg.model_id:
        raise BadRequest("forward_backward: model_id is missing")
    if not msg.loss_fn:
        raise BadRequest("forward_backward: loss_fn is missing")
    if not msg.data:
        raise BadRequest("forward_backward: no data (send at least one Datum)")
    config: dict[str, float | str] | None = None
    if msg.loss_fn_config_v2:  # the SDK dual-writes; v2 wins and is the only one that carries strings
        config = {}
        for key, value in msg.loss_fn_config_v2.items():
            kind = value.WhichOneof("value")
            if kind is None:
                raise BadRequest(f"loss_fn_config[{key!r}] has no value")
            config[key] = value.text if kind == "text" else float(value.number)
    elif msg.loss_fn_config:
        config = {key: float(value) for key, value in msg.loss_fn_config.items()}
    data = [_datum_from_proto(d, i) for i, d in enumerate(msg.data)]
    total = sum(len(d.tokens) for d in data)
    if total > max_tokens:
        raise PayloadTooLarge(f"forward_backward carries {total} tokens, above the server's "
                              f"limits.max_tokens_per_request={max_tokens}; split the batch (the SDK chunks by "
                              f"the client config's fwdbwd_max_chunk_len)")
    return ForwardBackwardCall(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn,
                               loss_fn_config=config, forward_only=bool(msg.forward_only), data=data)


def check_metric_names(metrics: Mapping[str, float]) -> dict[str, float]:
    """Every key ``name:reduction`` with exactly one colon (the SDK splits on it when combining chunks)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key.count(":") != 1:
            raise ValueError(f"metric {key!r} must be named 'name:reduction' (one colon, e.g. 'loss:sum'): the Tinker "
                             f"SDK splits metric keys on ':' to combine chunked forward_backward results")
        out[key] = float(value)
    return out


def encode_forward_backward_output(result: ForwardResult, *, num_datums: int) -> pb.ForwardBackwardOutput:
    """``ForwardBackwardOutput`` as the SDK's proto reader expects it: one ``ArrayRecord`` whose fields are
    ``BatchedTensor``s (per-datum float32 runs concatenated, int64 byte offsets ``[0, end_0, end_1, ...]``)."""
    if len(result.per_datum) != num_datums:
        raise ValueError(f"the host returned outputs for {len(result.per_datum)} datums, not {num_datums}")
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in check_metric_names(result.metrics).items():
        msg.metrics[key] = value
    record = msg.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = num_datums
    names = list(result.per_datum[0]) if result.per_datum else []
    for name in names:
        arrays = []
        for index, outputs in enumerate(result.per_datum):
            if name not in outputs:
                raise ValueError(f"datum {index}'s outputs lack {name!r} that datum 0 has")
            arrays.append(np.asarray(outputs[name], dtype=np.float32).reshape(-1))
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        field = record.fields[name]
        field.dtype = pb.DTYPE_FLOAT32
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
    return msg


# ---------------------------------------------------------------------------------------------------------------
# optim_step
# ---------------------------------------------------------------------------------------------------------------
def adam_step(params: ttypes.AdamParams) -> AdamStep:
    values = {name: float(getattr(params, name)) for name in
              ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")}
    bad = [f"{k}={v}" for k, v in values.items() if not math.isfinite(v)]
    if bad:
        raise BadRequest(f"AdamParams must be finite: {', '.join(bad)}")
    if values["learning_rate"] < 0:
        raise BadRequest(f"AdamParams.learning_rate must be >= 0, got {values['learning_rate']}")
    if not (0.0 <= values["beta1"] < 1.0 and 0.0 <= values["beta2"] < 1.0):
        raise BadRequest(f"AdamParams betas must lie in [0, 1), got beta1={values['beta1']}, "
                         f"beta2={values['beta2']}")
    if values["eps"] < 0 or values["weight_decay"] < 0 or values["grad_clip_norm"] < 0:
        raise BadRequest("AdamParams eps, weight_decay and grad_clip_norm must be >= 0 (grad_clip_norm 0 means no "
                         "clipping)")
    return AdamStep(**values)


def optim_params_of(body: bytes) -> tuple[str, int | None, AdamStep]:
    """``OptimStepRequest``: the SDK sends ``adam_params`` for Adam and ``optimizer_params`` (with a ``type``) for
    other optimizer families, which this server does not run."""
    data = parse_json(body)
    if isinstance(data, dict) and "optimizer_params" in data and "adam_params" not in data:
        params = data.get("optimizer_params")
        family = params.get("type") if isinstance(params, dict) else None
        raise BadRequest(f"optimizer {family!r} is not supported by this server: only Adam (AdamW) is; create the "
                         f"training client without optimizer= and step with types.AdamParams")
    request = parse_model(ttypes.OptimStepRequest, data)
    if not isinstance(request.optim_params, ttypes.AdamParams):
        raise BadRequest(f"optim_step: {type(request.optim_params).__name__} is not supported; only AdamParams")
    return request.model_id, request.seq_id, adam_step(request.optim_params)


# ---------------------------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------------------------
def sample_params(params: ttypes.SamplingParams) -> SampleParams:
    """Tinker's ``SamplingParams``; the host validates the values (temperature 0 is greedy, top_k -1 no limit)."""
    stop: list[int] | list[str] | None
    if params.stop is None:
        stop = None
    elif isinstance(params.stop, str):
        stop = [params.stop]
    else:
        items = list(params.stop)
        if all(isinstance(s, str) for s in items):
            stop = [str(s) for s in items]
        elif all(isinstance(s, int) and not isinstance(s, bool) for s in items):
            stop = [int(s) for s in items]
        else:
            raise BadRequest("SamplingParams.stop must be a string, a list of strings or a list of token ids, not a "
                             "mix")
    return SampleParams(max_tokens=params.max_tokens, temperature=float(params.temperature),
                        top_p=float(params.top_p), top_k=int(params.top_k), seed=params.seed, stop=stop)


_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def encode_sample_response(sequences: list[SampledSequence], prompt_logprobs: list[float | None] | None,
                           ) -> pb.SampleResponse:
    """``SampleResponse`` as protobuf: tokens int32 bytes, logprobs float32 bytes, prompt logprobs float32 with NaN
    where there is none (the first token, or before ``prompt_logprobs_last_n``)."""
    msg = pb.SampleResponse()
    for seq in sequences:
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(f"stop reason {seq.stop_reason!r} is not one of Tinker's {sorted(_STOP_REASONS)}")
        out = msg.sequences.add()
        out.stop_reason = _STOP_REASONS[seq.stop_reason]
        out.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        if seq.logprobs is not None and len(seq.logprobs):
            if len(seq.logprobs) != len(seq.tokens):
                raise ValueError(f"{len(seq.logprobs)} logprobs for {len(seq.tokens)} sampled tokens")
            out.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = np.array([np.nan if v is None else v for v in prompt_logprobs], dtype=np.float32)
        msg.prompt_logprobs = values.tobytes()
    return msg


# ---------------------------------------------------------------------------------------------------------------
# small JSON helpers for REST responses
# ---------------------------------------------------------------------------------------------------------------
def iso_time(timestamp: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()


def validated(model_cls: type[pydantic.BaseModel], payload: dict[str, Any]) -> dict[str, Any]:
    """Check a response payload against the SDK's response model (the SDK validates strictly) and return it."""
    model_cls.model_validate(payload)
    return payload
