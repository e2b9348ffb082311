"""The Open Inference Protocol (KServe v2) wire format: datatypes, requests, responses.

Pure functions over bytes and NumPy arrays, no web framework: the server module routes, this one
decodes an inference request (JSON tensors, or the binary tensor data extension) into arrays
checked against the model, and encodes the outputs back.

Binary tensor data extension: the body is a JSON header of ``Inference-Header-Content-Length``
bytes followed by raw tensors, in the order of the inputs that carry a ``binary_data_size``
parameter (little-endian, row-major; BYTES elements are each prefixed by a 4-byte length).

Requests are untrusted: before the JSON is parsed its nesting depth is measured without recursion
(``Limits.max_json_depth``), and every input's rank and element count are checked against
``Limits`` before any array is built. Whatever is wrong with a request is a ``ProtocolError(400)``.
"""
from __future__ import annotations

import json
import math
import re
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import RequestTooLargeError
from ..limits import DEFAULT_LIMITS, Limits
from ..model.ir import Dim, Model, TensorInfo

try:  # bfloat16 comes with ml_dtypes, an asyncinfer dependency
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover
    _bfloat16 = None

_BY_DTYPE: dict[np.dtype, str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "UINT8", np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32", np.dtype(np.uint64): "UINT64",
    np.dtype(np.int8): "INT8", np.dtype(np.int16): "INT16",
    np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64",
    np.dtype(np.float16): "FP16", np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64",
    np.dtype(object): "BYTES",
}
if _bfloat16 is not None:
    _BY_DTYPE[np.dtype(_bfloat16)] = "BF16"
_BY_NAME: dict[str, np.dtype] = {name: dtype for dtype, name in _BY_DTYPE.items()}
_LITTLE_ENDIAN = sys.byteorder == "little"


