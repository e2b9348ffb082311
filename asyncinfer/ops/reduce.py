"""Reductions (ReduceSum … ReduceSumSquare), ArgMax/ArgMin, CumSum and CumProd.

Reduce ops took ``axes`` as an attribute until a given opset (13 for ReduceSum, 18 for the others)
and as an optional input after it; each op gets one class per form, the input form declaring
``value_inputs`` so the optimizer keeps the axes on the CPU. Narrow floats accumulate in float32.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np

from .base import Op
from .elementwise import compute_dtype
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


def _sum(x: np.ndarray, axes: Axes, keep: bool) -> np.ndarray:
    return np.sum(x, axis=axes, keepdims=keep, dtype=x.dtype)  # no int32 -> int64 promotion


def _log_sum_exp(x: np.ndarray, axes: Axes, keep: bool) -> np.ndarray:
    m = np.max(x, axis=axes, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0)  # all -inf (or empty): log(0) = -inf, not NaN
    out = np.log(np.sum(np.exp(x - m), axis=axes, keepdims=True)) + m
    return out if keep else np.squeeze(out, axis=axes)


# name -> (reduction of (x, axes, keepdims) with x in its compute dtype, first version taking axes as an
# input, versions implemented)
_REDUCTIONS: dict[str, tuple[Callable[[np.ndarray, Axes, bool], np.ndarray], int, tuple[int, ...]]] = {
    "ReduceSum": (_sum, 13, (1, 11, 13)),
    "ReduceMean": (lambda x, a, k: np.mean(x, axis=a, keepdims=k), 18, (1, 11, 13, 18)),
    "ReduceMax": (lambda x, a, k: np.max(x, axis=a, keepdims=k, initial=_lowest(x.dtype)), 18, (1, 11, 12, 13, 18, 20)),
    "ReduceMin": (lambda x, a, k: np.min(x, axis=a, keepdims=k, initial=_highest(x.dtype)), 18, (1, 11, 12, 13, 18, 20)),
    "ReduceProd": (lambda x, a, k: np.prod(x, axis=a, keepdims=k, dtype=x.dtype), 18, (1, 11, 13, 18)),
    "ReduceL1": (lambda x, a, k: _sum(np.abs(x), a, k), 18, (1, 11, 13, 18)),
    "ReduceL2": (lambda x, a, k: np.sqrt(_sum(x * x, a, k)), 18, (1, 11, 13, 18)),
    "ReduceLogSum": (lambda x, a, k: np.log(_sum(x, a, k)), 18, (1, 11, 13, 18, 28)),
    "ReduceLogSumExp": (_log_sum_exp, 18, (1, 11, 13, 18, 28)),
    "ReduceSumSquare": (lambda x, a, k: _sum(x * x, a, k), 18, (1, 11, 13, 18)),
}


class _Reduce(Op):
    reduction: ClassVar[Callable[[np.ndarray, Axes, bool], np.ndarray]]
    axes_as_input: ClassVar[bool] = False

    def run(self, x: np.ndarray, axes: np.ndarray | None = None) -> np.ndarray:
        if not self.axes_as_input:
            axes = self.attr("axes", None)
        if axes is None or len(axes) == 0:
            if self.attr("noop_with_empty_axes", 0):
                return x
            axes = range(x.ndim)
        normalised = tuple(sorted({int(a) % x.ndim for a in axes})) if x.ndim else ()
        with np.errstate(all="ignore"):
            out = type(self).reduction(x.astype(compute_dtype(x.dtype), copy=False), normalised,
                                       bool(self.attr("keepdims")))
            return np.asarray(out).astype(x.dtype, copy=False)


for _name, (_fn, _input_since, _versions) in _REDUCTIONS.items():
    _attr_cls = type(_name, (_Reduce,), {"reduction": staticmethod(_fn),
                                         "__doc__": f"ONNX {_name}, axes given as an attribute."})
    register(_name, [v for v in _versions if v < _input_since])(_attr_cls)
    register(_name, [v for v in _versions if v >= _input_since])(type(_name, (_attr_cls,), {
        "axes_as_input": True, "value_inputs": (1,), "__doc__": f"ONNX {_name}, axes given as input 1."}))


class _ArgReduce(Op):
    """Index of the first (or, with select_last_index, last) extreme value along ``axis``, as int64."""

    fn: ClassVar[Callable[..., np.ndarray]]

    def run(self, x: np.ndarray) -> np.ndarray:
        axis = self.attr("axis") % max(x.ndim, 1)
        data = x.astype(compute_dtype(x.dtype), copy=False)
        if self.attr("select_last_index", 0):
            index = x.shape[axis] - 1 - type(self).fn(np.flip(data, axis), axis=axis)
        else:
            index = type(self).fn(data, axis=axis)
        if self.attr("keepdims"):
            index = np.expand_dims(index, axis)
        return np.asarray(index, dtype=np.int64)


register("ArgMax", (1, 11, 12, 13))(type("ArgMax", (_ArgReduce,), {"fn": staticmethod(np.argmax)}))
register("ArgMin", (1, 11, 12, 13))(type("ArgMin", (_ArgReduce,), {"fn": staticmethod(np.argmin)}))


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
