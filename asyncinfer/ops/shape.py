"""Shape-manipulation and tensor-creation ops: Reshape, Slice, Pad, Concat, Split, Constant…

Most of these only move data around, so they return views of their input where NumPy allows it.
The small helpers at the top (axis normalisation, reading integer lists from value inputs,
"attribute in old opsets, input in new ones") are shared with `.indexing`.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..dtypes import onnx_to_numpy
from ..errors import ExecutionError
from .base import Op
from .cache_append import concat_growing
from .registry import register

Array = np.ndarray
MaybeArray = Optional[np.ndarray]  # an omitted optional input is None


# -- shared helpers -------------------------------------------------------------------------------
def op_error(op: Op, message: str) -> ExecutionError:
    """An ExecutionError naming the op and layer, for invalid values only known at run time."""
    return ExecutionError(f"{op.op_type} ({op.layer.describe()}): {message}",
                          layer=op.layer.name, op_type=op.op_type)


def normalize_axis(op: Op, axis: int, rank: int) -> int:
    """``axis`` in ``[0, rank)``, accepting negative axes; raises an error naming ``op`` otherwise."""
    axis = int(axis)
    if not -rank <= axis < rank:
        raise op_error(op, f"axis {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def normalize_axes(op: Op, axes: Sequence[int], rank: int) -> list[int]:
    """Every axis of ``axes`` normalised by `normalize_axis`; duplicates are an error."""
    result = [normalize_axis(op, a, rank) for a in axes]
    if len(set(result)) != len(result):
        raise op_error(op, f"repeated axis in {list(axes)}")
    return result


def int_list(value: Any) -> list[int]:
    """A 1-D (or scalar) integer tensor or a list as a list of Python ints."""
    array = np.asarray(value).reshape(-1)
    if array.dtype.kind in "iu":  # (a reshape target, split sizes: every shape op, every run)
        return array.tolist()
    return [int(v) for v in array]


def scalar_input(value: MaybeArray, default: Any = None, kind: type = int) -> Any:
    """The single value of a scalar (or 1-element) input as ``kind``; ``default`` when omitted or empty."""
    if value is None or np.size(value) == 0:
        return default
    return kind(np.asarray(value).reshape(-1)[0])


def input_or_attr(op: Op, value: np.ndarray | None, name: str, since: int) -> list[int] | None:
    """An int list given as an input from opset ``since`` on, as attribute ``name`` before it."""
    if op.version >= since:
        return None if value is None else int_list(value)
    attr = op.attr(name, None)
    return None if attr is None else int_list(attr)


def check_mode(op: Op, name: str, default: str, allowed: Sequence[str]) -> None:
    """Refuse string attribute ``name`` when its value is not one of ``allowed``."""
    value = op.attr(name, default)
    if value not in allowed:
        op.unsupported(f"attribute {name}={value!r}")


# -- shape queries --------------------------------------------------------------------------------
@register("Shape", versions=(1, 13, 15, 19, 21, 23, 24, 25))
class Shape(Op):
    metadata_inputs = (0,)

    def run(self, data: Array) -> Array:
        # Python slicing clamps start/end exactly as the spec asks (versions before 15 have neither).
        start, end = self.attr("start", 0), self.attr("end", None)
        return np.array(np.shape(data)[start:end], dtype=np.int64)


@register("Size", versions=(1, 13, 19, 21, 23, 24, 25))
class Size(Op):
    metadata_inputs = (0,)

    def run(self, data: Array) -> Array:
        return np.array(np.size(data), dtype=np.int64)


def bound_by_shape(op: Op, plan_of: Callable[[tuple[int, ...]], Any],
                   apply: Callable[[np.ndarray, Any], np.ndarray]) -> Callable[[list], list]:
    """`Op.bound_run` of a shape op whose result is ``apply(data, plan_of(data.shape))`` once its
    other inputs are known: when each of them is the model's constant (or left out), the plan
    (a reshape target, a slice index) is worked out once per input shape and kept
    (`Op.per_shape`), not parsed from those inputs every run. A run whose operands are others
    (or whose data is no array), and any error, takes ``op.run``: its result, or its message."""
    names = op.layer.inputs
    bound = tuple((i, op.bound_constant(i)) for i in range(1, len(names)) if names[i])
    if any(value is None for _, value in bound):
        return Op.bound_run(op)
    run, per_shape = op.run, op.per_shape
    recent: tuple[Any, Any] = (None, None)  # the last shape and its plan: no lookup while it repeats

    def outputs(args: list) -> list:
        nonlocal recent
        data = args[0]
        if type(data) is not np.ndarray:
            return [run(*args)]
        for i, value in bound:
            if args[i] is not value:
                return [run(*args)]
        shape = data.shape
        try:
            known = recent  # (one read: another thread may replace it meanwhile, whole)
            if known[0] == shape:
                return [apply(data, known[1])]
            plan = per_shape(("bound", shape), lambda: plan_of(shape))
            recent = (shape, plan)
            return [apply(data, plan)]
        except Exception:  # noqa: BLE001 - `run` raises the op's own error for these operands
            return [run(*args)]

    return outputs


# -- reshaping ------------------------------------------------------------------------------------
@register("Reshape", versions=(1, 5, 13, 14, 19, 21, 23, 24, 25))
class Reshape(Op):
    value_inputs = (1,)

    def run(self, data: Array, shape: MaybeArray = None) -> Array:
        data = np.asarray(data)
        dims = input_or_attr(self, shape, "shape", since=5)
        if dims is None:
            raise op_error(self, "no target shape")
        return reshape_to(self, data, dims, bool(self.attr("allowzero", 0)))

    def bound_run(self) -> Callable[[list], list]:
        target = self.bound_constant(1)
        if self.version < 5 or target is None:
            return super().bound_run()
        dims, allowzero = int_list(target), bool(self.attr("allowzero", 0))
        return bound_by_shape(self, lambda shape: tuple(reshape_dims(shape, dims, allowzero)), _reshaped)


def reshape_to(op: Op, data: Array, dims: list[int], allowzero: bool) -> Array:
    """``data`` reshaped to ``dims`` as ONNX's Reshape does it: a 0 copies the input's dimension
    unless ``allowzero``, a -1 is inferred; a mismatch is an error naming ``op``'s layer."""
    dims = reshape_dims(data.shape, dims, allowzero)
    try:
        return data.reshape(dims)
    except ValueError as exc:
        raise op_error(op, f"cannot reshape {data.shape} into {dims}") from exc


