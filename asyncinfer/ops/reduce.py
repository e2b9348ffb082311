"""Reductions (ReduceSum … ReduceSumSquare), ArgMax/ArgMin, CumSum and CumProd.

Reduce ops took ``axes`` as an attribute until a given opset (13 for ReduceSum, 18 for the others)
and as an optional input after it; each op gets one class per form, the input form declaring
``value_inputs`` so the optimizer keeps the axes on the CPU. Narrow floats accumulate in float32.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .base import Op
from .compiled.normalization import MAX_ROWS
from .elementwise import compute_dtype
from .one_pass import row_kernel
from .registry import register
from .shape import int_list, normalize_axis

Axes = tuple[int, ...]


def _lowest(dtype: np.dtype) -> object:
    """The identity of max: -inf, the smallest integer, or False (ONNX's value for an empty max)."""
    if dtype == np.bool_:
        return False
    return np.iinfo(dtype).min if dtype.kind in "iu" else -np.inf


def _highest(dtype: np.dtype) -> object:
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).max if dtype.kind in "iu" else np.inf


def _extreme(xp: Any, fn: Callable[..., Any], x: Any, axes: Axes, keep: bool, identity: object) -> Any:
    """``fn`` (max or min) over ``axes``; over an empty set it is its identity, as ONNX says."""
    if x.size:
        return fn(x, axis=axes, keepdims=keep)
    shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape) if keep or i not in axes)
    return xp.full(shape, identity, dtype=x.dtype)


def _row_span(x: np.ndarray) -> tuple[np.ndarray, int]:
    """``x``'s rows (its last axis) as one flat read-only run of memory and the distance between
    row starts: in place where the rows are each contiguous and evenly spaced (SSDlite's scores
    less their first column: copying 1.2 MB took as long as the max), else a C-ordered copy's."""
    width, size = x.shape[-1], x.itemsize
    rows = x.reshape(-1, width) if x.strides[-1] == size else None  # (a view where it can be)
    if rows is None or rows.strides[1] != size or rows.strides[0] % size or rows.strides[0] < width * size:
        rows = np.ascontiguousarray(x).reshape(-1, width)
    stride = rows.strides[0] // size
    span = np.lib.stride_tricks.as_strided(rows, shape=((rows.shape[0] - 1) * stride + width,), strides=(size,),
                                           writeable=False)
    return span, stride


def _max(xp: Any, x: Any, axes: Axes, keep: bool) -> Any:
    return _extreme(xp, xp.max, x, axes, keep, _lowest(x.dtype))


def _sum(xp: Any, x: Any, axes: Axes, keep: bool) -> Any:
    return xp.sum(x, axis=axes, keepdims=keep, dtype=x.dtype)  # no int32 -> int64 promotion


def _log_sum_exp(xp: Any, x: Any, axes: Axes, keep: bool) -> Any:
    m = _extreme(xp, xp.max, x, axes, True, -np.inf)
    m = xp.where(xp.isfinite(m), m, 0)  # all -inf (or empty): log(0) = -inf, not NaN
    out = xp.log(xp.sum(xp.exp(x - m), axis=axes, keepdims=True)) + m
    return out if keep else xp.squeeze(out, axis=axes)


#: name -> (reduction ``f(xp, x, axes, keepdims)`` in the array API, with x in its compute dtype;
#: first version taking axes as an input; versions implemented). gpu_compute runs the same functions.
REDUCTIONS: dict[str, tuple[Callable[[Any, Any, Axes, bool], Any], int, tuple[int, ...]]] = {
    "ReduceSum": (_sum, 13, (1, 11, 13)),
    "ReduceMean": (lambda xp, x, a, k: xp.mean(x, axis=a, keepdims=k), 18, (1, 11, 13, 18)),
    "ReduceMax": (_max, 18, (1, 11, 12, 13, 18, 20)),
    "ReduceMin": (lambda xp, x, a, k: _extreme(xp, xp.min, x, a, k, _highest(x.dtype)), 18, (1, 11, 12, 13, 18, 20)),
    "ReduceProd": (lambda xp, x, a, k: xp.prod(x, axis=a, keepdims=k, dtype=x.dtype), 18, (1, 11, 13, 18)),
    "ReduceL1": (lambda xp, x, a, k: _sum(xp, xp.abs(x), a, k), 18, (1, 11, 13, 18)),
    "ReduceL2": (lambda xp, x, a, k: xp.sqrt(_sum(xp, x * x, a, k)), 18, (1, 11, 13, 18)),
    "ReduceLogSum": (lambda xp, x, a, k: xp.log(_sum(xp, x, a, k)), 18, (1, 11, 13, 18, 28)),
    "ReduceLogSumExp": (_log_sum_exp, 18, (1, 11, 13, 18, 28)),
    "ReduceSumSquare": (lambda xp, x, a, k: _sum(xp, x * x, a, k), 18, (1, 11, 13, 18)),
}


