"""Decoding ``TensorProto`` values from an untrusted model: every check before any allocation.

A tensor's element type, dims and data must agree (the bytes of ``raw_data``, or the entries of
the typed field, are exactly what the dims declare) and its decoded size must stay under the
caller's bound; then the array is decoded in native byte order (ONNX stores data little-endian on
every host). Anything else is a `ModelLoadError` naming the tensor.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ..dtypes import onnx_to_numpy
from ..errors import ModelLoadError, ModelTooLargeError

# Element types stored several to a byte (raw_data) or to an int32_data entry: bits per element.
PACKED_BITS = {TensorProto.INT4: 4, TensorProto.UINT4: 4, TensorProto.FLOAT4E2M1: 4,
               TensorProto.INT2: 2, TensorProto.UINT2: 2,
               TensorProto.FLOAT6E2M3: 6, TensorProto.FLOAT6E3M2: 6}
_PER_INT32 = {4: 2, 2: 4, 6: 1}  # elements per int32_data entry of each packed width
_TYPED_FIELDS = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")


def type_name(code: int) -> str:
    return TensorProto.DataType.Name(code) if code in TensorProto.DataType.values() else str(code)


def itemsize(code: int) -> int:
    """Bytes per decoded element of ONNX element type ``code`` (1 for unknown types: refused later)."""
    try:
        return max(onnx_to_numpy(code).itemsize, 1)
    except ModelLoadError:
        return 1


def declared_bytes(t: onnx.TensorProto) -> int:
    """Bytes the tensor takes in memory once decoded (negative dims count as 0: refused later)."""
    return math.prod(max(int(d), 0) for d in t.dims) * itemsize(t.data_type)


def check_size(t: onnx.TensorProto, max_bytes: int, what: str) -> None:
    """ModelTooLargeError if the decoded tensor would exceed ``max_bytes`` (``Limits.max_tensor_bytes``)."""
    size = declared_bytes(t)
    if size > max_bytes:
        raise ModelTooLargeError("max_tensor_bytes", size, max_bytes, f"{what} of shape {list(t.dims)}: size in bytes")


def check_tensor_data(t: onnx.TensorProto, what: str, raw: bytes | None = None) -> np.dtype:
    """The tensor's NumPy dtype, once its element type is known, its dims non-negative and its
    inline data exactly what the dims declare (raw_data bytes, or typed-field entries).

    ``raw``: ``t.raw_data`` when the caller already holds it (each read of the field copies it)."""
    if t.HasField("segment"):
        raise ModelLoadError(f"{what}: segmented tensors are not supported")
    if t.data_type == TensorProto.UNDEFINED:
        raise ModelLoadError(f"{what} has no element type (data_type UNDEFINED)")
    try:
        dtype = onnx_to_numpy(t.data_type)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{what}: {exc}") from None
    dims = [int(d) for d in t.dims]
    if any(d < 0 for d in dims):
        raise ModelLoadError(f"{what} has negative dims {dims}")
    if t.data_location == TensorProto.EXTERNAL:
        return dtype  # its bytes are checked when they are read
    count = math.prod(dims)
    code = t.data_type
    if code == TensorProto.STRING:
        if t.HasField("raw_data"):
            raise ModelLoadError(f"{what}: a string tensor cannot hold raw_data")
        if len(t.string_data) != count:
            raise ModelLoadError(f"{what} has {len(t.string_data)} strings, dims {dims} need {count}")
        return dtype
    bits = PACKED_BITS.get(code)
    if t.HasField("raw_data"):
        need = (count * bits + 7) // 8 if bits else count * dtype.itemsize
        have = len(t.raw_data if raw is None else raw)
        if have != need:
            raise ModelLoadError(f"{what} has {have} bytes of raw_data, dims {dims} of "
                                 f"{type_name(code)} need {need}")
        return dtype
    field = onnx.helper.tensor_dtype_to_field(code)
    have = len(getattr(t, field))
    if bits:
        need = -(-count // _PER_INT32[bits])
    elif code in (TensorProto.COMPLEX64, TensorProto.COMPLEX128):
        need = 2 * count
    else:
        need = count
    if have != need:
        other = [f for f in _TYPED_FIELDS if f != field and len(getattr(t, f))]
        hint = f" (it holds {other[0]} instead, the wrong field for {type_name(code)})" if other else ""
        raise ModelLoadError(f"{what} has {have} {field} entries, dims {dims} of {type_name(code)} "
                             f"need {need}{hint}")
    return dtype


def native(value: np.ndarray) -> np.ndarray:
    """``value`` in the host's byte order: a '>f4' array must never reach a kernel."""
    if not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))
    return value


def inline_to_array(t: onnx.TensorProto, max_bytes: int, what: str) -> np.ndarray:
    """The value of a tensor whose data is in the model (an attribute's, a sparse tensor's part).

    onnx would read external data from the current directory, outside any check, so it is refused
    here; initializers and Constant nodes read theirs through the importer's checked path."""
    if t.data_location == TensorProto.EXTERNAL:
        raise ModelLoadError(f"{what} holds a tensor with external data: only initializers and "
                             "Constant nodes may keep their data outside the model")
    check_size(t, max_bytes, what)
    if t.HasField("raw_data") and t.data_type not in PACKED_BITS and t.data_type != TensorProto.STRING:
        # The common case, without numpy_helper's copy: one read of the field, viewed in place
        # (little-endian on every host, so converting to native order is a no-op here).
        raw = t.raw_data
        dtype = check_tensor_data(t, what, raw)
        dims = tuple(int(d) for d in t.dims)
        return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).reshape(dims).astype(dtype, copy=False)
    check_tensor_data(t, what)
    try:
        value = numpy_helper.to_array(t)
    except Exception as exc:  # anything the checks above did not foresee still names the tensor
        raise ModelLoadError(f"{what} is malformed: {type(exc).__name__}: {exc}") from exc
    return native(value)