def reshape_dims(shape: tuple[int, ...], dims: list[int], allowzero: bool) -> list[int]:
    """Reshape's target for an input of ``shape``: a 0 is the input's dimension unless ``allowzero``."""
    if allowzero:
        return dims
    return [shape[i] if d == 0 and i < len(shape) else d for i, d in enumerate(dims)]


@register("Flatten", versions=(1, 9, 11, 13, 21, 23, 24, 25))
class Flatten(Op):
    def run(self, data: Array) -> Array:
        data = np.asarray(data)
        axis = self.attr("axis")
        axis = axis + data.ndim if axis < 0 else axis  # the accepted range is [-rank, rank]
        if not 0 <= axis <= data.ndim:
            raise op_error(self, f"axis {self.attr('axis')} is out of range for rank {data.ndim}")
        return data.reshape(math.prod(data.shape[:axis]), math.prod(data.shape[axis:]))

    def bound_run(self) -> Callable[[list], list]:
        def plan_of(shape: tuple[int, ...]) -> tuple[int, int]:
            axis = self.attr("axis")
            axis = axis + len(shape) if axis < 0 else axis
            if not 0 <= axis <= len(shape):
                raise op_error(self, f"axis {self.attr('axis')} is out of range for rank {len(shape)}")
            return math.prod(shape[:axis]), math.prod(shape[axis:])
        return bound_by_shape(self, plan_of, _reshaped)


@register("Squeeze", versions=(1, 11, 13, 21, 23, 24, 25))
class Squeeze(Op):
    value_inputs = (1,)

    def run(self, data: Array, axes: MaybeArray = None) -> Array:
        data = np.asarray(data)
        return data.reshape(self.dims(data.shape, axes))

    def dims(self, shape: tuple[int, ...], axes: MaybeArray = None) -> list[int]:
        """The output shape for an input of ``shape``."""
        axes = input_or_attr(self, axes, "axes", since=13)
        if axes is None:
            return [d for d in shape if d != 1]
        axes = normalize_axes(self, axes, len(shape))
        if any(shape[a] != 1 for a in axes):
            raise op_error(self, f"cannot squeeze axes {axes} of shape {shape}: size is not 1")
        return [d for i, d in enumerate(shape) if i not in axes]

    def bound_run(self) -> Callable[[list], list]:
        axes = self.bound_constant(1)
        return bound_by_shape(self, lambda shape: tuple(self.dims(shape, axes)), _reshaped)


