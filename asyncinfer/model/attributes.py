"""Conversion of ONNX ``AttributeProto`` values into plain Python values for the IR."""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto

from ..errors import ModelLoadError, ModelTooLargeError
from ..limits import DEFAULT_LIMITS
from .tensors import inline_to_array, itemsize

DEFAULT_MAX_BYTES = DEFAULT_LIMITS.max_tensor_bytes


def attribute_value(attr: AttributeProto, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """The Python value of an attribute: int, float, str, ndarray, list of those, or a GraphProto.

    Tensors are checked (element type, dims, data, ``max_bytes``) before they are decoded."""
    t = attr.type
    what = f"attribute {attr.name!r}"
    if t == AttributeProto.INT:
        return int(attr.i)
    if t == AttributeProto.FLOAT:
        return float(attr.f)
    if t == AttributeProto.STRING:
        return attr.s.decode("utf-8", errors="replace")
    if t == AttributeProto.TENSOR:
        return inline_to_array(attr.t, max_bytes, what)
    if t == AttributeProto.GRAPH:
        return attr.g
    if t == AttributeProto.INTS:
        return [int(v) for v in attr.ints]
    if t == AttributeProto.FLOATS:
        return [float(v) for v in attr.floats]
    if t == AttributeProto.STRINGS:
        return [s.decode("utf-8", errors="replace") for s in attr.strings]
    if t == AttributeProto.TENSORS:
        return [inline_to_array(v, max_bytes, what) for v in attr.tensors]
    if t == AttributeProto.GRAPHS:
        return list(attr.graphs)
    if t == AttributeProto.SPARSE_TENSOR:
        return sparse_to_dense(attr.sparse_tensor, max_bytes)
    if t == AttributeProto.TYPE_PROTO:
        return attr.tp
    if t == AttributeProto.UNDEFINED and attr.ref_attr_name:
        raise ModelLoadError(f"attribute {attr.name!r} refers to a function attribute, which is only valid inside a function")
    name = AttributeProto.AttributeType.Name(t) if t in AttributeProto.AttributeType.values() else str(t)
    raise ModelLoadError(f"attribute {attr.name!r} has unsupported type {name}")


def subgraphs(attr: AttributeProto) -> list[onnx.GraphProto]:
    """The graphs an attribute holds, by its declared type only (a graph hidden in the field of an
    attribute of another type is never read, here or anywhere)."""
    if attr.type == AttributeProto.GRAPH:
        return [attr.g]
    if attr.type == AttributeProto.GRAPHS:
        return list(attr.graphs)
    return []


def attributes_dict(attrs: Iterable[AttributeProto], max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    return {a.name: attribute_value(a, max_bytes) for a in attrs}


def sparse_to_dense(sparse: onnx.SparseTensorProto, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """Dense array of a ``SparseTensorProto`` (indices given flat or as [nnz, rank] coordinates).

    Shapes and every index are checked first: a bad one is a ModelLoadError, never an IndexError."""
    dims = tuple(int(d) for d in sparse.dims)
    if any(d < 0 for d in dims):
        raise ModelLoadError(f"sparse tensor has negative dims {list(dims)}")
    size = math.prod(dims) * itemsize(sparse.values.data_type)
    if size > max_bytes:
        raise ModelTooLargeError("max_tensor_bytes", size, max_bytes, f"sparse tensor of shape {list(dims)}: dense size in bytes")
    values = inline_to_array(sparse.values, max_bytes, "sparse tensor values")
    indices = inline_to_array(sparse.indices, max_bytes, "sparse tensor indices")
    if values.ndim != 1:
        raise ModelLoadError(f"sparse tensor values must be 1-D, got shape {list(values.shape)}")
    if indices.dtype.kind not in "iu":
        raise ModelLoadError(f"sparse tensor indices must be integers, got {indices.dtype}")
    nnz = values.shape[0]
    indices = indices.astype(np.int64)
    if indices.ndim == 1 and indices.shape[0] == nnz:
        bounds = np.array([math.prod(dims)])
        coords = indices.reshape(-1, 1)
    elif indices.ndim == 2 and indices.shape == (nnz, len(dims)):
        bounds = np.array(dims, dtype=np.int64)
        coords = indices
    else:
        raise ModelLoadError(f"sparse tensor indices of shape {list(indices.shape)} do not fit {nnz} values "
                             f"of a rank-{len(dims)} tensor (want [{nnz}] or [{nnz}, {len(dims)}])")
    if coords.size and (np.any(coords < 0) or np.any(coords >= bounds)):
        raise ModelLoadError(f"sparse tensor indices fall outside its dims {list(dims)}")
    dense = np.zeros(dims, dtype=values.dtype)
    if coords.shape[1] == 1 and indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(coords.T)] = values
    return dense