class ProtocolError(Exception):
    """A request the server rejects: ``status`` is the HTTP status, the message says why, and
    ``headers`` go with the answer (``Retry-After`` on a 503)."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


def _clip(value: Any, length: int = 80) -> str:
    """``repr(value)`` cut to ``length`` characters, for messages about untrusted values."""
    text = repr(value)
    return text if len(text) <= length else text[:length - 3] + "..."


# -- datatypes and shapes -------------------------------------------------------------------------
def datatype_of(dtype: np.dtype | None) -> str:
    """The KServe datatype name of a NumPy dtype (``FP32``, ``INT64``, ``BOOL``, ``BYTES``…)."""
    if dtype is None:
        return "BYTES"  # unknown element type: the protocol has no name for it; BYTES is the catch-all
    known = _BY_DTYPE.get(dtype)  # a native dtype: every output, on the hot path
    if known is not None:
        return known
    dtype = np.dtype(dtype)
    if dtype.kind in "US":
        return "BYTES"
    try:
        return _BY_DTYPE[dtype.newbyteorder("=")]
    except KeyError:
        raise ProtocolError(500, f"element type {dtype.name} has no Open Inference Protocol datatype") from None


def dtype_of(datatype: str) -> np.dtype:
    """The NumPy dtype of a KServe datatype name; ProtocolError(400) for an unknown name."""
    try:
        return _BY_NAME[datatype]
    except KeyError:
        raise ProtocolError(400, f"unknown datatype {_clip(datatype)}; expected one of {sorted(_BY_NAME)}") from None


def wire_shape(shape: Sequence[Dim] | None) -> list[int]:
    """A declared shape for metadata: symbolic or unknown dims become -1 (unknown rank: ``[-1]``)."""
    if shape is None:
        return [-1]
    return [d if isinstance(d, int) else -1 for d in shape]


def tensor_metadata(info: TensorInfo) -> dict[str, Any]:
    return {"name": info.name, "datatype": datatype_of(info.dtype), "shape": wire_shape(info.shape)}


# -- requests -------------------------------------------------------------------------------------
@dataclass
class InferRequest:
    """A decoded inference request: input arrays and which outputs to return, and how."""

    id: str | None
    inputs: dict[str, np.ndarray]
    outputs: list[str]  # output names, in response order
    binary: dict[str, bool] = field(default_factory=dict)  # output name -> send as binary data


@dataclass(frozen=True)
class _Plan:
    """How one binary-request header decodes: everything but the tensor bytes, checked once."""

    id: str | None
    # name, dtype, shape, elements, bytes, and the wire dtype of fixed-size numbers (else None)
    inputs: tuple[tuple[str, np.dtype, tuple[int, ...], int, int, np.dtype | None], ...]
    outputs: tuple[str, ...]
    binary: tuple[tuple[str, bool], ...]
    data_bytes: int

    def decode(self, data: bytes) -> InferRequest:
        inputs: dict[str, np.ndarray] = {}
        offset = 0
        for name, dtype, shape, count, size, wire in self.inputs:
            if wire is not None:  # sizes checked with the plan: read the numbers in place, then copy
                array = np.frombuffer(data, wire, count, offset).astype(dtype)
            else:
                array = decode_binary(name, data[offset:offset + size], dtype, count, "'binary_data_size'")
            inputs[name] = array.reshape(shape)
            offset += size
        return InferRequest(self.id, inputs, list(self.outputs), dict(self.binary))


class HeaderPlans:
    """The plans of the binary-request headers one model version saw last (at most ``capacity``).

    Clients of the binary tensor extension send the same JSON header again and again (same
    inputs, shapes and outputs; only the tensor bytes change): a header seen before is not
    parsed, depth-checked and validated again. A plan depends on the header's bytes, the model
    and the limits alone, so it is kept per served model version; headers carrying JSON data
    (or longer than ``max_header``) are not kept.
    """

    def __init__(self, capacity: int = 64, max_header: int = 4096):
        self.capacity, self.max_header = capacity, max_header
        self._plans: dict[bytes, _Plan] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, header: bytes) -> _Plan | None:
        return self._plans.get(header)

    def keep(self, header: bytes, plan: _Plan) -> None:
        if len(header) > self.max_header:
            return
        if len(self._plans) >= self.capacity:
            self._plans.pop(next(iter(self._plans)))  # the oldest
        self._plans[header] = plan


def parse_infer_request(body: bytes, header_length: str | None, model: Model,
                        model_name: str | None = None, limits: Limits = DEFAULT_LIMITS,
                        plans: HeaderPlans | None = None) -> InferRequest:
    """Decode an inference request body for ``model``; ProtocolError(400) says what is wrong.

    ``header_length`` is the ``Inference-Header-Content-Length`` header (None: all JSON). The
    JSON's depth, input names, datatypes, ranks and element counts are checked here (depth, rank
    and elements against ``limits``); shapes against the model's declared (symbolic) signature
    are checked by the engine before it runs. ``model_name`` is the name the model is served
    under, for messages (default: the model's own name). ``plans``: the model's
    `HeaderPlans`, to reuse the checked plan of a binary header seen before (give it only
    with the same ``model`` and ``limits`` every time).
    """
    model_name = model_name or model.name
    header, binary = _split_body(body, header_length)
    if plans is not None and header_length is not None:
        plan = plans.get(header)
        if plan is not None and plan.data_bytes == len(binary):  # else: parsed again, for the message
            return plan.decode(binary)
    request = _load_json(header, limits.max_json_depth)
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(400, f"'id' must be a string, got {type(request_id).__name__}")
    parameters = _parameters(request, "the request")

    raw_inputs = request.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError(400, "the request needs 'inputs': a non-empty list of tensors")
    declared = {info.name: info for info in model.inputs}
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    sizes: dict[str, int] = {}  # binary bytes of each input (absent: JSON data)
    for index, raw in enumerate(raw_inputs):
        name, array, used = _decode_input(index, raw, declared, model_name, binary, offset, limits)
        if name in inputs:
            raise ProtocolError(400, f"input {name!r} is given twice")
        inputs[name] = array
        if "data" not in raw:
            sizes[name] = used
        offset += used
    if offset != len(binary):
        raise ProtocolError(400, f"the body has {len(binary)} bytes of binary tensor data, but the inputs' "
                                 f"'binary_data_size' parameters add up to {offset}")
    missing = [n for n in declared if n not in inputs and n not in model.input_defaults]  # defaults: optional
    if missing:
        raise ProtocolError(400, f"missing input(s) {missing}; model {model_name!r} takes {list(declared)}")

    outputs, binary_out = _requested_outputs(request, parameters, model, model_name)
    if plans is not None and header_length is not None and len(sizes) == len(inputs):
        plans.keep(header, _Plan(request_id, tuple((name, a.dtype, a.shape, a.size, sizes[name],
                                                    a.dtype.newbyteorder("<") if a.dtype.kind in "iuf" else None)
                                                   for name, a in inputs.items()),
                                 tuple(outputs), tuple(binary_out.items()), offset))
    return InferRequest(request_id, inputs, outputs, binary_out)


def _split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    if header_length is None:
        return body, b""
    try:
        length = int(header_length)
    except ValueError:
        raise ProtocolError(400, "Inference-Header-Content-Length must be an integer, "
                                 f"got {_clip(header_length)}") from None
    if not 0 <= length <= len(body):
        raise ProtocolError(400, f"Inference-Header-Content-Length is {length}, but the body has {len(body)} bytes")
    return body[:length], body[length:]


def _load_json(header: bytes, max_depth: int) -> dict[str, Any]:
    depth = json_depth(header)
    if depth > max_depth:
        raise ProtocolError(400, f"the request's JSON nests {depth} levels deep, more than "
                                 f"Limits.max_json_depth = {max_depth}")
    try:
        request = json.loads(header)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(400, f"malformed JSON in the request body: {exc}") from None
    except RecursionError:  # max_json_depth set above what the parser can recurse
        raise ProtocolError(400, "the request's JSON nests too deeply to parse") from None
    if not isinstance(request, dict):
        raise ProtocolError(400, f"the request body must be a JSON object, got {type(request).__name__}")
    return request


# A JSON string (escapes included): skipped when counting brackets.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_DEPTH_CHUNK = 1 << 20
_OPENERS = frozenset(b"[{")
_SHALLOW = 16  # up to 64 brackets: a plain loop beats NumPy's fixed cost


def json_depth(text: bytes) -> int:
    """How deep arrays and objects nest in JSON ``text`` (``{"a": [1]}`` is 2), found without
    parsing it or recursing, in time linear in its length: safe on any input, so it can guard
    ``json.loads``, which recurses once per level. Malformed text gets a depth too (its brackets
    outside strings, counted as they come); the parser then rejects it.
    """
    stripped = _JSON_STRING.sub(b"", text).translate(None, _NOT_BRACKETS)
    if len(stripped) <= 4 * _SHALLOW:  # a typical header: a few brackets, count them in Python
        level = deepest = 0
        for byte in stripped:
            level += 1 if byte in _OPENERS else -1
            deepest = max(deepest, level)
        return deepest
    brackets = np.frombuffer(stripped, np.uint8)
    level = deepest = 0
    for start in range(0, brackets.size, _DEPTH_CHUNK):  # chunks: a body of brackets stays cheap
        chunk = brackets[start:start + _DEPTH_CHUNK]
        levels = level + np.cumsum(np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1), dtype=np.int64)
        deepest = max(deepest, int(levels.max()))
        level = int(levels[-1])
    return deepest


def _parameters(obj: Mapping[str, Any], what: str) -> dict[str, Any]:
    parameters = obj.get("parameters", {})
    if not isinstance(parameters, dict):
        raise ProtocolError(400, f"'parameters' of {what} must be an object")
    return parameters


def _decode_input(index: int, raw: Any, declared: Mapping[str, TensorInfo], model_name: str,
                  binary: bytes, offset: int, limits: Limits) -> tuple[str, np.ndarray, int]:
    """One input tensor: (name, array, binary bytes consumed)."""
    if not isinstance(raw, dict):
        raise ProtocolError(400, f"inputs[{index}] must be an object with name, shape, datatype and data")
    for key in ("name", "shape", "datatype"):
        if key not in raw:
            raise ProtocolError(400, f"inputs[{index}] has no {key!r}")
    name = raw["name"]
    if not isinstance(name, str):
        raise ProtocolError(400, f"inputs[{index}]: 'name' must be a string")
    info = declared.get(name)
    if info is None:
        raise ProtocolError(400, f"unknown input {_clip(name)}; model {model_name!r} takes {list(declared)}")
    if info.kind != "tensor":
        raise ProtocolError(400, f"input {name!r} is a {info.kind}: the protocol carries tensors only")
    shape = raw["shape"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ProtocolError(400, f"input {name!r}: 'shape' must be a list of non-negative integers, got {_clip(shape)}")
    try:  # before any array is made: a huge declared shape costs nothing
        limits.check_shape(tuple(shape), f"input {name!r}")
    except RequestTooLargeError as exc:
        raise ProtocolError(400, str(exc)) from None
    datatype = raw["datatype"]
    if not isinstance(datatype, str):
        raise ProtocolError(400, f"input {name!r}: 'datatype' must be a string")
    dtype = dtype_of(datatype)
    if info.dtype is not None and datatype != datatype_of(info.dtype):
        raise ProtocolError(400, f"input {name!r} has datatype {datatype_of(info.dtype)} in model "
                                 f"{model_name!r}, the request says {datatype}")
    count = math.prod(shape)
    size = _parameters(raw, f"input {name!r}").get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ProtocolError(400, f"input {name!r}: 'binary_data_size' must be a non-negative integer")
        if offset + size > len(binary):
            raise ProtocolError(400, f"input {name!r}: 'binary_data_size' is {size}, but only "
                                     f"{len(binary) - offset} bytes of binary data are left")
        array = decode_binary(name, binary[offset:offset + size], dtype, count, "'binary_data_size'")
        return name, array.reshape(shape), size
    if "data" not in raw:
        raise ProtocolError(400, f"input {name!r} has neither 'data' nor a 'binary_data_size' parameter")
    return name, _from_json(name, raw["data"], datatype, dtype, shape, count), 0


def decode_binary(name: str, chunk: bytes, dtype: np.dtype, count: int, where: str) -> np.ndarray:
    """An input's ``count`` elements from their binary wire form (little-endian, row-major; BYTES
    as length-prefixed elements; BOOL one byte each, any non-zero byte true), for the HTTP binary
    extension and gRPC's raw contents alike. ``where`` names the field giving the size, for errors."""
    if dtype == np.dtype(object):
        return unpack_bytes(name, chunk, count)
    expected = count * dtype.itemsize
    if len(chunk) != expected:
        raise ProtocolError(400, f"input {name!r}: shape needs {count} elements = {expected} bytes of "
                                 f"{datatype_of(dtype)}, {where} is {len(chunk)}")
    if dtype == np.dtype(bool):
        return np.frombuffer(chunk, np.uint8) != 0
    return np.frombuffer(chunk, dtype=dtype.newbyteorder("<")).astype(dtype, copy=True)