@register("Unsqueeze", versions=(1, 11, 13, 21, 23, 24, 25))
class Unsqueeze(Op):
    value_inputs = (1,)

    def run(self, data: Array, axes: MaybeArray = None) -> Array:
        data = np.asarray(data)
        return data.reshape(self.dims(data.shape, axes))

    def dims(self, shape: tuple[int, ...], axes: MaybeArray = None) -> list[int]:
        """The output shape for an input of ``shape``."""
        axes = input_or_attr(self, axes, "axes", since=13)
        if axes is None:
            raise op_error(self, "no axes")
        out_rank = len(shape) + len(axes)
        inserted = set(normalize_axes(self, axes, out_rank))
        dims = iter(shape)
        return [1 if i in inserted else next(dims) for i in range(out_rank)]

    def bound_run(self) -> Callable[[list], list]:
        axes = self.bound_constant(1)
        return bound_by_shape(self, lambda shape: tuple(self.dims(shape, axes)), _reshaped)


@register("Expand", versions=(8, 13))
class Expand(Op):
    value_inputs = (1,)

    def run(self, data: Array, shape: Array) -> Array:
        data = np.asarray(data)
        try:
            target = np.broadcast_shapes(data.shape, tuple(int_list(shape)))
        except ValueError as exc:
            raise op_error(self, f"cannot broadcast {data.shape} to {int_list(shape)}") from exc
        self.check_allocation(target)
        # A real copy: a read-only zero-stride view would surprise whoever gets it as an output.
        return np.broadcast_to(data, target).copy()


@register("Transpose", versions=(1, 13, 21, 23, 24, 25))
class Transpose(Op):
    def run(self, data: Array) -> Array:
        return transpose_by(self, np.asarray(data), self.attr("perm", None))

    def bound_run(self) -> Callable[[list], list]:
        def plan_of(shape: tuple[int, ...]) -> tuple[int, ...]:
            perm = self.attr("perm", None)
            if perm is None:
                return tuple(range(len(shape) - 1, -1, -1))
            transpose_by(self, np.empty((1,) * len(shape), np.uint8), perm)  # (checks it)
            return tuple(int(p) % len(shape) for p in perm)
        return bound_by_shape(self, plan_of, _transposed)


def transpose_by(op: Op, data: Array, perm: Sequence[int] | None) -> Array:
    """``data`` with its axes permuted as ONNX's Transpose does it (``perm`` None: reversed); a
    ``perm`` that is not a permutation of its axes is an error naming ``op``'s layer."""
    if perm is not None and sorted(normalize_axes(op, perm, data.ndim)) != list(range(data.ndim)):
        raise op_error(op, f"perm {perm} is not a permutation of rank {data.ndim}")
    return np.transpose(data, perm)


#: The most room a link of a chain of Concats leaves after its result, as a multiple of the
#: entries it holds (DenseNet-121's largest: 1.7, a dense block's first link).
MAX_ROOM_RATIO = 8


@register("Concat", versions=(1, 4, 11, 13))
class Concat(Op):
    def run(self, *inputs: MaybeArray) -> Array:
        arrays = [np.asarray(x) for x in inputs if x is not None]
        axis = normalize_axis(self, self.attr("axis", 1), arrays[0].ndim)
        if self.layer.appends_cache and len(arrays) > 1:  # a KV cache: see ops/cache_append.py
            return concat_growing(arrays, axis)
        room = self.layer.grow_room
        if room is not None and len(arrays) > 1 and math.prod(arrays[0].shape[:axis]) == 1:
            # a link of a chain of Concats (ops/cache_append.py); only where the results stay
            # contiguous (one entry before the axis): strided ones would cost every reader a copy.
            # The room comes from the model's shapes, which an untrusted file may overstate:
            # never more than `MAX_ROOM_RATIO` times what the link holds.
            filled = sum(a.shape[axis] if a.ndim > axis else 0 for a in arrays)
            return concat_growing(arrays, axis, min(room, MAX_ROOM_RATIO * filled))
        return np.concatenate(arrays, axis=axis)


@register("Split", versions=(1, 2, 11, 13, 18))
class Split(Op):
    value_inputs = (1,)

    def check(self) -> None:
        n = self.attr("num_outputs", None)
        if n is not None and n != len(self.layer.outputs):
            self.unsupported(f"num_outputs={n} with {len(self.layer.outputs)} outputs")

    def run(self, data: Array, split: MaybeArray = None) -> tuple[Array, ...]:
        # Sizes: an input from opset 13 on; an attribute before (Split-1 also took an input).
        sizes = int_list(split) if split is not None else None
        if sizes is None and self.version < 13 and "split" in self.attrs:
            sizes = int_list(self.attrs["split"])
        return split_views(self, np.asarray(data), self.attr("axis", 0), sizes, len(self.layer.outputs))


