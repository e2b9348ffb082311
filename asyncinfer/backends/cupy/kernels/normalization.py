"""Softmax/LogSoftmax, LayerNormalization, BatchNormalization (inference), InstanceNormalization
and LRN. Statistics are computed in float32 (or the ``stash_type``) and never in float64."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ....model.ir import Layer
from ....ops.base import Op
from ....ops.normalization import _stash_dtype
from ...base import ValueTypes
from .activations import add_and_activate
from .base import FLOATS, Kernel, KernelContext, all_typed, channel_shape, register, same_type, scalar


@register
class SoftmaxKernel(Kernel):
    """Softmax and LogSoftmax: the CPU op's array-API code (along ``axis`` from opset 13, on the
    2-D coercion before it), run on the device."""

    op_types = ("Softmax", "LogSoftmax")

    def run(self, ctx: KernelContext, x: Any) -> Any:
        return self.op.normalise(ctx.xp, x)


@register
class LayerNormKernel(Kernel):
    """LayerNormalization over dims ``axis..``; also the Mean and InvStdDev outputs (stash type)."""

    op_types = ("LayerNormalization",)

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        stats = [o for o in layer.outputs[1:] if o]
        return (_stash_dtype(op) == np.float32 and all_typed(types, layer.inputs, FLOATS)
                and same_type(types, layer.inputs) and all_typed(types, layer.outputs[:1], FLOATS)
                and all_typed(types, stats, {np.dtype(np.float32)}))

    def run(self, ctx: KernelContext, x: Any, scale: Any, bias: Any = None) -> tuple:
        xp = ctx.xp
        axis = int(self.op.attr("axis"))
        axis = axis + x.ndim if axis < 0 else axis
        axes = tuple(range(axis, x.ndim))
        xs = x.astype(xp.float32, copy=False)
        mean = xs.mean(axis=axes, keepdims=True)
        centred = xs - mean
        var = (centred * centred).mean(axis=axes, keepdims=True)
        inv_std = 1 / xp.sqrt(var + np.float32(self.op.attr("epsilon")))
        centred *= inv_std
        y = centred.astype(x.dtype, copy=False) * scale
        if bias is not None:
            y += bias
        return y, mean, inv_std


@register
class BatchNormKernel(Kernel):
    """Inference BatchNormalization as ``x * a + b`` with per-channel ``a`` and ``b``.

    ``a`` and ``b`` are folded on the device at the first run and kept for as long as the
    statistics are the same device arrays (they are constants uploaded once, in practice).
    """

    op_types = ("BatchNormalization",)
    takes_activations = True  # the shift and the activations share one kernel on CUDA

    def __init__(self, layer: Layer, op: Op):
        super().__init__(layer, op)
        self._folded: tuple[tuple, Any, Any] | None = None

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        # training mode (the CPU op's ``training``) normalizes with the batch's statistics: not here
        return (not op.training and sum(1 for o in layer.outputs if o) == 1  # type: ignore[attr-defined]
                and super().accepts(layer, op, types, host) and same_type(types, layer.inputs))

    def run(self, ctx: KernelContext, x: Any, scale: Any, bias: Any, mean: Any, var: Any, *,
            activations: Sequence = ()) -> Any:
        stats = (scale, bias, mean, var)
        if self._folded is None or any(a is not b for a, b in zip(self._folded[0], stats)):
            f32 = ctx.xp.float32
            a = scale.astype(f32) / ctx.xp.sqrt(var.astype(f32) + np.float32(self.op.attr("epsilon")))
            b = bias.astype(f32) - mean.astype(f32) * a
            self._folded = (stats, a.astype(x.dtype), b.astype(x.dtype))  # holds the stats: ids stay valid
        _, a, b = self._folded
        shape = channel_shape(x, x.shape[1])
        return add_and_activate(ctx, x * a.reshape(shape), b.reshape(shape), activations, inplace=True)


@register
class InstanceNormKernel(Kernel):
    """Normalize each (n, c) plane over its spatial dims, then scale and shift per channel."""

    op_types = ("InstanceNormalization",)

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return super().accepts(layer, op, types, host) and same_type(types, layer.inputs)

    def run(self, ctx: KernelContext, x: Any, scale: Any, bias: Any) -> Any:
        xp = ctx.xp
        axes = tuple(range(2, x.ndim))
        xs = x.astype(xp.float32, copy=False)
        mean = xs.mean(axis=axes, keepdims=True)
        centred = xs - mean
        var = (centred * centred).mean(axis=axes, keepdims=True)
        shape = channel_shape(x, x.shape[1])
        centred *= scale.astype(xp.float32).reshape(shape) / xp.sqrt(var + np.float32(self.op.attr("epsilon")))
        centred += bias.astype(xp.float32).reshape(shape)
        return centred.astype(x.dtype, copy=False)


@register
class LRNKernel(Kernel):
    """Local response normalization: a sliding sum of squares over ``size`` channels, read as a
    strided window view of the channel-padded squares and reduced in one kernel."""

    op_types = ("LRN",)

    def run(self, ctx: KernelContext, x: Any) -> Any:
        xp, op = ctx.xp, self.op
        size = int(op.attr("size"))
        alpha, beta, bias = float(op.attr("alpha")), float(op.attr("beta")), float(op.attr("bias"))
        n, c = x.shape[:2]
        lo = (size - 1) // 2  # channels before each channel (the rest come after)
        w = ctx.work(x)
        padded = xp.zeros((n, c + size - 1) + x.shape[2:], dtype=w.dtype)
        padded[:, lo:lo + c] = w * w
        window = ctx.as_strided(padded, (n, c, size) + x.shape[2:],
                                padded.strides[:2] + padded.strides[1:2] + padded.strides[2:])
        acc = window.sum(axis=2)
        acc *= scalar(acc, alpha / size)
        acc += scalar(acc, bias)
        return (w * xp.power(acc, scalar(acc, -beta))).astype(x.dtype, copy=False)
