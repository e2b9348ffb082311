"""Pooling: MaxPool, AveragePool (windowed) and GlobalAveragePool, GlobalMaxPool.

A windowed pool pads the input once with the reduction's neutral value, takes a strided view of
every window (``(N, C, o..., k...)``) and reduces over the window axes in one reduction kernel.
Geometry, ceil_mode and count_include_pad follow the CPU ops exactly (their helpers are reused).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ....model.ir import Layer
from ....ops.base import Op
from ....ops.windows import spatial_attrs, window_geometry
from ....ops.pool import _window_counts
from ...base import ValueTypes
from .base import Kernel, KernelContext, register
from .conv import pad_spatial, window_view


class _WindowPool(Kernel):
    def geometry(self, x: Any) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int]]:
        """kernel, strides, dilations, begin pads, end pads (reaching past the explicit ones where
        ceil_mode lets the last window overhang) and the output size."""
        op = self.op
        kernel = [int(k) for k in op.attr("kernel_shape")]
        strides, dilations, pads = spatial_attrs(op, x.ndim - 2, kernel)
        begin, end, out = window_geometry(x.shape[2:], kernel, strides, dilations, pads,
                                          op.attr("auto_pad"), bool(op.attr("ceil_mode", 0)))
        reach = [max(e, (o - 1) * s + (k - 1) * d + 1 - (size + b))
                 for e, o, s, k, d, size, b in zip(end, out, strides, kernel, dilations, x.shape[2:], begin)]
        return kernel, strides, dilations, begin, reach, out

    def windows(self, ctx: KernelContext, x: Any, fill: float) -> tuple[Any, list[int], list[int]]:
        """The window view ``(N, C, o..., k...)``, the begin pads and the output size."""
        kernel, strides, dilations, begin, reach, out = self.geometry(x)
        padded = pad_spatial(ctx, x, begin, reach, fill)
        return window_view(ctx, padded, kernel, strides, dilations, out, windows_last=True), begin, out


def _tap_axes(nsp: int) -> tuple[int, ...]:
    return tuple(range(2 + nsp, 2 + 2 * nsp))


@register
class MaxPoolKernel(_WindowPool):
    """MaxPool without the Indices output (a layer asking for indices falls back to the CPU)."""

    op_types = ("MaxPool",)

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        wants_indices = len(layer.outputs) > 1 and bool(layer.outputs[1])
        return not wants_indices and super().accepts(layer, op, types, host)

    def run(self, ctx: KernelContext, x: Any) -> Any:
        nsp = x.ndim - 2
        _, _, _, _, _, out = self.geometry(x)
        if math.prod(out) == 0 or x.size == 0:
            return ctx.xp.zeros(x.shape[:2] + tuple(out), dtype=x.dtype)
        view, _, _ = self.windows(ctx, x, -np.inf)
        return view.max(axis=_tap_axes(nsp))


@register
class AveragePoolKernel(_WindowPool):
    """AveragePool; ``count_include_pad`` decides whether explicit pads count as elements."""

    op_types = ("AveragePool",)

    def __init__(self, layer: Layer, op: Op):
        super().__init__(layer, op)
        self._divisors: dict[tuple, Any] = {}  # per input shape: the device array of window sizes

    def run(self, ctx: KernelContext, x: Any) -> Any:
        nsp = x.ndim - 2
        kernel, strides, dilations, begin, reach, out = self.geometry(x)
        if math.prod(out) == 0 or x.size == 0:
            return ctx.xp.zeros(x.shape[:2] + tuple(out), dtype=x.dtype)
        view, _, _ = self.windows(ctx, x, 0.0)
        total = view.sum(axis=_tap_axes(nsp), dtype=ctx.xp.float32 if x.dtype == np.float16 else None)
        counts = self.divisor(ctx, x, kernel, strides, dilations, begin, out)
        if counts is None:  # every window is full: a scalar divide
            total *= np.float32(1.0 / math.prod(kernel))
        else:
            total /= counts
        return total.astype(x.dtype, copy=False)

    def divisor(self, ctx: KernelContext, x: Any, kernel: list[int], strides: list[int], dilations: list[int],
                begin: list[int], out: list[int]) -> Any:
        """Elements counted in each window (a device array of the output's spatial shape), or None
        when every window is full. Made on the host once per input shape, then kept on the device."""
        key = tuple(x.shape[2:])
        if key not in self._divisors:
            _, _, pads = spatial_attrs(self.op, x.ndim - 2, kernel)
            _, end, _ = window_geometry(x.shape[2:], kernel, strides, dilations, pads,
                                        self.op.attr("auto_pad"), bool(self.op.attr("ceil_mode", 0)))
            counts = _window_counts(x.shape[2:], kernel, strides, dilations, begin, end, out,
                                    bool(self.op.attr("count_include_pad", 0)))
            self._divisors[key] = None if counts is None else ctx.to_device(counts.astype(np.float32))
        return self._divisors[key]


@register
class GlobalPoolKernel(Kernel):
    """GlobalAveragePool and GlobalMaxPool: one reduction over the spatial dims."""

    op_types = ("GlobalAveragePool", "GlobalMaxPool")

    def run(self, ctx: KernelContext, x: Any) -> Any:
        axes = tuple(range(2, x.ndim))
        if self.layer.op_type == "GlobalMaxPool":
            return x.max(axis=axes, keepdims=True)
        return ctx.work(x).mean(axis=axes, keepdims=True).astype(x.dtype, copy=False)