def split_views(op: Op, data: Array, axis: int, sizes: list[int] | None, n: int) -> tuple[Array, ...]:
    """``data`` split along ``axis`` into ``n`` parts of ``sizes`` (None: equal parts, the last
    one smaller when uneven, as opset 18 has it), as views: Split's arithmetic, shared with the
    fused ``SplitHeads``; errors name ``op``'s layer."""
    axis = normalize_axis(op, axis, data.ndim)
    dim = data.shape[axis]
    if sizes is None:
        chunk = -(-dim // n)
        sizes = [chunk] * (n - 1) + [dim - chunk * (n - 1)]
    if len(sizes) != n or sum(sizes) != dim or min(sizes) < 0:
        raise op_error(op, f"cannot split dimension {dim} into {n} parts of sizes {sizes}")
    return tuple(data[index] for index in op.per_shape((data.shape, axis, *sizes),
                                                       lambda: split_indices(data.ndim, axis, sizes)))


def split_indices(rank: int, axis: int, sizes: list[int]) -> list[tuple[slice, ...]]:
    """The index of each part of a Split (views, as ``np.split`` gives, without its overhead)."""
    indices, start = [], 0
    for size in sizes:
        indices.append((slice(None),) * axis + (slice(start, start + size),) + (slice(None),) * (rank - axis - 1))
        start += size
    return indices


@register("Slice", versions=(1, 10, 11, 13))
class Slice(Op):
    value_inputs = (1, 2, 3, 4)

    def check(self) -> None:
        if self.version < 10:  # Slice-1 took starts/ends/axes as attributes
            self.attr("starts"), self.attr("ends")

    def run(self, data: Array,
            starts: MaybeArray = None, ends: MaybeArray = None,
            axes: MaybeArray = None, steps: MaybeArray = None) -> Array:
        data = np.asarray(data)
        return data[self.index(data.shape, starts, ends, axes, steps)]

    def bound_run(self) -> Callable[[list], list]:
        if self.version < 10:
            return super().bound_run()
        operands = [self.bound_constant(i) for i in range(1, 5)]
        return bound_by_shape(self, lambda shape: self.index(shape, *operands), _take)

    def index(self, shape: tuple[int, ...], starts: MaybeArray = None, ends: MaybeArray = None,
              axes: MaybeArray = None, steps: MaybeArray = None) -> tuple[slice, ...]:
        """The Python slices, one per axis of ``shape``, that this Slice takes (device backends
        use it too, so every backend clamps and checks alike)."""
        if self.version < 10:
            starts, ends, axes = self.attr("starts"), self.attr("ends"), self.attr("axes", None)
        starts, ends = int_list(starts), int_list(ends)
        axes = list(range(len(starts))) if axes is None else int_list(axes)
        steps = [1] * len(starts) if steps is None else int_list(steps)
        if not len(starts) == len(ends) == len(axes) == len(steps):
            raise op_error(self, "starts, ends, axes and steps differ in length")
        index = [slice(None)] * len(shape)
        for axis, start, end, step in zip(normalize_axes(self, axes, len(shape)), starts, ends, steps):
            if step == 0:
                raise op_error(self, "step 0")
            index[axis] = _onnx_slice(start, end, step, shape[axis])
        return tuple(index)


def _take(data: Array, index: tuple[slice, ...]) -> Array:
    return data[index]


def _reshaped(data: Array, dims: tuple[int, ...]) -> Array:
    return data.reshape(dims)


def _transposed(data: Array, perm: tuple[int, ...]) -> Array:
    return data.transpose(perm)


def _onnx_slice(start: int, end: int, step: int, dim: int) -> slice:
    """A Python slice with ONNX's clamping (which differs from Python's for negative steps)."""
    start, end = (start + dim if start < 0 else start), (end + dim if end < 0 else end)
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)  # end -1 means "through index 0"


@register("Tile", versions=(1, 6, 13))
class Tile(Op):
    value_inputs = (1, 2)

    def run(self, data: Array, repeats: Array, axis: MaybeArray = None) -> Array:
        data = np.asarray(data)
        if self.version < 6:  # Tile-1: ``repeats`` copies along the single axis ``axis``
            reps = [1] * data.ndim
            reps[normalize_axis(self, int_list(axis)[0], data.ndim)] = int_list(repeats)[0]
        else:
            reps = int_list(repeats)
        if len(reps) != data.ndim or min(reps, default=0) < 0:
            raise op_error(self, f"repeats {reps} do not fit an input of rank {data.ndim}")
        self.check_allocation([s * r for s, r in zip(data.shape, reps)])
        return np.tile(data, reps)


