"""Activations: standalone layers, and the fused activations applied to another layer's output.

The optimizer folds single-consumer activations into the layer producing their input
(``Conv+Relu``, ``Gemm+Relu``, ``Sum+Relu``...). On the device they run right after that
layer's kernel, on its freshly written output: in place where the activation allows it (Relu,
Clip), so a fused layer costs no extra buffer. What each activation computes is the array-API
function of its line in the element-wise table (`asyncinfer.ops.pointwise`), run here with
``ctx.xp`` on the work-precision input (float16 computed in float32, as the CPU ops do); its
attributes are read through the layer's CPU op (``op.attr``: ONNX's defaults).
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from ....ops.base import Op
from ....ops.elementwise import clip_bounds as _clip_bounds
from ....ops.pointwise import ACTIVATIONS, UNARY_OPS, Unary
from .base import KernelContext, Kernel, register


class _Namespace:
    """``ctx.xp`` plus the device's ``erf``: the array namespace the table's functions run on."""

    def __init__(self, xp: Any, erf: Any):
        self._xp = xp
        self.erf = erf

    def __getattr__(self, name: str) -> Any:
        return getattr(self._xp, name)


@lru_cache(maxsize=16)
def namespace(ctx: KernelContext) -> Any:
    """The array namespace of ``ctx`` for the element-wise table's functions."""
    return _Namespace(ctx.xp, ctx.erf)


def compute(ctx: KernelContext, entry: Unary, x: Any, op: Op) -> Any:
    """``entry``'s function of ``x`` (in work precision), in ``x``'s dtype (bool for predicates)."""
    y = entry.fn(namespace(ctx), ctx.work(x), **entry.values(op))
    return y if entry.to_bool else y.astype(x.dtype, copy=False)


def clip_bounds(op: Op, extras: Sequence[Any]) -> tuple[Any, Any]:
    """Clip's (lo, hi) as host scalars or None: attributes before opset 11, inputs after."""
    return _clip_bounds(op, *list(extras)[:2])


def clip(ctx: KernelContext, x: Any, lo: Any, hi: Any, inplace: bool) -> Any:
    """``min(max(x, lo), hi)`` (hi applied last: lo > hi gives hi everywhere, as ONNX says)."""
    xp = ctx.xp
    dt = np.dtype(x.dtype)
    with np.errstate(over="ignore"):  # a float32-lowest bound on a float16 tensor becomes -inf
        lo_v = None if lo is None else np.asarray(lo).astype(dt)[()]
        hi_v = None if hi is None else np.asarray(hi).astype(dt)[()]
    y = x if inplace else x.copy()
    if lo_v is not None:
        xp.maximum(y, lo_v, out=y)
    if hi_v is not None:
        xp.minimum(y, hi_v, out=y)
    return y


def can_fuse(op_type: str) -> bool:
    """Whether a fused activation of this type runs on the device (every table activation, Clip)."""
    return op_type in ACTIVATIONS or op_type == "Clip"


def apply_activation(ctx: KernelContext, y: Any, op: Op, extras: Sequence[Any], inplace: bool) -> Any:
    """One activation on ``y``; overwrites ``y`` when ``inplace`` and the activation allows it."""
    if op.op_type == "Clip":
        lo, hi = clip_bounds(op, extras)
        return clip(ctx, y, lo, hi, inplace)
    entry = ACTIVATIONS[op.op_type]
    if inplace and entry.inplace is not None and y.dtype.itemsize >= 4:  # narrow floats: float32 math
        return entry.inplace(ctx.xp, y, **op.values)
    return compute(ctx, entry, y, op)


def apply_activations(ctx: KernelContext, y: Any, activations: Sequence[tuple[Op, Sequence[Any]]],
                      fresh: bool) -> Any:
    """Run a layer's fused activations, in order, on its output ``y`` (in place when ``fresh``)."""
    for op, extras in activations:
        out = apply_activation(ctx, y, op, extras, fresh)
        fresh = fresh or out is not y  # a new buffer belongs to us: later ones may overwrite it
        y = out
    return y


def add_and_activate(ctx: KernelContext, x: Any, b: Any, activations: Sequence[tuple[Op, Sequence[Any]]],
                     inplace: bool) -> Any:
    """``activations(x + b)`` (``b`` may be None). On CUDA a chain with activations runs as one
    fused kernel where it can (`..fusion`); otherwise array-API ops, overwriting ``x`` when
    ``inplace`` (then ``x`` must already have the broadcast shape of ``x + b``)."""
    if activations and ctx.fuse is not None:
        y = ctx.fuse(x, b, activations, x if inplace else None)
        if y is not None:
            return y
    if b is not None:
        if inplace:
            x += b
        else:
            x, inplace = x + b, True
    return apply_activations(ctx, x, activations, inplace)


@register
class ActivationKernel(Kernel):
    """A standalone activation layer (one not fused into its producer)."""

    op_types = tuple(ACTIVATIONS)

    def run(self, ctx: KernelContext, x: Any) -> Any:
        return compute(ctx, UNARY_OPS[self.layer.op_type], x, self.op)


@register
class ClipKernel(Kernel):
    """Clip; its bounds (inputs 1 and 2 since opset 11) are read on the host."""

    op_types = ("Clip",)
    host_inputs = frozenset({1, 2})

    def run(self, ctx: KernelContext, x: Any, lo: Any = None, hi: Any = None) -> Any:
        low, high = clip_bounds(self.op, [lo, hi])
        return clip(ctx, x, low, high, inplace=False)