class _Reduce(Op):
    reduction: ClassVar[Callable[[Any, Any, Axes, bool], Any]]
    axes_as_input: ClassVar[bool] = False

    def run(self, x: np.ndarray, axes: np.ndarray | None = None) -> np.ndarray:
        if type(self).reduction is _max and x.dtype == np.float32 and x.size:
            reduced = self.reduced_axes(x.ndim, axes)
            if reduced == (x.ndim - 1,):  # rows: a compiled pass (`compiled.normalization.max_rows`)
                span, stride = _row_span(x)
                out = np.empty(x.size // x.shape[-1], np.float32)
                row_kernel(MAX_ROWS, span, stride, x.shape[-1], out, out.size)
                return out.reshape(x.shape[:-1] + ((1,) if self.attr("keepdims") else ()))
        with np.errstate(all="ignore"):
            return self.reduce(np, x, axes)

    def reduce(self, xp: Any, x: Any, axes: Any = None) -> Any:
        """The reduction with the array module ``xp`` (NumPy here, CuPy on gpu_compute); ``axes``
        is the host input of the newer opsets. Narrow floats accumulate in float32."""
        normalised = self.reduced_axes(x.ndim, axes)
        if normalised is None:
            return x
        out = type(self).reduction(xp, x.astype(compute_dtype(x.dtype), copy=False), normalised,
                                   bool(self.attr("keepdims")))
        return xp.asarray(out).astype(x.dtype, copy=False)

    def reduced_axes(self, rank: int, axes: Any = None) -> Axes | None:
        """The sorted axes reduced for an input of ``rank`` (``axes``: the host input of the newer
        opsets); None when none is (empty axes with ``noop_with_empty_axes``)."""
        if not self.axes_as_input:
            axes = self.attr("axes", None)
        if axes is None or len(axes) == 0:
            if self.attr("noop_with_empty_axes", 0):
                return None
            return tuple(range(rank))
        return tuple(sorted({int(a) % rank for a in np.asarray(axes).reshape(-1)})) if rank else ()


for _name, (_fn, _input_since, _versions) in REDUCTIONS.items():
    _attr_cls = type(_name, (_Reduce,), {"reduction": staticmethod(_fn),
                                         "__doc__": f"ONNX {_name}, axes given as an attribute."})
    register(_name, [v for v in _versions if v < _input_since])(_attr_cls)
    register(_name, [v for v in _versions if v >= _input_since])(type(_name, (_attr_cls,), {
        "axes_as_input": True, "value_inputs": (1,), "__doc__": f"ONNX {_name}, axes given as input 1."}))


class _ArgReduce(Op):
    """Index of the first (or, with select_last_index, last) extreme value along ``axis``, as int64."""

    name: ClassVar[str]  # "argmax" or "argmin": the function of the array module

    def run(self, x: np.ndarray) -> np.ndarray:
        return self.arg_reduce(np, x)

    def arg_reduce(self, xp: Any, x: Any) -> Any:
        """The index with the array module ``xp`` (NumPy here, CuPy on gpu_compute)."""
        fn = getattr(xp, type(self).name)
        axis = self.attr("axis") % max(x.ndim, 1)
        data = x.astype(compute_dtype(x.dtype), copy=False)
        if self.attr("select_last_index", 0):
            index = x.shape[axis] - 1 - fn(xp.flip(data, axis), axis=axis)
        else:
            index = fn(data, axis=axis)
        if self.attr("keepdims"):
            index = xp.expand_dims(index, axis)
        return xp.asarray(index).astype(np.int64, copy=False)


register("ArgMax", (1, 11, 12, 13))(type("ArgMax", (_ArgReduce,), {"name": "argmax"}))
register("ArgMin", (1, 11, 12, 13))(type("ArgMin", (_ArgReduce,), {"name": "argmin"}))


class _Cumulative(Op):
    """Running sum/product along the axis given as input 1: ``exclusive`` shifts by one (the
    identity first), ``reverse`` runs from the end. Narrow floats accumulate in float32."""

    accumulate: ClassVar[Callable[..., np.ndarray]]
    identity: ClassVar[int]

    def run(self, x: np.ndarray, axis: np.ndarray) -> np.ndarray:
        ax = normalize_axis(self, int_list(axis)[0], max(x.ndim, 1))
        data = np.atleast_1d(x)
        reverse = bool(self.attr("reverse"))
        if reverse:
            data = np.flip(data, ax)
        if self.attr("exclusive"):
            first = np.full(data.shape[:ax] + (1,) + data.shape[ax + 1:], self.identity, data.dtype)
            data = np.concatenate([first, np.delete(data, -1, axis=ax)], axis=ax)
        with np.errstate(all="ignore"):
            out = type(self).accumulate(data, axis=ax, dtype=compute_dtype(x.dtype))
        if reverse:
            out = np.flip(out, ax)
        return np.ascontiguousarray(out).astype(x.dtype, copy=False).reshape(x.shape)


@register("CumSum", versions=(11, 14))
class CumSum(_Cumulative):
    accumulate = staticmethod(np.cumsum)
    identity = 0


@register("CumProd", versions=(26,))
class CumProd(_Cumulative):
    accumulate = staticmethod(np.cumprod)
    identity = 1
