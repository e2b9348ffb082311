"""Reductions (ReduceSum ... ReduceSumSquare) and ArgMax/ArgMin: the CPU ops' own array-API code
(``asyncinfer.ops.reduce``), run with CuPy. The axes are an attribute in older opsets and a host
input (a CPU ``value_input``) in newer ones, exactly as the CPU op declares; float16 accumulates
in float32."""
from __future__ import annotations

from typing import Any

import numpy as np

from ....model.ir import Layer
from ....ops.base import Op
from ....ops.reduce import REDUCTIONS
from ...base import ValueTypes
from .base import FLOATS, Kernel, KernelContext, all_typed, register


@register
class ReduceKernel(Kernel):
    """Every Reduce* op on float tensors: the CPU op's array-API reduction, run on the device."""

    op_types = tuple(REDUCTIONS)

    def run(self, ctx: KernelContext, x: Any, axes_input: Any = None) -> Any:
        return self.op.reduce(ctx.xp, x, axes_input)


@register
class ArgReduceKernel(Kernel):
    """ArgMax/ArgMin of a float tensor: the CPU op's array-API index, run on the device (int64)."""

    op_types = ("ArgMax", "ArgMin")

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return all_typed(types, layer.inputs, FLOATS) and all_typed(types, layer.outputs, {np.dtype(np.int64)})

    def run(self, ctx: KernelContext, x: Any) -> Any:
        return self.op.arg_reduce(ctx.xp, x)