_PAD_MODES = ("constant", "reflect", "edge", "wrap")  # the same names as numpy.pad's modes


@register("Pad", versions=(1, 2, 11, 13, 18, 19, 21, 23, 24, 25))
class Pad(Op):
    value_inputs = (1, 3)

    def check(self) -> None:
        check_mode(self, "mode", "constant", _PAD_MODES)
        if self.version < 11:  # pads were an attribute (named paddings in Pad-1)
            self.attr("paddings" if self.version < 2 else "pads")

    def run(self, data: Array,
            pads: MaybeArray = None, constant_value: MaybeArray = None,
            axes: MaybeArray = None) -> Array:
        return self.pad(np, np.asarray(data), pads, constant_value, axes)

    def pad(self, xp: Any, data: Any, pads: MaybeArray = None, constant_value: MaybeArray = None,
            axes: MaybeArray = None) -> Any:
        """Pad ``data`` with the array module ``xp`` (NumPy here, CuPy on gpu_compute); ``pads``,
        ``constant_value`` and ``axes`` are host values."""
        widths, constant_value = self.widths(data.ndim, pads, constant_value, axes)
        return self.padded(xp, data, widths, constant_value)

    def bound_run(self) -> Callable[[list], list]:
        if self.version < 11:
            return super().bound_run()
        operands = [self.bound_constant(i) for i in range(1, 4)]
        mode = self.attr("mode")

        def apply(data: Array, plan: PadPlan) -> Array:
            if plan.fill is _NUMPY_PAD:
                return np.pad(data[plan.crop], plan.widths, mode=mode)
            return _pad_by_plan(data, plan)
        return bound_by_shape(self, lambda shape: self.copy_plan(shape, *self.widths(len(shape), *operands)), apply)

    def padded(self, xp: Any, data: Any, widths: list[list[int]], constant_value: MaybeArray) -> Any:
        """``data`` padded by ``widths`` (`widths`: negative ones crop) with ``constant_value``."""
        plan = self.copy_plan(data.shape, widths, constant_value)
        if plan.fill is _NUMPY_PAD:  # wider than one reflection or wrap
            return xp.pad(data[plan.crop], plan.widths, mode=self.attr("mode"))
        return _pad_by_plan(data, plan, xp)

    def copy_plan(self, shape: tuple[int, ...], widths: list[list[int]], constant_value: MaybeArray) -> "PadPlan":
        """How an input of ``shape`` is padded: the crop of negative pads, the output, and the
        copies that fill the border (see `PadPlan`); errors name the layer."""
        # Negative pads crop: apply them first as a slice, then pad with the positive ones.
        crop = tuple(slice(max(-b, 0), shape[i] - max(-e, 0)) for i, (b, e) in enumerate(widths))
        inner = tuple(len(range(*c.indices(n))) for c, n in zip(crop, shape))
        widths = [(max(b, 0), max(e, 0)) for b, e in widths]
        out = tuple(s + b + e for s, (b, e) in zip(inner, widths))
        self.check_allocation(out)
        centre = tuple(slice(b, b + s) for s, (b, _) in zip(inner, widths))
        mode = self.attr("mode")
        if mode == "constant":
            fill = None if constant_value is None else np.asarray(constant_value).reshape(-1)[0]
            return PadPlan(crop, widths, out, centre, fill, None)
        if any((b or e) and inner[i] == 0 for i, (b, e) in enumerate(widths)):
            raise op_error(self, f"mode {mode!r} cannot pad an empty axis")
        copies = _border_copies(inner, widths, mode)
        return PadPlan(crop, widths, out, centre, _NUMPY_PAD if copies is None else None, copies)

    def widths(self, rank: int, pads: MaybeArray = None, constant_value: MaybeArray = None,
               axes: MaybeArray = None) -> tuple[list[list[int]], MaybeArray]:
        """``[before, after]`` per axis (negative values crop) and the constant value (None when
        not given), from the inputs or the attributes of older opsets. Device backends use it too,
        so every backend reads and checks pads alike."""
        if self.version < 11:
            pads = self.attr("paddings" if self.version < 2 else "pads")
            constant_value = self.attr("value", 0.0)
        pads = int_list(pads)
        axes = list(range(rank)) if axes is None else normalize_axes(self, int_list(axes), rank)
        if len(pads) != 2 * len(axes):
            raise op_error(self, f"{len(pads)} pads for {len(axes)} axes")
        widths = [[0, 0] for _ in range(rank)]
        for i, axis in enumerate(axes):
            widths[axis] = [pads[i], pads[i + len(axes)]]
        if constant_value is not None and np.size(constant_value) == 0:
            constant_value = None
        return widths, constant_value


