"""Conversions between the KServe v2 gRPC messages and asyncinfer's arrays and JSON-form dicts.

Pure functions, no server: the gRPC server (`.server`) decodes a ``ModelInferRequest`` into
arrays checked against the model, and builds its answers from the dicts ``InferenceService``
returns (the same dicts the HTTP side sends as JSON).

Tensor data arrives either as ``raw_input_contents`` (one bytes entry per input, little-endian,
row-major; a BYTES element is a 4-byte little-endian length and its bytes: what Triton's client
sends) or in the typed lists of ``InferInputTensor.contents`` (``fp32_contents``,
``int64_contents``…). Requests are untrusted: each input's rank and element count are checked
against ``Limits`` before any array is built, and whatever is wrong is a ``ProtocolError(400)``
naming the input, as on the HTTP side. Outputs go back in ``raw_output_contents``.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from google.protobuf import json_format
from google.protobuf.message import Message

from ...errors import RequestTooLargeError
from ...limits import Limits
from ...model.ir import Model, TensorInfo
from ..protocol import InferRequest, ProtocolError, datatype_of, decode_binary, dtype_of
from . import grpc_service_pb2 as pb

M = TypeVar("M", bound=Message)

# The typed-contents list that carries each datatype, and the NumPy type of that list's elements
# (a narrow integer travels widened: INT8 in int_contents, UINT16 in uint_contents).
_TYPED_FIELD: dict[str, tuple[str, np.dtype]] = {
    "BOOL": ("bool_contents", np.dtype(np.bool_)),
    "INT8": ("int_contents", np.dtype(np.int32)),
    "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)),
    "INT64": ("int64_contents", np.dtype(np.int64)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)),
    "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)),
    "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)),
    "FP64": ("fp64_contents", np.dtype(np.float64)),
    "BYTES": ("bytes_contents", np.dtype(object)),
}
_CONTENT_FIELDS = ("bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents",
                   "fp32_contents", "fp64_contents", "bytes_contents")


def _clip(value: Any, length: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= length else text[:length - 3] + "..."


# -- requests -------------------------------------------------------------------------------------
def request_bytes(request: pb.ModelInferRequest) -> int:
    """Bytes of tensor data a request carries (raw and typed), to decide whether decoding it is
    worth a worker thread."""
    total = sum(len(chunk) for chunk in request.raw_input_contents)
    for tensor in request.inputs:
        if tensor.HasField("contents"):
            contents = tensor.contents
            total += sum(8 * len(getattr(contents, f)) for f in _CONTENT_FIELDS if f != "bytes_contents")
            total += sum(len(item) for item in contents.bytes_contents)
    return total


def decode_infer_request(request: pb.ModelInferRequest, model: Model, model_name: str,
                         limits: Limits, extra_outputs: bool = False) -> InferRequest:
    """The input arrays and requested outputs of ``request`` for ``model``; ProtocolError(400)
    says what is wrong (an unknown, missing or repeated input, a datatype the model does not take,
    a shape over ``limits``, data that does not fit its shape).

    Shapes against the model's declared (symbolic) signature are checked by the engine. Requested
    output names must be model outputs unless ``extra_outputs`` (then any name goes to the service,
    which answers for names it does not know).
    """
    declared = {info.name: info for info in model.inputs}
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(400, f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
                                 "give one entry per input, in the order of 'inputs'")
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        info = declared.get(tensor.name)
        if info is None:
            raise ProtocolError(400, f"unknown input {_clip(tensor.name)}; model {model_name!r} takes {list(declared)}")
        if tensor.name in inputs:
            raise ProtocolError(400, f"input {tensor.name!r} is given twice")
        inputs[tensor.name] = _decode_input(tensor, raw[index] if raw else None, info, model_name, limits)
    missing = [name for name in declared if name not in inputs and name not in model.input_defaults]
    if missing:
        raise ProtocolError(400, f"missing input(s) {missing}; model {model_name!r} takes {list(declared)}")
    outputs = requested_outputs(request.outputs, model, model_name, extra_outputs)
    return InferRequest(request.id or None, inputs, outputs)


def _decode_input(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, info: TensorInfo,
                  model_name: str, limits: Limits) -> np.ndarray:
    name = tensor.name
    if info.kind != "tensor":
        raise ProtocolError(400, f"input {name!r} is a {info.kind}: the protocol carries tensors only")
    shape = tuple(tensor.shape)
    if any(d < 0 for d in shape):
        raise ProtocolError(400, f"input {name!r}: 'shape' must hold non-negative integers, got {_clip(list(shape))}")
    try:  # before any array is made: a huge declared shape costs nothing
        limits.check_shape(shape, f"input {name!r}")
    except RequestTooLargeError as exc:
        raise ProtocolError(400, str(exc)) from None
    datatype = tensor.datatype
    dtype = dtype_of(datatype)
    if info.dtype is not None and datatype != datatype_of(info.dtype):
        raise ProtocolError(400, f"input {name!r} has datatype {datatype_of(info.dtype)} in model "
                                 f"{model_name!r}, the request says {_clip(datatype)}")
    count = math.prod(shape)
    if raw is not None:
        filled = _filled_fields(tensor)
        if filled:
            raise ProtocolError(400, f"input {name!r} has data both in raw_input_contents and in contents.{filled[0]}; "
                                     "give one or the other")
        array = decode_binary(name, raw, dtype, count, "its raw_input_contents entry's size")
    else:
        array = _from_contents(tensor, datatype, dtype, count)
    return array.reshape(shape)


def _filled_fields(tensor: pb.ModelInferRequest.InferInputTensor) -> list[str]:
    if not tensor.HasField("contents"):
        return []
    return [f for f in _CONTENT_FIELDS if len(getattr(tensor.contents, f))]


def _from_contents(tensor: pb.ModelInferRequest.InferInputTensor, datatype: str, dtype: np.dtype,
                   count: int) -> np.ndarray:
    name = tensor.name
    typed = _TYPED_FIELD.get(datatype)
    if typed is None:  # FP16 and BF16 have no typed list
        raise ProtocolError(400, f"input {name!r}: {datatype} data has no typed contents field; "
                                 "send it in raw_input_contents")
    field, wire_dtype = typed
    wrong = [f for f in _filled_fields(tensor) if f != field]
    if wrong:
        raise ProtocolError(400, f"input {name!r} is {datatype}, whose data goes in contents.{field}; "
                                 f"the request fills contents.{wrong[0]}")
    values = getattr(tensor.contents, field) if tensor.HasField("contents") else ()
    if len(values) != count:
        raise ProtocolError(400, f"input {name!r}: its shape needs {count} elements, contents.{field} has {len(values)}")
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
        return array
    wide = np.fromiter(values, dtype=wire_dtype, count=count)
    if wire_dtype == dtype:
        return wide
    narrow = wide.astype(dtype)
    if not np.array_equal(narrow, wide):
        raise ProtocolError(400, f"input {name!r}: a value in contents.{field} is out of the range of {datatype}")
    return narrow


def requested_outputs(requested: Sequence[pb.ModelInferRequest.InferRequestedOutputTensor], model: Model,
                      model_name: str, extra_outputs: bool = False) -> list[str]:
    """Output names in response order: those asked for (each once), or every model output."""
    names = [info.name for info in model.outputs]
    if not requested:
        return names
    chosen: list[str] = []
    for output in requested:
        if "classification" in output.parameters:
            raise ProtocolError(400, f"output {output.name!r}: the classification extension is not supported")
        if output.name not in names and not extra_outputs:
            raise ProtocolError(400, f"unknown output {_clip(output.name)}; model {model_name!r} has outputs {names}")
        if output.name not in chosen:
            chosen.append(output.name)
    return chosen


# -- responses ------------------------------------------------------------------------------------
def encode_infer_response(model_name: str, version: str, request: InferRequest,
                          outputs: Mapping[str, np.ndarray]) -> pb.ModelInferResponse:
    """The response to ``request``: its outputs, in order, as ``raw_output_contents``."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=version, id=request.id or "")
    for name in request.outputs:
        array = np.asarray(outputs[name])
        response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
        response.raw_output_contents.append(to_raw(array))
    return response


