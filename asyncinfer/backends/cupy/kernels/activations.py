"""Activations: standalone layers, and the fused activations applied to another layer's output.

The optimizer folds single-consumer activations into the layer producing their input
(``Conv+Relu``, ``Gemm+Relu``, ``Sum+Relu``...). On the device they run right after that
layer's kernel, on its freshly written output: in place where the activation allows it (Relu,
Clip), so a fused layer costs no extra buffer. Each activation is a function of the work-precision
input (float16 computed in float32, as the CPU ops do) and the activation's CPU op, which holds
its parsed attributes and ONNX defaults.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ....ops.base import Op
from .base import KernelContext, Kernel, register, scalar

Activation = Callable[[KernelContext, Any, Op], Any]


def _sigmoid(ctx: KernelContext, x: Any, op: Op) -> Any:
    return 1 / (1 + ctx.xp.exp(-x))  # exp overflow for x << 0 gives 1/inf = 0, which is right


def _softplus(ctx: KernelContext, x: Any, op: Op) -> Any:
    return ctx.xp.logaddexp(scalar(x, 0), x)  # log(1 + e^x) without overflow


def _gelu(ctx: KernelContext, x: Any, op: Op) -> Any:
    xp = ctx.xp
    if op.attr("approximate", "none") == "tanh":
        return 0.5 * x * (1 + xp.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + ctx.erf(x / math.sqrt(2)).astype(x.dtype, copy=False))


def _elu(ctx: KernelContext, x: Any, op: Op) -> Any:
    return ctx.xp.where(x > 0, x, op.attr("alpha", 1.0) * ctx.xp.expm1(x))


def _selu(ctx: KernelContext, x: Any, op: Op) -> Any:
    alpha, gamma = op.attr("alpha", 1.67326319217681884765625), op.attr("gamma", 1.05070102214813232421875)
    return gamma * ctx.xp.where(x > 0, x, alpha * ctx.xp.expm1(x))


def _celu(ctx: KernelContext, x: Any, op: Op) -> Any:
    alpha = op.attr("alpha", 1.0)
    return ctx.xp.maximum(x, 0) + ctx.xp.minimum(0, alpha * ctx.xp.expm1(x / alpha))


def _shrink(ctx: KernelContext, x: Any, op: Op) -> Any:
    lambd, bias = op.attr("lambd", 0.5), op.attr("bias", 0.0)
    xp = ctx.xp
    return xp.where(x < -lambd, x + bias, xp.where(x > lambd, x - bias, scalar(x, 0)))


#: Single-input activations by op type (attributes read from the CPU op, with ONNX defaults).
ACTIVATIONS: dict[str, Activation] = {
    "Relu": lambda ctx, x, op: ctx.xp.maximum(x, scalar(x, 0)),
    "Sigmoid": _sigmoid,
    "Tanh": lambda ctx, x, op: ctx.xp.tanh(x),
    "HardSigmoid": lambda ctx, x, op: ctx.xp.clip(op.attr("alpha", 0.2) * x + op.attr("beta", 0.5), 0, 1),
    "HardSwish": lambda ctx, x, op: x * ctx.xp.clip(x / 6 + 0.5, 0, 1),
    "LeakyRelu": lambda ctx, x, op: ctx.xp.where(x >= 0, x, op.attr("alpha", 0.01) * x),
    "Elu": _elu,
    "Selu": _selu,
    "Celu": _celu,
    "Softplus": _softplus,
    "Softsign": lambda ctx, x, op: x / (1 + ctx.xp.abs(x)),
    "ThresholdedRelu": lambda ctx, x, op: ctx.xp.where(x > op.attr("alpha", 1.0), x, scalar(x, 0)),
    "Mish": lambda ctx, x, op: x * ctx.xp.tanh(_softplus(ctx, x, op)),
    "Shrink": _shrink,
    "Gelu": _gelu,
}


def clip_bounds(op: Op, extras: Sequence[Any]) -> tuple[Any, Any]:
    """Clip's (lo, hi) as host scalars or None: attributes before opset 11, inputs after."""
    if op.version < 11:
        return op.attr("min", None), op.attr("max", None)
    lo = extras[0] if len(extras) > 0 else None
    hi = extras[1] if len(extras) > 1 else None
    return (None if lo is None else np.asarray(lo).reshape(-1)[0],
            None if hi is None else np.asarray(hi).reshape(-1)[0])


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
    """Whether a fused activation of this type runs on the device."""
    return op_type in ACTIVATIONS or op_type == "Clip"


def apply_activation(ctx: KernelContext, y: Any, op: Op, extras: Sequence[Any], inplace: bool) -> Any:
    """One activation on ``y``; overwrites ``y`` when ``inplace`` and the activation allows it."""
    if op.op_type == "Clip":
        lo, hi = clip_bounds(op, extras)
        return clip(ctx, y, lo, hi, inplace)
    if op.op_type == "Relu" and inplace:
        return ctx.xp.maximum(y, scalar(y, 0), out=y)
    return ACTIVATIONS[op.op_type](ctx, ctx.work(y), op).astype(y.dtype, copy=False)


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
    fused kernel where it can (:mod:`..fusion`); otherwise array-API ops, overwriting ``x`` when
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
        return ACTIVATIONS[self.layer.op_type](ctx, ctx.work(x), self.op).astype(x.dtype, copy=False)


@register
class ClipKernel(Kernel):
    """Clip; its bounds (inputs 1 and 2 since opset 11) are read on the host."""

    op_types = ("Clip",)
    host_inputs = frozenset({1, 2})

    def run(self, ctx: KernelContext, x: Any, lo: Any = None, hi: Any = None) -> Any:
        low, high = clip_bounds(self.op, [lo, hi])
        return clip(ctx, x, low, high, inplace=False)
