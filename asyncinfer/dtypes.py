"""Mapping between ONNX element types and NumPy dtypes."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from .errors import ModelLoadError


def onnx_to_numpy(elem_type: int) -> np.dtype:
    """NumPy dtype of an ONNX ``TensorProto`` element type (bfloat16 and float8 through ml_dtypes)."""
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception as exc:  # onnx raises KeyError/ValueError depending on version
        name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() else elem_type
        raise ModelLoadError(f"unsupported tensor element type {name}") from exc


def numpy_to_onnx(dtype: np.dtype) -> int:
    """ONNX element type of a NumPy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def dtype_name(dtype: np.dtype | None) -> str:
    return "unknown" if dtype is None else np.dtype(dtype).name
