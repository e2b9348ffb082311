"""Reductions (ReduceSum ... ReduceSumSquare) and ArgMax/ArgMin.

The axes are an attribute in older opsets and a host input (a CPU ``value_input``) in newer ones,
exactly as the CPU op declares; float16 accumulates in float32.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ....model.ir import Layer
from ....ops.base import Op
from ...base import ValueTypes
from .base import FLOATS, Kernel, KernelContext, all_typed, register

Axes = tuple[int, ...]


def _log_sum_exp(xp: Any, x: Any, axes: Axes, keep: bool) -> Any:
    m = x.max(axis=axes, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0)  # all -inf: log(0) = -inf, not NaN
    out = xp.log(xp.exp(x - m).sum(axis=axes, keepdims=True)) + m
    return out if keep else xp.squeeze(out, axis=axes)


_REDUCTIONS: dict[str, Callable[[Any, Any, Axes, bool], Any]] = {
    "ReduceSum": lambda xp, x, a, k: x.sum(axis=a, keepdims=k),
    "ReduceMean": lambda xp, x, a, k: x.mean(axis=a, keepdims=k),
    "ReduceMax": lambda xp, x, a, k: x.max(axis=a, keepdims=k),
    "ReduceMin": lambda xp, x, a, k: x.min(axis=a, keepdims=k),
    "ReduceProd": lambda xp, x, a, k: x.prod(axis=a, keepdims=k),
    "ReduceL1": lambda xp, x, a, k: xp.abs(x).sum(axis=a, keepdims=k),
    "ReduceL2": lambda xp, x, a, k: xp.sqrt((x * x).sum(axis=a, keepdims=k)),
    "ReduceLogSum": lambda xp, x, a, k: xp.log(x.sum(axis=a, keepdims=k)),
    "ReduceLogSumExp": _log_sum_exp,
    "ReduceSumSquare": lambda xp, x, a, k: (x * x).sum(axis=a, keepdims=k),
}


@register
class ReduceKernel(Kernel):
    """Every Reduce* op on float tensors; an empty Max/Min (no identity on the device) falls back."""

    op_types = tuple(_REDUCTIONS)

    def run(self, ctx: KernelContext, x: Any, axes_input: Any = None) -> Any:
        op = self.op
        axes = axes_input if getattr(op, "axes_as_input", False) else op.attr("axes", None)
        if axes is None or len(axes) == 0:
            if op.attr("noop_with_empty_axes", 0):
                return x
            axes = range(x.ndim)
        normalised = tuple(sorted({int(a) % x.ndim for a in np.asarray(axes).reshape(-1)})) if x.ndim else ()
        if x.size == 0 and self.layer.op_type in ("ReduceMax", "ReduceMin"):
            raise ValueError(f"{self.layer.op_type} of an empty tensor on the device")
        out = _REDUCTIONS[self.layer.op_type](ctx.xp, ctx.work(x), normalised, bool(op.attr("keepdims")))
        return out.astype(x.dtype, copy=False)


@register
class ArgReduceKernel(Kernel):
    """ArgMax/ArgMin of a float tensor: the first (or last) extreme index along ``axis``, int64."""

    op_types = ("ArgMax", "ArgMin")

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return all_typed(types, layer.inputs, FLOATS) and all_typed(types, layer.outputs, {np.dtype(np.int64)})

    def run(self, ctx: KernelContext, x: Any) -> Any:
        xp = ctx.xp
        axis = int(self.op.attr("axis")) % max(x.ndim, 1)
        fn = xp.argmax if self.layer.op_type == "ArgMax" else xp.argmin
        if self.op.attr("select_last_index", 0):
            index = x.shape[axis] - 1 - fn(xp.flip(x, axis), axis=axis)
        else:
            index = fn(x, axis=axis)
        if self.op.attr("keepdims"):
            index = xp.expand_dims(index, axis)
        return index.astype(np.int64, copy=False)
