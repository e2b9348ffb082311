"""Element-wise kernels: unary math (the functions of the element-wise table), binary arithmetic
with broadcasting, comparisons, logic, the variadic Sum/Mean/Max/Min, Where and Cast.

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
from ....ops.pointwise import BINARY_OPS, UNARY_OPS, Binary
from ...base import ValueTypes
from .activations import add_and_activate, apply_activations, compute, namespace
from .base import FLOATS, PLAIN, Kernel, KernelContext, all_typed, register, same_type


def _legacy_broadcast(layer: Layer) -> bool:
    """Opsets < 7 aligned B to A from ``axis`` (broadcast=1 with an axis), and PRelu's slope to
    the channel axis: not done on the device."""
    if layer.version < 7 and layer.op_type == "PRelu":
        return True
    return layer.version < 7 and bool(layer.attrs.get("broadcast", 0)) and layer.attrs.get("axis") is not None


@register
class UnaryMathKernel(Kernel):
    """Every op of the element-wise table with a device form that is neither an activation
    (`ActivationKernel`) nor a logic op on bools (Not, in LogicKernel):
    its array-API function on ``ctx.xp``. Predicates (IsNaN) give bool."""

    op_types = tuple(name for name, e in UNARY_OPS.items() if e.on_device and not e.activation and not e.bool_input)

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        if UNARY_OPS[layer.op_type].to_bool:
            return all_typed(types, layer.inputs, FLOATS) and all_typed(types, layer.outputs, {np.dtype(np.bool_)})
        return super().accepts(layer, op, types, host)

    def run(self, ctx: KernelContext, x: Any) -> Any:
        return compute(ctx, UNARY_OPS[self.layer.op_type], x, self.op)


@register
class BinaryKernel(Kernel):
    """Add, Sub, Mul, Div (true division: floats only), Pow (the base's type), PRelu: the
    binary table's arithmetic with a device form, its array-API function on ``ctx.xp``."""

    op_types = tuple(name for name, e in BINARY_OPS.items() if e.on_device and not e.to_bool and not e.variadic)
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
        return binary(ctx, BINARY_OPS[self.layer.op_type], a, b).astype(a.dtype, copy=False)


def binary(ctx: KernelContext, entry: Binary, a: Any, b: Any) -> Any:
    """``entry``'s array-API function of ``a`` and ``b`` on ``ctx.xp``."""
    return entry.fn(namespace(ctx), a, b)


@register
class CompareKernel(Kernel):
    """Comparisons of two float tensors of one type, giving bool."""

    op_types = tuple(name for name, e in BINARY_OPS.items() if e.on_device and e.to_bool and not e.logical)

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return (not _legacy_broadcast(layer) and all_typed(types, layer.inputs, FLOATS)
                and same_type(types, layer.inputs) and all_typed(types, layer.outputs, {np.dtype(np.bool_)}))

    def run(self, ctx: KernelContext, a: Any, b: Any) -> Any:
        return binary(ctx, BINARY_OPS[self.layer.op_type], a, b)


@register
class LogicKernel(Kernel):
    """And, Or, Xor, Not on bool tensors."""

    op_types = (tuple(name for name, e in BINARY_OPS.items() if e.on_device and e.logical)
                + tuple(name for name, e in UNARY_OPS.items() if e.on_device and e.bool_input))
    dtypes = frozenset({np.dtype(np.bool_)})

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return not _legacy_broadcast(layer) and super().accepts(layer, op, types, host)

    def run(self, ctx: KernelContext, *xs: Any) -> Any:
        if self.layer.op_type in UNARY_OPS:
            return compute(ctx, UNARY_OPS[self.layer.op_type], xs[0], self.op)
        return binary(ctx, BINARY_OPS[self.layer.op_type], *xs)


@register
class VariadicKernel(Kernel):
    """Sum, Mean, Max, Min of any number of same-typed float inputs, with broadcasting: the
    binary table's function folded over them."""

    op_types = tuple(name for name, e in BINARY_OPS.items() if e.on_device and e.variadic)
    takes_activations = True

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return super().accepts(layer, op, types, host) and same_type(types, layer.inputs)

    def run(self, ctx: KernelContext, *xs: Any, activations: Sequence = ()) -> Any:
        entry = BINARY_OPS[self.layer.op_type]
        if self.layer.op_type == "Sum" and len(xs) >= 2:  # the last addition shares a kernel with the activations
            head = functools.reduce(functools.partial(binary, ctx, entry), xs[:-1]) if len(xs) > 2 else xs[0]
            return add_and_activate(ctx, head, xs[-1], activations, inplace=False)
        fold = functools.partial(binary, ctx, entry)
        out = functools.reduce(fold, xs) if len(xs) > 1 else xs[0].copy()  # one input: still a fresh buffer
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