def unpack_bytes(name: str, chunk: bytes, count: int) -> np.ndarray:
    """BYTES elements from their wire form (each a 4-byte little-endian length, then its bytes)."""
    items: list[bytes] = []
    pos, end = 0, len(chunk)
    while pos < end:
        if pos + 4 > end:
            raise ProtocolError(400, f"input {name!r}: BYTES data ends inside a 4-byte length prefix")
        (length,) = struct.unpack_from("<I", chunk, pos)
        pos += 4
        if pos + length > end:
            raise ProtocolError(400, f"input {name!r}: a BYTES element of {length} bytes overruns the data")
        if len(items) == count:
            raise ProtocolError(400, f"input {name!r}: its shape needs {count} elements, the BYTES data holds more")
        items.append(chunk[pos:pos + length])
        pos += length
    if len(items) != count:
        raise ProtocolError(400, f"input {name!r}: its shape needs {count} elements, the BYTES data holds {len(items)}")
    array = np.empty(count, dtype=object)
    array[:] = items
    return array


def _from_json(name: str, data: Any, datatype: str, dtype: np.dtype, shape: list[int], count: int) -> np.ndarray:
    if not isinstance(data, list):  # (the protocol's 'data' is a list, flat or nested: a scalar or null is not)
        raise ProtocolError(400, f"input {name!r}: 'data' must be a list (flat or nested), got {_json_type(data)}")
    try:
        raw = np.array(data, dtype=object if dtype == np.dtype(object) else None)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged nesting, numbers NumPy cannot hold
        raise ProtocolError(400, f"input {name!r}: 'data' is not a regular (flat or nested) list: {exc}") from None
    if raw.size != count:
        raise ProtocolError(400, f"input {name!r}: shape {shape} needs {count} elements, 'data' has {raw.size}")
    raw = raw.reshape(shape)
    if dtype == np.dtype(object):
        if not all(isinstance(v, str) for v in raw.flat):
            raise ProtocolError(400, f"input {name!r}: BYTES data must be strings")
        return np.vectorize(lambda s: s.encode("utf-8"), otypes=[object])(raw) if raw.size else raw
    wanted = {"BOOL": "b", "FP16": "iuf", "FP32": "iuf", "FP64": "iuf", "BF16": "iuf"}.get(datatype, "iu")
    if raw.size and raw.dtype.kind not in wanted:
        kind = {"b": "booleans", "iu": "integers", "iuf": "numbers"}[wanted]
        raise ProtocolError(400, f"input {name!r}: {datatype} data must be {kind}, got {_kind_name(raw)}")
    with np.errstate(all="ignore"):  # a float too large for FP16/FP32 becomes inf, as a cast does
        array = raw.astype(dtype)
    if dtype.kind in "iu" and raw.size and not np.array_equal(array, raw):
        raise ProtocolError(400, f"input {name!r}: a value is out of the range of {datatype}")
    return array


