"""Element-wise kernels: unary math, binary arithmetic with broadcasting, comparisons, logic,
the variadic Sum/Mean/Max/Min, Where and Cast.

Results keep the ONNX output type (NumPy and CuPy would otherwise promote, e.g. float16 with a
float32 exponent); float16 transcendental math is computed in float32 and rounded back, as the
CPU kernels do.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from ....model.ir import Layer
from ....ops.base import Op
from ...base import ValueTypes
from .activations import add_and_activate, apply_activations
from .base import FLOATS, PLAIN, Kernel, KernelContext, all_typed, register, same_type

# Unary math by op type: the NumPy/CuPy function name (both modules have all of them).
_UNARY_MATH = {
    "Abs": "abs", "Neg": "negative", "Reciprocal": "reciprocal", "Floor": "floor", "Ceil": "ceil",
    "Round": "rint", "Sign": "sign", "Sqrt": "sqrt", "Exp": "exp", "Log": "log", "Sin": "sin",
    "Cos": "cos", "Tan": "tan", "Asin": "arcsin", "Acos": "arccos", "Atan": "arctan", "Sinh": "sinh",
    "Cosh": "cosh", "Asinh": "arcsinh", "Acosh": "arccosh", "Atanh": "arctanh",
}


def _legacy_broadcast(layer: Layer) -> bool:
    """Opsets < 7 aligned B to A from ``axis`` (broadcast=1 with an axis): not done on the device."""
    return layer.version < 7 and bool(layer.attrs.get("broadcast", 0)) and layer.attrs.get("axis") is not None


@register
class UnaryMathKernel(Kernel):
    op_types = tuple(_UNARY_MATH) + ("Erf",)

    def run(self, ctx: KernelContext, x: Any) -> Any:
        w = ctx.work(x)
        y = ctx.erf(w) if self.layer.op_type == "Erf" else getattr(ctx.xp, _UNARY_MATH[self.layer.op_type])(w)
        return y.astype(x.dtype, copy=False)


@register
class BinaryKernel(Kernel):
    """Add, Sub, Mul, Div (true division: floats only), Pow (the base's type), PRelu."""

    op_types = ("Add", "Sub", "Mul", "Div", "Pow", "PRelu")
    takes_activations = True

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        if _legacy_broadcast(layer) or len(layer.inputs) != 2:
            return False
        a, b = layer.inputs
        if layer.op_type == "Pow":  # the exponent may be any number type; the result has the base's
            numbers = PLAIN - {np.dtype(np.bool_)}
            return all_typed(types, [a, layer.outputs[0]], FLOATS) and all_typed(types, [b], numbers)
        return all_typed(types, [a, b, layer.outputs[0]], FLOATS) and same_type(types, [a, b])

    def run(self, ctx: KernelContext, a: Any, b: Any, *, activations: Sequence = ()) -> Any:
        if self.layer.op_type == "Add":  # with its activations: one kernel on CUDA (Add+Relu)
            return add_and_activate(ctx, a, b, activations, inplace=False)
        return apply_activations(ctx, self.compute(ctx, a, b), activations, fresh=True)

    def compute(self, ctx: KernelContext, a: Any, b: Any) -> Any:
        xp, kind = ctx.xp, self.layer.op_type
        if kind == "Sub":
            return xp.subtract(a, b)
        if kind == "Mul":
            return xp.multiply(a, b)
        if kind == "Div":
            return xp.divide(a, b)
        if kind == "PRelu":
            return xp.where(a < 0, a * b, a)
        return xp.power(ctx.work(a), ctx.work(b.astype(a.dtype, copy=False))).astype(a.dtype, copy=False)


_COMPARISONS = {"Equal": "equal", "Less": "less", "LessOrEqual": "less_equal", "Greater": "greater",
                "GreaterOrEqual": "greater_equal"}
_LOGIC = {"And": "logical_and", "Or": "logical_or", "Xor": "logical_xor", "Not": "logical_not"}


@register
class CompareKernel(Kernel):
    """Comparisons of two float tensors of one type, giving bool."""

    op_types = tuple(_COMPARISONS)

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return (not _legacy_broadcast(layer) and all_typed(types, layer.inputs, FLOATS)
                and same_type(types, layer.inputs) and all_typed(types, layer.outputs, {np.dtype(np.bool_)}))

    def run(self, ctx: KernelContext, a: Any, b: Any) -> Any:
        return getattr(ctx.xp, _COMPARISONS[self.layer.op_type])(a, b)


@register
class LogicKernel(Kernel):
    """And, Or, Xor, Not on bool tensors."""

    op_types = tuple(_LOGIC)
    dtypes = frozenset({np.dtype(np.bool_)})

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return not _legacy_broadcast(layer) and super().accepts(layer, op, types, host)

    def run(self, ctx: KernelContext, *xs: Any) -> Any:
        return getattr(ctx.xp, _LOGIC[self.layer.op_type])(*xs)


_FOLDS = {"Sum": "add", "Mean": "add", "Max": "maximum", "Min": "minimum"}


@register
class VariadicKernel(Kernel):
    """Sum, Mean, Max, Min of any number of same-typed float inputs, with broadcasting."""

    op_types = tuple(_FOLDS)
    takes_activations = True

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return super().accepts(layer, op, types, host) and same_type(types, layer.inputs)

    def run(self, ctx: KernelContext, *xs: Any, activations: Sequence = ()) -> Any:
        if self.layer.op_type == "Sum" and len(xs) >= 2:  # the last addition shares a kernel with the activations
            head = functools.reduce(ctx.xp.add, xs[:-1]) if len(xs) > 2 else xs[0]
            return add_and_activate(ctx, head, xs[-1], activations, inplace=False)
        fn = getattr(ctx.xp, _FOLDS[self.layer.op_type])
        out = functools.reduce(fn, xs) if len(xs) > 1 else xs[0].copy()  # one input: still a fresh buffer
        if self.layer.op_type == "Mean":
            out = out / np.dtype(out.dtype).type(len(xs))
        return apply_activations(ctx, out, activations, fresh=True)


@register
class WhereKernel(Kernel):
    """``cond ? x : y``; selection only, so any plain element type is carried."""

    op_types = ("Where",)

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        cond, x, y = layer.inputs
        return (all_typed(types, [cond], {np.dtype(np.bool_)}) and all_typed(types, [x, y, layer.outputs[0]], PLAIN)
                and same_type(types, [x, y, layer.outputs[0]]))

    def run(self, ctx: KernelContext, cond: Any, x: Any, y: Any) -> Any:
        return ctx.xp.where(cond, x, y)


@register
class CastKernel(Kernel):
    """Cast between the plain types (bool, int32, int64, float16, float32) and to floats.

    Casts *to* integers or bool are left to the CPU, whose rules for NaN and out-of-range values
    the device's C casts do not follow.
    """

    op_types = ("Cast",)
    targets: ClassVar[frozenset[np.dtype]] = FLOATS

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        target = getattr(op, "dtype", None)
        return (target is not None and np.dtype(target) in cls.targets
                and all_typed(types, layer.inputs, PLAIN) and all_typed(types, layer.outputs, cls.targets))

    def run(self, ctx: KernelContext, x: Any) -> Any:
        return x.astype(self.op.dtype)
