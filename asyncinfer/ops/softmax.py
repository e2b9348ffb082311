"""Softmax, LogSoftmax and Hardmax.

Before opset 13 these ops flatten the input to 2-D at ``axis`` (default 1) and normalise each row;
from 13 on they normalise along ``axis`` alone (default -1). Softmax subtracts the maximum first so
``exp`` cannot overflow; narrow floats are computed in float32.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from .base import Op
from .elementwise import compute_dtype
from .registry import register


def _softmax(x: np.ndarray, axis: int, storage: np.dtype | None = None) -> np.ndarray:
    """Softmax computed in ``x``'s dtype; with ``storage`` (a narrower float), the exponentials
    and their sum are rounded to it as a kernel keeping its intermediates in that type does,
    which is what ONNX's float16 reference outputs expect."""
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    if storage is not None:
        e = e.astype(storage).astype(x.dtype)
        return e / np.sum(e, axis=axis, keepdims=True).astype(storage).astype(x.dtype)
    return e / np.sum(e, axis=axis, keepdims=True)


def log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def _hardmax(x: np.ndarray, axis: int) -> np.ndarray:
    """1 at the first maximum along ``axis``, 0 elsewhere."""
    out = np.zeros_like(x)
    np.put_along_axis(out, np.expand_dims(np.argmax(x, axis=axis), axis), 1, axis=axis)
    return out


class _Normalise(Op):
    along: ClassVar[Callable[[np.ndarray, int], np.ndarray]]

    def run(self, x: np.ndarray) -> np.ndarray:
        if x.size == 0:
            return np.empty_like(x)
        data = x.astype(compute_dtype(x.dtype), copy=False)
        fn = type(self).along
        if fn is _softmax and data.dtype != x.dtype:
            fn = functools.partial(_softmax, storage=x.dtype)
        with np.errstate(all="ignore"):
            if self.version >= 13:
                out = fn(data, self.attr("axis", -1))
            else:  # coerce to [prod(shape[:axis]), prod(shape[axis:])]
                axis = self.attr("axis", 1) % max(x.ndim, 1)
                out = fn(data.reshape(math.prod(x.shape[:axis]), -1), 1).reshape(x.shape)
        return out.astype(x.dtype, copy=False)


for _name, _fn in (("Softmax", _softmax), ("LogSoftmax", log_softmax), ("Hardmax", _hardmax)):
    register(_name, (1, 11, 13))(type(_name, (_Normalise,), {
        "along": staticmethod(_fn), "__doc__": f"ONNX {_name} (2-D coercion before opset 13)."}))
