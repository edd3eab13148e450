"""The Tinker API's protobuf payloads as numpy arrays: the forward_backward request in, its output and sampling's
response out. Packed numeric bytes are little-endian (tokens int32, values float32, offsets and indices int64).

`decode_forward_backward` checks the request's structure (chunk kinds, tensor dtypes and sizes, one value per
input token, the inputs the loss needs) and raises `WireError` naming the field as the SDK's datum lists read
(`data[2].loss_fn_inputs.advantages`); what needs the model (token ids within its vocabulary) the worker checks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import DecodeError

from contract.gen.tinker_public import tinker_public_pb2 as pb
from contract.tinker.requests import LOSS_FNS

# The inputs each loss reads, all one value per input token (Tinker's losses page).
LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
}
_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}
MAX_DATUM_TOKENS = 1 << 17


class WireError(ValueError):
    def __init__(self, field_path: str, message: str) -> None:
        super().__init__(f"{field_path}: {message}")
        self.field = field_path


@dataclass(frozen=True)
class DatumArrays:
    tokens: np.ndarray  # int64 (N,)
    inputs: dict[str, np.ndarray]  # each (N,): target_tokens int64, the rest float32


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    data: list[DatumArrays]
    loss_fn_config: dict[str, float] = field(default_factory=dict)


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise WireError("body", f"not a tinker_public.ForwardBackwardRequest ({exc})") from None
    if request.loss_fn not in LOSS_FNS:
        raise WireError("loss_fn", f"unknown loss function {request.loss_fn!r} (one of {', '.join(LOSS_FNS)})")
    if not request.data:
        raise WireError("data", "no datums")
    data = [_datum(request.data[i], f"data[{i}]", request.loss_fn) for i in range(len(request.data))]
    return ForwardBackwardCall(request.model_id, request.seq_id, request.loss_fn, request.forward_only, data,
                               _loss_config(request))


def call_identity(body: bytes) -> tuple[str, int] | None:
    """The model_id and seq_id of a forward_backward body that parses, even if its contents are refused."""
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except DecodeError:
        return None
    return (request.model_id, request.seq_id) if request.model_id else None


def _loss_config(request: pb.ForwardBackwardRequest) -> dict[str, float]:
    config = {key: float(value) for key, value in request.loss_fn_config.items()}
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "number":
            config[key] = value.number
        else:
            raise WireError(f"loss_fn_config.{key}", "only numbers are accepted")
    return config


def _datum(datum: pb.Datum, path: str, loss_fn: str) -> DatumArrays:
    parts = []
    for index, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"{path}.model_input.chunks[{index}]",
                            f"{kind} chunks are not supported (text models only)")
        parts.append(_packed(chunk.encoded_text.tokens, np.dtype("<i4"), f"{path}.model_input.chunks[{index}]"))
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    if tokens.size == 0:
        raise WireError(f"{path}.model_input", "no tokens")
    if tokens.size > MAX_DATUM_TOKENS:
        raise WireError(f"{path}.model_input", f"{tokens.size} tokens, more than {MAX_DATUM_TOKENS}")
    inputs = {}
    for name in LOSS_INPUTS[loss_fn]:
        if name not in datum.loss_fn_inputs:
            raise WireError(f"{path}.loss_fn_inputs", f"{loss_fn} needs {name!r}")
    for name, tensor in sorted(datum.loss_fn_inputs.items()):
        where = f"{path}.loss_fn_inputs.{name}"
        values = _tensor(tensor, where)
        if values.shape != tokens.shape:
            raise WireError(where, f"shape {list(values.shape)}, expected [{tokens.size}] (one per input token)")
        if not np.all(np.isfinite(values)):
            raise WireError(where, "holds NaN or infinity")
        inputs[name] = values.astype(np.int64 if name == "target_tokens" else np.float32)
    return DatumArrays(tokens, inputs)


def _packed(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise WireError(where, f"{len(raw)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(raw, dtype=dtype)


def _tensor(tensor: pb.Tensor, where: str) -> np.ndarray:
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise WireError(where, f"dtype {pb.DType.Name(tensor.dtype)} is not accepted (float32, int64 or int32)")
    shape = tuple(int(n) for n in tensor.shape)
    if any(n < 0 for n in shape) or len(shape) != 1:
        raise WireError(where, f"shape {list(shape)}: a loss input is one value per token (1-D)")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        raise WireError(where, "sparse tensors are accepted only for 2-D inputs, which no loss here reads")
    values = _packed(tensor.dense, dtype, where)
    if values.size != shape[0]:
        raise WireError(where, f"{values.size} values for shape {list(shape)}")
    return values


def encode_forward_backward_output(outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]) -> bytes:
    """One ArrayRecord holding every datum's outputs (per-token float32 vectors), in the request's order."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    names = sorted(outputs[0]) if outputs else []
    for name in names:
        arrays = [np.ascontiguousarray(out[name], dtype="<f4") for out in outputs]
        offsets = np.cumsum([0, *[a.nbytes for a in arrays]]).astype("<i8")
        record.fields[name].CopyFrom(pb.BatchedTensor(
            data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32,
        ))
    message = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    return message.SerializeToString()


@dataclass(frozen=True)
class SampledArrays:
    tokens: Sequence[int]
    logprobs: Sequence[float]
    stop_reason: str  # "stop" | "length"


def encode_sample_response(sequences: Sequence[SampledArrays]) -> bytes:
    reasons = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
    message = pb.SampleResponse(sequences=[
        pb.SampledSequence(
            stop_reason=reasons[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
        for seq in sequences
    ])
    return message.SerializeToString()
