"""Softmax, LogSoftmax and Hardmax.

Before opset 13 these ops flatten the input to 2-D at ``axis`` (default 1) and normalise each row;
from 13 on they normalise along ``axis`` alone (default -1). Softmax subtracts the maximum first so
``exp`` cannot overflow; narrow floats are computed in float32.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .base import Op
from .compiled.normalization import SOFTMAX_ROWS
from .elementwise import compute_dtype
from .one_pass import row_kernel
from .registry import register


def _softmax(xp: Any, x: Any, axis: int, storage: np.dtype | None = None) -> Any:
    """Softmax computed in ``x``'s dtype; with ``storage`` (a narrower float), the exponentials
    and their sum are rounded to it as a kernel keeping its intermediates in that type does,
    which is what ONNX's float16 reference outputs expect."""
    e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    if storage is not None:
        e = e.astype(storage).astype(x.dtype)
        return e / xp.sum(e, axis=axis, keepdims=True).astype(storage).astype(x.dtype)
    return e / xp.sum(e, axis=axis, keepdims=True)


def _log_softmax(xp: Any, x: Any, axis: int) -> Any:
    shifted = x - xp.max(x, axis=axis, keepdims=True)
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True))


def log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """LogSoftmax of a NumPy array along ``axis``."""
    return _log_softmax(np, x, axis)


def _hardmax(xp: Any, x: Any, axis: int) -> Any:
    """1 at the first maximum along ``axis``, 0 elsewhere."""
    positions = xp.arange(x.shape[axis]).reshape((-1,) + (1,) * (x.ndim - 1 - axis % x.ndim))
    return (xp.expand_dims(xp.argmax(x, axis=axis), axis) == positions).astype(x.dtype)


class _Normalise(Op):
    along: ClassVar[Callable[[Any, Any, int], Any]]

    def run(self, x: np.ndarray) -> np.ndarray:
        if type(self).along is _softmax and x.dtype == np.float32 and x.size:
            axis = self.attr("axis") % max(x.ndim, 1)
            if self.version < 13 or axis == x.ndim - 1:  # rows: the last axis, or the 2-D coercion
                rows = np.ascontiguousarray(x).reshape(-1, math.prod(x.shape[axis:]))
                y = np.empty(x.shape, np.float32)
                # compiled passes over each row, rows shared with the spinning helpers when many
                row_kernel(SOFTMAX_ROWS, rows.reshape(-1), rows.shape[1], rows.shape[1], y.reshape(-1), rows.shape[0])
                return y
        with np.errstate(all="ignore"):
            return self.normalise(np, x)

    def normalise(self, xp: Any, x: Any) -> Any:
        """The op with the array module ``xp`` (NumPy here, CuPy on gpu_compute); narrow floats are
        computed in float32."""
        if x.size == 0:
            return xp.empty_like(x)
        data = x.astype(compute_dtype(x.dtype), copy=False)
        fn = type(self).along
        if fn is _softmax and data.dtype != x.dtype:
            fn = functools.partial(_softmax, storage=x.dtype)
        if self.version >= 13:
            out = fn(xp, data, self.attr("axis"))
        else:  # coerce to [prod(shape[:axis]), prod(shape[axis:])]
            axis = self.attr("axis") % max(x.ndim, 1)
            out = fn(xp, data.reshape(math.prod(x.shape[:axis]), -1), 1).reshape(x.shape)
        return out.astype(x.dtype, copy=False)


for _name, _fn in (("Softmax", _softmax), ("LogSoftmax", _log_softmax), ("Hardmax", _hardmax)):
    register(_name, (1, 11, 13))(type(_name, (_Normalise,), {
        "along": staticmethod(_fn), "__doc__": f"ONNX {_name} (2-D coercion before opset 13)."}))