def to_raw(array: np.ndarray) -> bytes:
    """An array's wire form: little-endian, row-major; BYTES elements each length-prefixed."""
    if datatype_of(array.dtype) == "BYTES":
        parts = []
        for item in array.flat:
            data = item if isinstance(item, bytes) else str(item).encode("utf-8")
            parts.append(struct.pack("<I", len(data)))
            parts.append(data)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def response_bytes(outputs: Iterable[np.ndarray]) -> int:
    return sum(np.asarray(a).nbytes for a in outputs)


# -- JSON-form dicts ------------------------------------------------------------------------------
def from_json(value: Mapping[str, Any], message: type[M]) -> M:
    """``value`` (the JSON form the HTTP side sends) as a ``message``; fields the proto does not
    declare (Triton config fields asyncinfer's proto leaves out) are skipped."""
    return json_format.ParseDict(value, message(), ignore_unknown_fields=True)


def repository_index_response(models: Iterable[Mapping[str, Any]]) -> pb.RepositoryIndexResponse:
    return from_json({"models": list(models)}, pb.RepositoryIndexResponse)


def repository_parameters(parameters: Mapping[str, pb.ModelRepositoryParameter]) -> dict[str, Any]:
    """A load request's parameters as plain values (``config``: a JSON string; ``file:…``: bytes)."""
    plain: dict[str, Any] = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        plain[key] = None if which is None else getattr(parameter, which)
    return plain