def _kind_name(raw: np.ndarray) -> str:
    return {"b": "booleans", "i": "integers", "u": "integers", "f": "non-integer numbers",
            "U": "strings", "O": "mixed or non-numeric values"}.get(raw.dtype.kind, raw.dtype.name)


def _requested_outputs(request: Mapping[str, Any], parameters: Mapping[str, Any], model: Model,
                       model_name: str) -> tuple[list[str], dict[str, bool]]:
    default_binary = parameters.get("binary_data_output", False)
    if not isinstance(default_binary, bool):
        raise ProtocolError(400, "'binary_data_output' must be true or false")
    names = [info.name for info in model.outputs]
    values: set[str] | None = None  # every value of the graph, found when a name is not an output
    raw_outputs = request.get("outputs")
    if raw_outputs is None:
        return names, {n: default_binary for n in names}
    if not isinstance(raw_outputs, list):
        raise ProtocolError(400, "'outputs' must be a list of {\"name\": ...} objects")
    chosen: dict[str, bool] = {}
    for index, raw in enumerate(raw_outputs):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise ProtocolError(400, f"outputs[{index}] must be an object with a string 'name'")
        name = raw["name"]
        if name not in names:
            values = graph_values(model) if values is None else values
            if name not in values:  # an intermediate value may be asked for by name
                raise ProtocolError(400, f"unknown output {_clip(name)}; model {model_name!r} has outputs {names} "
                                         "and no other value of that name")
        as_binary = _parameters(raw, f"output {name!r}").get("binary_data", default_binary)
        if not isinstance(as_binary, bool):
            raise ProtocolError(400, f"output {name!r}: 'binary_data' must be true or false")
        chosen[name] = as_binary
    return list(chosen), chosen