#: `PadPlan.fill` of a reflect or wrap pad wider than its axis allows once: `numpy.pad` repeats it.
_NUMPY_PAD = object()


@dataclass(frozen=True)
class PadPlan:
    """`Pad.copy_plan`: ``crop`` (the slice negative pads take), ``widths`` (the positive pads),
    the ``out`` shape, where the data goes in it (``centre``), and either ``fill`` (constant mode:
    the value, None for the dtype's zero) or ``copies``: ``(to, from)`` index pairs within the
    output, in order, that make a reflect, edge or wrap border out of the centre."""

    crop: tuple[slice, ...]
    widths: list[tuple[int, int]]
    out: tuple[int, ...]
    centre: tuple[slice, ...]
    fill: Any
    copies: list[tuple[tuple[slice, ...], tuple[slice, ...]]] | None


def _border_copies(inner: tuple[int, ...], widths: list[tuple[int, int]],
                   mode: str) -> list[tuple[tuple[slice, ...], tuple[slice, ...]]] | None:
    """The copies within the output that pad a centre of shape ``inner`` by ``widths`` in
    ``mode`` (``reflect``, ``edge``, ``wrap``) as `numpy.pad` does, or None where a pad is wider
    than its axis allows one reflection or wrap (`numpy.pad` repeats those). ``numpy.pad`` gets
    there through dozens of Python-level calls: 13 µs on a 512-sample audio frame; these few
    slice copies, worked out once per input shape (`Pad.bound_run`), take 2. Axis by axis, each
    pad copies from the centre of its axis, whose other axes are already complete (earlier axes)
    or will be completed after."""
    limit = {"reflect": 1, "edge": 0, "wrap": 0}[mode]
    if any(max(b, e) > inner[i] - limit for i, (b, e) in enumerate(widths) if b or e):
        return None
    copies = []
    for axis, (b, e) in enumerate(widths):
        if not (b or e):
            continue
        n, lead = inner[axis], (slice(None),) * axis  # slices of this axis, whole others
        front, back = (*lead, slice(0, b)), (*lead, slice(b + n, None))
        if mode == "reflect":  # mirrored about the edge values, which are not repeated
            stop = b + n - 2 - e
            sources = slice(2 * b, b, -1), slice(b + n - 2, stop if stop >= 0 else None, -1)
        elif mode == "edge":
            sources = slice(b, b + 1), slice(b + n - 1, b + n)
        else:  # wrap
            sources = slice(n, b + n), slice(b, b + e)
        copies += [(front, (*lead, sources[0])), (back, (*lead, sources[1]))]
    return copies


def _pad_by_plan(data: Any, plan: PadPlan, xp: Any = np) -> Any:
    """``data`` padded as `Pad.copy_plan` worked out (not for `_NUMPY_PAD` plans)."""
    data = data[plan.crop]
    if plan.copies is None:
        fill = ("" if data.dtype == object else 0) if plan.fill is None else plan.fill
        out = xp.full(plan.out, fill, dtype=data.dtype)
        out[plan.centre] = data
        return out
    out = xp.empty(plan.out, dtype=data.dtype)
    out[plan.centre] = data
    for to, source in plan.copies:
        out[to] = out[source]
    return out


# -- tensor creation ------------------------------------------------------------------------------
@register("ConstantOfShape", versions=(9, 20, 21, 23, 24, 25))
class ConstantOfShape(Op):
    value_inputs = (0,)

    def run(self, shape: Array) -> Array:
        value = self.attr("value", None)
        value = np.zeros(1, np.float32) if value is None else np.asarray(value)
        dims = int_list(shape)
        if any(d < 0 for d in dims):
            raise op_error(self, f"negative dimension in shape {dims}")
        self.check_allocation(dims)
        return np.full(dims, value.reshape(-1)[0], dtype=value.dtype)


