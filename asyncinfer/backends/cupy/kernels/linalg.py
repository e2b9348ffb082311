"""MatMul and Gemm: one ``xp.matmul`` each, which CuPy runs through cuBLAS (batched GEMM for
stacked operands); transposes are views that cuBLAS reads with its transpose flags."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ....model.ir import Layer
from ....ops.base import Op
from ...base import ValueTypes
from .activations import add_and_activate
from .base import Kernel, KernelContext, register, same_type, scalar


@register
class MatMulKernel(Kernel):
    """NumPy ``matmul`` semantics (1-D operands promoted, leading dims broadcast)."""

    op_types = ("MatMul",)

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return super().accepts(layer, op, types, host) and same_type(types, layer.inputs)

    def run(self, ctx: KernelContext, a: Any, b: Any) -> Any:
        return ctx.xp.matmul(a, b)


@register
class GemmKernel(Kernel):
    """``alpha * A' @ B' + beta * C`` with optional transposes and a broadcast, optional C."""

    op_types = ("Gemm",)
    takes_activations = True

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return super().accepts(layer, op, types, host) and same_type(types, layer.inputs)

    def run(self, ctx: KernelContext, a: Any, b: Any, c: Any = None, *, activations: Sequence = ()) -> Any:
        if int(self.op.attr("transA")):
            a = a.T
        if int(self.op.attr("transB")):
            b = b.T
        alpha, beta = float(self.op.attr("alpha")), float(self.op.attr("beta"))
        y = ctx.xp.matmul(a, b)  # a fresh buffer: scaled and biased in place (C broadcasts to Y)
        if alpha != 1.0:
            y *= scalar(y, alpha)
        if c is None or beta == 0.0:
            c = None
        elif beta != 1.0:
            c = scalar(y, beta) * c
        return add_and_activate(ctx, y, c, activations, inplace=True)
