"""Convolution: cuDNN through CuPy where the device has it, else im2col + one (batched) GEMM.

The im2col path pads the input once, takes a strided *view* of every kernel window
(``(N, C, k..., o...)``: tap offsets, then output positions), and makes it contiguous in a single
copy, which is the GEMM operand ``(N, G, Cg*taps, P)``; the grouped weights ``(G, Mg, Cg*taps)``
multiply it in one ``matmul`` (cuBLAS strided-batched GEMM on the GPU). Pointwise unpadded convs
skip im2col: the (subsampled) input already is the operand. The window geometry (pads, auto_pad,
output size) is the CPU op's, so both backends agree on every attribute combination.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ....model.ir import Layer
from ....ops.base import Op
from ....ops.windows import spatial_attrs, window_geometry
from ...base import ValueTypes
from .activations import add_and_activate
from .base import Kernel, KernelContext, channel_shape, register, same_type


def pad_spatial(ctx: KernelContext, x: Any, begin: list[int], end: list[int], fill: float = 0.0) -> Any:
    """``x`` padded with ``fill`` on its trailing spatial dims (no copy when nothing is padded)."""
    if not any(begin) and not any(end):
        return x
    nsp = len(begin)
    lead = x.ndim - nsp
    shape = x.shape[:lead] + tuple(s + b + e for s, b, e in zip(x.shape[lead:], begin, end))
    out = ctx.xp.full(shape, fill, dtype=x.dtype) if fill else ctx.xp.zeros(shape, dtype=x.dtype)
    out[(Ellipsis,) + tuple(slice(b, b + s) for b, s in zip(begin, x.shape[lead:]))] = x
    return out


def window_view(ctx: KernelContext, x: Any, kernel: list[int], strides: list[int], dilations: list[int],
                out: list[int], windows_last: bool) -> Any:
    """A strided view of the (already padded) ``(N, C, spatial...)`` input over every window.

    ``windows_last`` False: ``(N, C, k..., o...)`` (taps first: im2col order);
    True: ``(N, C, o..., k...)`` (taps last: reduced over by the pools).
    """
    st = x.strides[2:]
    taps = [d * s for d, s in zip(dilations, st)]
    moves = [k * s for k, s in zip(strides, st)]
    if windows_last:
        shape = x.shape[:2] + tuple(out) + tuple(kernel)
        strides_b = x.strides[:2] + tuple(moves) + tuple(taps)
    else:
        shape = x.shape[:2] + tuple(kernel) + tuple(out)
        strides_b = x.strides[:2] + tuple(taps) + tuple(moves)
    return ctx.as_strided(x, shape, strides_b)


@register
class ConvKernel(Kernel):
    """N-D Conv with groups, strides, dilations, pads and auto_pad; bias and fused activations."""

    op_types = ("Conv",)
    takes_activations = True

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return super().accepts(layer, op, types, host) and same_type(types, layer.inputs)

    def run(self, ctx: KernelContext, x: Any, w: Any, b: Any = None, *, activations: Sequence = ()) -> Any:
        xp, op = ctx.xp, self.op
        group = int(op.attr("group"))
        nsp = x.ndim - 2
        kernel = [int(k) for k in (op.attr("kernel_shape", None) or w.shape[2:])]
        strides, dilations, pads = spatial_attrs(op, nsp, kernel)
        begin, end, out = window_geometry(x.shape[2:], kernel, strides, dilations, pads, op.attr("auto_pad"))
        n, c = x.shape[:2]
        m = w.shape[0]
        if x.shape[1] != w.shape[1] * group or m % group:
            raise ValueError(f"input channels {c}, weight {tuple(w.shape)} and group={group} do not match")
        if n == 0 or math.prod(out) == 0:
            return add_and_activate(ctx, xp.zeros((n, m, *out), dtype=x.dtype), None, activations, inplace=True)
        if ctx.conv is not None and begin == end:  # cuDNN takes symmetric pads only
            y = ctx.conv(x, w, begin, strides, dilations, group)
        else:
            y = self.im2col_conv(ctx, x, w, kernel, strides, dilations, begin, end, out, group)
        # the bias and the fused activations: one kernel on CUDA, on the fresh output
        return add_and_activate(ctx, y, None if b is None else b.reshape(channel_shape(y, m)), activations,
                                inplace=True)

    @staticmethod
    def im2col_conv(ctx: KernelContext, x: Any, w: Any, kernel: list[int], strides: list[int],
                    dilations: list[int], begin: list[int], end: list[int], out: list[int], group: int) -> Any:
        """The convolution (no bias) as im2col + grouped GEMM; a fresh ``(N, M, out...)`` buffer."""
        xp = ctx.xp
        n, c = x.shape[:2]
        m = w.shape[0]
        cg, mg, p = c // group, m // group, math.prod(out)
        if all(k == 1 for k in kernel) and not any(begin) and not any(end):
            if any(s > 1 for s in strides):  # pointwise: the subsampled input is the GEMM operand
                x = x[(Ellipsis,) + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, strides))]
            cols = xp.ascontiguousarray(x).reshape(n, group, cg, p)
        else:
            padded = pad_spatial(ctx, x, begin, end)
            view = window_view(ctx, padded, kernel, strides, dilations, out, windows_last=False)
            cols = xp.ascontiguousarray(view).reshape(n, group, cg * math.prod(kernel), p)
        wmat = w.reshape(group, mg, -1)
        # one image: a plain stack of per-group GEMMs (no broadcast batch axis)
        y = xp.matmul(wmat, cols[0])[None] if n == 1 else xp.matmul(wmat, cols)
        return y.reshape((n, m) + tuple(out))