_CONSTANT_ATTRS = {  # attribute → how to turn its Python value into the output tensor
    "value": np.asarray,
    "sparse_value": np.asarray,  # already densified by the model loader
    "value_float": lambda v: np.array(v, np.float32),
    "value_floats": lambda v: np.array(v, np.float32),
    "value_int": lambda v: np.array(v, np.int64),
    "value_ints": lambda v: np.array(v, np.int64),
    "value_string": lambda v: np.array(v, object),
    "value_strings": lambda v: np.array(v, object),
}


@register("Constant", versions=(1, 9, 11, 12, 13, 19, 21, 23, 24, 25))
class Constant(Op):
    def check(self) -> None:
        given = [name for name in _CONSTANT_ATTRS if name in self.attrs]
        if len(given) != 1:
            self.unsupported(f"attributes {given or 'none'} (exactly one value attribute is needed)")
        # Built once at worker creation; ``run`` hands out this same (never mutated) array.
        self._value = _CONSTANT_ATTRS[given[0]](self.attrs[given[0]])

    def run(self) -> Array:
        return self._value


@register("Range", versions=(11, 27))
class Range(Op):
    value_inputs = (0, 1, 2)

    def run(self, start: Array, limit: Array, delta: Array) -> Array:
        start, limit, delta = (np.asarray(v).reshape(-1)[0] for v in (start, limit, delta))
        dtype = np.result_type(start)
        if dtype.kind in "iu":
            if int(delta) == 0:
                raise op_error(self, "delta is 0: the range would never end")
            count = -((int(start) - int(limit)) // int(delta))  # exact ceil division
            self.check_allocation([max(count, 0)])
            return (np.arange(max(count, 0), dtype=np.int64) * int(delta) + int(start)).astype(dtype)
        # float16/bfloat16 are computed in the stash type (float32 by default) and cast back.
        work = dtype if dtype.itemsize > 2 else onnx_to_numpy(self.attr("stash_type", 1))
        span = (float(limit) - float(start)) / float(delta) if float(delta) else math.nan
        if not math.isfinite(span):
            raise op_error(self, f"range({start}, {limit}, {delta}) has no finite length")
        count = math.ceil(span)
        self.check_allocation([max(count, 0)])
        steps = np.arange(max(count, 0), dtype=work)
        return (steps * work.type(delta) + work.type(start)).astype(dtype)


@register("Dropout", versions=(1, 6, 7, 10, 12, 13, 22))
class Dropout(Op):
    """Dropout: the identity in inference mode (with an all-true mask when the mask is asked for);
    from opset 12, a true ``training_mode`` input with a non-zero ``ratio`` drops elements at random.

    Training mode follows the definition of onnx.reference: ``mask = uniform(0, 1, shape) >= ratio``
    and ``y = x * mask / (1 - ratio)``. With a ``seed`` attribute the uniform draw is NumPy's
    ``RandomState(seed)`` (the legacy Mersenne Twister, the seed's low 32 bits), so a run is
    reproducible and equals onnx.reference's; without one, each run draws fresh values from OS
    entropy. Opsets 1 and 6 (``is_test``) are run in inference mode only: ``is_test=0`` with a
    non-zero ratio is refused (the optimizer removes such a layer when its mask is not used, as an
    inference engine does)."""

    deterministic = False  # training mode draws at random: never constant-folded

    def check(self) -> None:
        if self.version < 7 and not self.attr("is_test", 0) and self.attr("ratio", 0.5) != 0:
            self.unsupported("training mode (is_test=0)")

    @property
    def may_train(self) -> bool:
        """True when a run may be in training mode (a ``training_mode`` input is given): a device
        kernel, which only copies its input, must leave such a layer to this op."""
        return self.version >= 12 and len(self.layer.inputs) > 2 and bool(self.layer.inputs[2])

    def run(self, data: Array,
            ratio: MaybeArray = None,
            training_mode: MaybeArray = None) -> Array | tuple[Array, Array]:
        data = np.asarray(data)
        want_mask = len(self.layer.outputs) > 1 and bool(self.layer.outputs[1])
        if training_mode is not None and self._scalar(training_mode, "training_mode", bool):
            rate = 0.5 if ratio is None else self._scalar(ratio, "ratio", float)
            if rate != 0.0:
                return self._train(data, rate, want_mask)
        if not want_mask:
            return data
        return data, np.ones(data.shape, dtype=bool if self.version >= 10 else data.dtype)

    def _scalar(self, value: Array, what: str, kind: type) -> Any:
        if np.size(value) != 1:
            raise op_error(self, f"{what} must be a scalar, got shape {np.shape(value)}")
        return kind(np.asarray(value).reshape(-1)[0])

    def _train(self, data: Array, rate: float, want_mask: bool) -> Array | tuple[Array, Array]:
        if not 0.0 <= rate < 1.0:
            raise op_error(self, f"ratio {rate} is outside [0, 1)")
        seed = self.attr("seed", None)
        # The legacy generator with a seed (onnx.reference's draw); fresh OS entropy without one.
        draw = (np.random.RandomState(int(seed) & 0xFFFFFFFF).uniform(0.0, 1.0, data.shape) if seed is not None
                else np.random.default_rng().uniform(0.0, 1.0, data.shape))
        mask = draw >= rate
        work = data.dtype if data.dtype in (np.float32, np.float64) else np.dtype(np.float32)
        scale = work.type(1.0) / (work.type(1.0) - work.type(rate))
        y = np.where(mask, data.astype(work, copy=False) * scale, work.type(0)).astype(data.dtype, copy=False)
        return (y, mask) if want_mask else y


# -- block rearrangements and matrices ------------------------------------------------------------
class _BlockOp(Op):
    """Shared checks of DepthToSpace and SpaceToDepth (``mode`` DCR or CRD, 4-D input)."""

    def check(self) -> None:
        check_mode(self, "mode", "DCR", ("DCR", "CRD"))
        if self.attr("blocksize") < 1:
            self.unsupported(f"blocksize={self.attr('blocksize')}")

    def _shape(self, data: np.ndarray) -> tuple[int, int, int, int, int]:
        if data.ndim != 4:
            raise op_error(self, f"expects a 4-D input, got shape {data.shape}")
        return (*data.shape, self.attr("blocksize"))


@register("DepthToSpace", versions=(1, 11, 13, 28))
class DepthToSpace(_BlockOp):
    def run(self, data: Array) -> Array:
        data = np.asarray(data)
        n, c, h, w, bs = self._shape(data)
        if c % (bs * bs):
            raise op_error(self, f"channels {c} not divisible by blocksize² {bs * bs}")
        if self.attr("mode", "DCR") == "DCR":
            tmp = data.reshape(n, bs, bs, c // (bs * bs), h, w).transpose(0, 3, 4, 1, 5, 2)
        else:
            tmp = data.reshape(n, c // (bs * bs), bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
        return tmp.reshape(n, c // (bs * bs), h * bs, w * bs)


@register("SpaceToDepth", versions=(1, 13, 28))
class SpaceToDepth(_BlockOp):
    def run(self, data: Array) -> Array:
        data = np.asarray(data)
        n, c, h, w, bs = self._shape(data)
        if h % bs or w % bs:
            raise op_error(self, f"spatial size {h}x{w} not divisible by blocksize {bs}")
        tmp = data.reshape(n, c, h // bs, bs, w // bs, bs)
        perm = (0, 3, 5, 1, 2, 4) if self.attr("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
        return tmp.transpose(perm).reshape(n, c * bs * bs, h // bs, w // bs)


@register("EyeLike", versions=(9, 22))
class EyeLike(Op):
    def run(self, data: Array) -> Array:
        shape = np.shape(data)
        if len(shape) != 2:
            raise op_error(self, f"expects a 2-D input, got shape {shape}")
        dtype = onnx_to_numpy(self.attrs["dtype"]) if "dtype" in self.attrs else np.asarray(data).dtype
        return np.eye(shape[0], shape[1], k=self.attr("k"), dtype=dtype)


@register("Trilu", versions=(14,))
class Trilu(Op):
    def run(self, data: Array, k: MaybeArray = None) -> Array:
        data = np.asarray(data)
        k = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
        return np.triu(data, k) if self.attr("upper") else np.tril(data, k)


@register("OneHot", versions=(9, 11, 28))
class OneHot(Op):
    value_inputs = (1,)

    def run(self, indices: Array, depth: Array, values: Array) -> Array:
        indices = np.asarray(indices)
        depth = int(np.asarray(depth).reshape(-1)[0])
        off, on = np.asarray(values).reshape(-1)[:2]
        axis = normalize_axis(self, self.attr("axis"), indices.ndim + 1)
        if depth < 0:
            raise op_error(self, f"depth {depth} is negative")
        self.check_allocation([*indices.shape[:axis], depth, *indices.shape[axis:]])
        idx = indices.astype(np.int64)
        if self.version >= 11:  # negative indices count from the back since opset 11
            idx = np.where(idx < 0, idx + depth, idx)
        hot = np.expand_dims(idx, axis) == np.arange(depth).reshape([-1] + [1] * (indices.ndim - axis))
        return np.where(hot, on, off)
