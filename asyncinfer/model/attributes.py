"""Conversion of ONNX ``AttributeProto`` values into plain Python values for the IR."""
from __future__ import annotations

from typing import Any

import numpy as np

import onnx
from onnx import AttributeProto, numpy_helper

from ..errors import ModelLoadError


def attribute_value(attr: AttributeProto) -> Any:
    """The Python value of an attribute: int, float, str, ndarray, list of those, or a GraphProto."""
    t = attr.type
    if t == AttributeProto.INT:
        return int(attr.i)
    if t == AttributeProto.FLOAT:
        return float(attr.f)
    if t == AttributeProto.STRING:
        return attr.s.decode("utf-8", errors="replace")
    if t == AttributeProto.TENSOR:
        return numpy_helper.to_array(_inline(attr.t, attr.name))
    if t == AttributeProto.GRAPH:
        return attr.g
    if t == AttributeProto.INTS:
        return [int(v) for v in attr.ints]
    if t == AttributeProto.FLOATS:
        return [float(v) for v in attr.floats]
    if t == AttributeProto.STRINGS:
        return [s.decode("utf-8", errors="replace") for s in attr.strings]
    if t == AttributeProto.TENSORS:
        return [numpy_helper.to_array(_inline(v, attr.name)) for v in attr.tensors]
    if t == AttributeProto.GRAPHS:
        return list(attr.graphs)
    if t == AttributeProto.SPARSE_TENSOR:
        return sparse_to_dense(attr.sparse_tensor)
    if t == AttributeProto.TYPE_PROTO:
        return attr.tp
    if t == AttributeProto.UNDEFINED and attr.ref_attr_name:
        raise ModelLoadError(f"attribute {attr.name!r} refers to a function attribute, which is only valid inside a function")
    raise ModelLoadError(f"attribute {attr.name!r} has unsupported type {AttributeProto.AttributeType.Name(t)}")


def _inline(tensor: Any, name: str) -> Any:
    """``tensor`` if its data is in the model; onnx would read external data from the current
    directory, outside any check, so only initializers and Constant nodes may have it."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        raise ModelLoadError(f"attribute {name!r} holds a tensor with external data: only initializers and "
                             "Constant nodes may keep their data outside the model")
    return tensor


def attributes_dict(attrs) -> dict[str, Any]:
    return {a.name: attribute_value(a) for a in attrs}


def sparse_to_dense(sparse) -> np.ndarray:
    """Dense array of a ``SparseTensorProto`` (indices given flat or as [nnz, rank] coordinates)."""
    values = numpy_helper.to_array(_inline(sparse.values, "sparse values"))
    dims = tuple(sparse.dims)
    dense = np.zeros(dims, dtype=values.dtype)
    indices = numpy_helper.to_array(_inline(sparse.indices, "sparse indices")).astype(np.int64)
    if indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense
