"""Data-movement kernels: Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Concat, Split, Slice,
Gather, Expand, Tile, Pad, DepthToSpace, SpaceToDepth, Identity and inference Dropout.

Shape-like inputs (Reshape's shape, Slice's starts...) are read on the host, where the CPU op's
own helpers interpret them, so both backends accept and refuse the same values. Reshapes and
slices return views of their input (device memory is never written in place by a kernel, so a
view is as good as a copy); Transpose makes its result contiguous, as the next GEMM wants it.
Movement kernels carry any plain element type (bool, int32, int64, float16, float32).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ....model.ir import Layer
from ....ops.base import Op
from ....ops.indexing import normalize_indices
from ....ops.shape import input_or_attr, int_list, normalize_axes, normalize_axis, op_error
from ...base import ValueTypes
from .base import PLAIN, Kernel, KernelContext, all_typed, register


class _Movement(Kernel):
    dtypes = PLAIN
    fresh_output = False  # outputs may be views of the input: never overwritten in place


@register
class ReshapeKernel(_Movement):
    op_types = ("Reshape",)

    def run(self, ctx: KernelContext, x: Any, shape: Any = None) -> Any:
        dims = input_or_attr(self.op, shape, "shape", since=5)
        if dims is None:
            raise op_error(self.op, "no target shape")
        if not self.op.attr("allowzero", 0):  # 0 copies the input dimension
            dims = [x.shape[i] if d == 0 and i < x.ndim else d for i, d in enumerate(dims)]
        try:
            return x.reshape(dims)
        except ValueError as exc:
            raise op_error(self.op, f"cannot reshape {tuple(x.shape)} into {dims}") from exc


@register
class FlattenKernel(_Movement):
    op_types = ("Flatten",)

    def run(self, ctx: KernelContext, x: Any) -> Any:
        axis = int(self.op.attr("axis"))
        axis = axis + x.ndim if axis < 0 else axis
        if not 0 <= axis <= x.ndim:
            raise op_error(self.op, f"axis {self.op.attr('axis')} is out of range for rank {x.ndim}")
        return x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))


@register
class SqueezeKernel(_Movement):
    op_types = ("Squeeze", "Unsqueeze")

    def run(self, ctx: KernelContext, x: Any, axes: Any = None) -> Any:
        axes = input_or_attr(self.op, axes, "axes", since=13)
        if self.layer.op_type == "Squeeze":
            if axes is None:
                return x.reshape([d for d in x.shape if d != 1])
            axes = normalize_axes(self.op, axes, x.ndim)
            if any(x.shape[a] != 1 for a in axes):
                raise op_error(self.op, f"cannot squeeze axes {axes} of shape {tuple(x.shape)}: size is not 1")
            return x.reshape([d for i, d in enumerate(x.shape) if i not in axes])
        if axes is None:
            raise op_error(self.op, "no axes")
        out_rank = x.ndim + len(axes)
        inserted = set(normalize_axes(self.op, axes, out_rank))
        dims = iter(x.shape)
        return x.reshape([1 if i in inserted else next(dims) for i in range(out_rank)])


@register
class TransposeKernel(_Movement):
    op_types = ("Transpose",)
    fresh_output = True

    def run(self, ctx: KernelContext, x: Any) -> Any:
        perm = self.op.attr("perm", None)
        if perm is not None and sorted(normalize_axes(self.op, perm, x.ndim)) != list(range(x.ndim)):
            raise op_error(self.op, f"perm {perm} is not a permutation of rank {x.ndim}")
        return ctx.xp.ascontiguousarray(ctx.xp.transpose(x, None if perm is None else [int(p) for p in perm]))


@register
class ConcatKernel(_Movement):
    op_types = ("Concat",)
    fresh_output = True

    def run(self, ctx: KernelContext, *xs: Any) -> Any:
        arrays = [x for x in xs if x is not None]
        axis = normalize_axis(self.op, self.op.attr("axis", 1), arrays[0].ndim)
        return ctx.xp.concatenate(arrays, axis=axis)


@register
class SplitKernel(_Movement):
    op_types = ("Split",)

    def run(self, ctx: KernelContext, x: Any, split: Any = None) -> tuple:
        axis = normalize_axis(self.op, self.op.attr("axis", 0), x.ndim)
        dim = x.shape[axis]
        sizes = int_list(split) if split is not None else None
        if sizes is None and self.op.version < 13 and "split" in self.op.attrs:
            sizes = int_list(self.op.attrs["split"])
        n = len(self.layer.outputs)
        if sizes is None:  # equal parts, the last one smaller when uneven (opset 18)
            chunk = -(-dim // n)
            sizes = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
        if len(sizes) != n or sum(sizes) != dim or min(sizes) < 0:
            raise op_error(self.op, f"cannot split dimension {dim} into {n} parts of sizes {sizes}")
        bounds = np.cumsum([0] + sizes)
        lead = (slice(None),) * axis
        return tuple(x[lead + (slice(int(a), int(b)),)] for a, b in zip(bounds[:-1], bounds[1:]))


@register
class SliceKernel(_Movement):
    op_types = ("Slice",)

    def run(self, ctx: KernelContext, x: Any, starts: Any = None, ends: Any = None, axes: Any = None,
            steps: Any = None) -> Any:
        return x[self.op.index(tuple(x.shape), starts, ends, axes, steps)]


@register
class GatherKernel(_Movement):
    """Gather along ``axis``. The indices are read on the host (a model input or a constant, in
    practice), range-checked there exactly like the CPU op, then copied to the device; the copy of
    a constant index array is made once."""

    op_types = ("Gather",)
    host_inputs = frozenset({1})

    def __init__(self, layer: Layer, op: Op):
        super().__init__(layer, op)
        self._cached: tuple[Any, Any] | None = None  # (host indices, their device copy)

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        index_types = {np.dtype(np.int32), np.dtype(np.int64)}
        return (super().accepts(layer, op, types, host)
                and types.get(layer.inputs[1]) is not None and np.dtype(types[layer.inputs[1]]) in index_types)

    def run(self, ctx: KernelContext, x: Any, indices: Any) -> Any:
        axis = normalize_axis(self.op, self.op.attr("axis"), x.ndim)
        if self._cached is not None and self._cached[0] is indices:
            device_idx = self._cached[1]
        else:
            idx = normalize_indices(self.op, indices, x.shape[axis])
            if idx.ndim == 0:  # a single index: a view, nothing to copy
                return x[(slice(None),) * axis + (int(idx),)]
            device_idx = ctx.to_device(np.ascontiguousarray(idx))
            self._cached = (indices, device_idx)
        return ctx.xp.take(x, device_idx, axis=axis)


@register
class ExpandKernel(_Movement):
    op_types = ("Expand",)
    fresh_output = True

    def run(self, ctx: KernelContext, x: Any, shape: Any) -> Any:
        try:
            target = np.broadcast_shapes(tuple(x.shape), tuple(int_list(shape)))
        except ValueError as exc:
            raise op_error(self.op, f"cannot broadcast {tuple(x.shape)} to {int_list(shape)}") from exc
        return ctx.xp.ascontiguousarray(ctx.xp.broadcast_to(x, target))


@register
class TileKernel(_Movement):
    op_types = ("Tile",)
    fresh_output = True

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return layer.version >= 6 and super().accepts(layer, op, types, host)

    def run(self, ctx: KernelContext, x: Any, repeats: Any) -> Any:
        reps = int_list(repeats)
        if len(reps) != x.ndim or min(reps, default=0) < 0:
            raise op_error(self.op, f"repeats {reps} do not fit an input of rank {x.ndim}")
        return ctx.xp.tile(x, reps)


_PAD_MODES = ("constant", "reflect", "edge")


@register
class PadKernel(_Movement):
    """Pad in constant, reflect or edge mode (negative pads crop); the pads, the constant value
    and the axes are read on the host."""

    op_types = ("Pad",)
    host_inputs = frozenset({2})
    fresh_output = True

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        return op.attr("mode") in _PAD_MODES and super().accepts(layer, op, types, host)

    def run(self, ctx: KernelContext, x: Any, pads: Any = None, constant_value: Any = None, axes: Any = None) -> Any:
        return self.op.pad(ctx.xp, x, pads, constant_value, axes)  # the CPU op's array-API Pad


@register
class BlockKernel(_Movement):
    """DepthToSpace and SpaceToDepth (DCR or CRD) on 4-D tensors."""

    op_types = ("DepthToSpace", "SpaceToDepth")
    fresh_output = True

    def run(self, ctx: KernelContext, x: Any) -> Any:
        if x.ndim != 4:
            raise op_error(self.op, f"expects a 4-D input, got shape {tuple(x.shape)}")
        n, c, h, w = x.shape
        bs = int(self.op.attr("blocksize"))
        dcr = self.op.attr("mode", "DCR") == "DCR"
        xp = ctx.xp
        if self.layer.op_type == "DepthToSpace":
            if c % (bs * bs):
                raise op_error(self.op, f"channels {c} not divisible by blocksize² {bs * bs}")
            if dcr:
                tmp = x.reshape(n, bs, bs, c // (bs * bs), h, w).transpose(0, 3, 4, 1, 5, 2)
            else:
                tmp = x.reshape(n, c // (bs * bs), bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
            return xp.ascontiguousarray(tmp).reshape(n, c // (bs * bs), h * bs, w * bs)
        if h % bs or w % bs:
            raise op_error(self.op, f"spatial size {h}x{w} not divisible by blocksize {bs}")
        tmp = x.reshape(n, c, h // bs, bs, w // bs, bs)
        perm = (0, 3, 5, 1, 2, 4) if dcr else (0, 1, 3, 5, 2, 4)
        return xp.ascontiguousarray(tmp.transpose(perm)).reshape(n, c * bs * bs, h // bs, w // bs)


@register
class IdentityKernel(_Movement):
    op_types = ("Identity",)

    def run(self, ctx: KernelContext, x: Any) -> Any:
        return x


@register
class DropoutKernel(_Movement):
    """Inference-mode Dropout: the identity, with an all-true mask when the mask is asked for.
    A layer that may run in training mode (the CPU op's ``may_train``: a ``training_mode`` input,
    true or not at run time) stays on the CPU, which draws the random mask."""

    op_types = ("Dropout",)

    @classmethod
    def accepts(cls, layer: Layer, op: Op, types: ValueTypes, host: frozenset[int]) -> bool:
        data = [layer.inputs[0], layer.outputs[0]]
        return not op.may_train and all_typed(types, data, PLAIN)  # type: ignore[attr-defined]

    def run(self, ctx: KernelContext, x: Any, *unused: Any) -> Any:
        if len(self.layer.outputs) < 2 or not self.layer.outputs[1]:
            return x
        return x, ctx.xp.ones(x.shape, dtype=bool if self.op.version >= 10 else x.dtype)