def graph_values(model: Model) -> set[str]:
    """Every value name a request may ask for as an output: the model's outputs, and every
    value its (optimized) layers compute."""
    values = {info.name for info in model.outputs}
    for layer in model.layers:
        values.update(name for name in layer.outputs if name)
    return values


# -- responses ------------------------------------------------------------------------------------
def encode_infer_response(model_name: str, version: str, request: InferRequest,
                          outputs: Mapping[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers (binary tensor data appended when asked for).

    The JSON is written piece by piece (every request pays for it): the same text as
    ``json.dumps({"model_name", "model_version", "outputs": [...], "id"}, separators=(",", ":"))``."""
    tensors, chunks = [], []
    for name in request.outputs:
        array = outputs[name]
        if not isinstance(array, np.ndarray):
            array = np.asarray(array)
        head = (f'{{"name":{json.dumps(name)},"datatype":"{datatype_of(array.dtype)}",'
                f'"shape":[{",".join(map(str, array.shape))}]')
        if request.binary.get(name, False):
            chunk = _to_binary(array)
            chunks.append(chunk)
            tensors.append(f'{head},"parameters":{{"binary_data_size":{len(chunk)}}}}}')
        else:
            tensors.append(f'{head},"data":{json.dumps(_to_json_data(array), separators=(",", ":"))}}}')
    text = (f'{{"model_name":{json.dumps(model_name)},"model_version":{json.dumps(version)},'
            f'"outputs":[{",".join(tensors)}]')
    if request.id is not None:
        text += f',"id":{json.dumps(request.id)}'
    header = (text + "}").encode()
    if not chunks:
        return header, {"content-type": "application/json"}
    return header + b"".join(chunks), {"content-type": "application/octet-stream",
                                       "inference-header-content-length": str(len(header))}


def _to_binary(array: np.ndarray) -> bytes:
    if array.dtype.isnative and _LITTLE_ENDIAN and array.dtype.kind not in "OUSV":
        return array.tobytes()  # row-major, little-endian already: no conversion
    if datatype_of(array.dtype) == "BYTES":
        parts = []
        for item in array.flat:
            raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
            parts.append(struct.pack("<I", len(raw)) + raw)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", dict: "an object"}.get(
        type(value), type(value).__name__)


def _to_json_data(array: np.ndarray) -> list[Any]:
    if datatype_of(array.dtype) == "BYTES":
        return [item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item) for item in array.flat]
    if array.dtype.kind == "V" or array.dtype.name == "bfloat16":
        array = array.astype(np.float32)
    return array.ravel().tolist()
