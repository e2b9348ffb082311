"""Data movement and shape kernels: free reshapes, and copies that read each output element
from one input element.

Reshape, Flatten, Squeeze, Unsqueeze, Identity and the Casts that keep every value are *views*:
a layout addresses elements by flat index (layout.py), so they hand back the same texels under
another shape and issue no draw.

Every other op here (Transpose, Concat, Slice, Split, Gather, GatherElements, Expand, Tile, Pad,
DepthToSpace, SpaceToDepth) is one `Copy`: for each input it reads, a `Source`
says how each input axis's coordinate follows from the output coordinates ``c0, c1…``
(`Term`) and on which output ranges that input is read; elements no source covers get the
fill value (Pad's constant). `draw_copy` turns it into one of two shaders:

- ``texel`` mode, when the output's blocked axis follows each input's blocked axis with an
  offset multiple of 4: the four lanes of an output texel are then four lanes of one input
  texel, in order, so whole texels are copied (channel concats of NCHW maps whose channel
  counts are multiples of 4, spatial Slice/Pad/Transpose, embedding Gathers…);
- ``value`` mode otherwise, one element at a time through ``X_at``.

Integers and booleans are stored exactly as floats, so these kernels move them unchanged and
keep the input's dtype on the output.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

# ``_onnx_slice`` is the CPU op's own clamping rule: sharing it keeps both backends identical.
from ....ops.indexing import normalize_indices
from ....ops.shape import int_list, normalize_axes, normalize_axis, op_error
from ..layout import axis_layout, natural_layout
from .base import BOOL, FLOAT32, INDEX_TYPES, PixelKernel, coordinate, glsl_float, pixel_kernel, strides

if TYPE_CHECKING:
    from ..device import PixelDevice
    from ..storage import PixelTensor

#: Element types these kernels move (stored exactly in float texels).
DATA_TYPES = (FLOAT32, BOOL, *INDEX_TYPES)


# -- the copy description ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Term:
    """The coordinate on input ``axis``, as a GLSL int expression of the output coordinates
    ``c0, c1…`` (or of ``i``, the output flat index). ``follows``/``offset`` mark the plain case
    ``c{follows} + offset``, which is what a texel copy needs."""

    axis: int
    expr: str
    follows: int | None = None
    offset: int = 0


def follow(axis: int, out_axis: int, offset: int = 0, step: int = 1) -> Term:
    """Input ``axis`` reads ``offset + step · c{out_axis}``."""
    if step != 1:
        return Term(axis, f"{offset} + {step} * c{out_axis}")
    return Term(axis, f"c{out_axis} + {offset}" if offset else f"c{out_axis}", out_axis, offset)


@dataclass
class Source:
    """One input of a copy, seen with ``shape`` (a free view of it): the coordinate of each of
    its axes (axes without a term read 0), and the output ranges ``(out_axis, low, high)`` where it
    is read (none: everywhere)."""

    tensor: "PixelTensor"
    shape: tuple[int, ...]
    terms: list[Term]
    ranges: list[tuple[int, int, int]] = field(default_factory=list)

    def is_empty(self) -> bool:
        return self.tensor.size == 0 or any(low >= high for _, low, high in self.ranges)


@dataclass
class Copy:
    """A draw whose every output element is one element of the first source covering it, or
    ``fill``. Coordinates are taken in ``shape``, which may be a finer view of the output's shape
    (DepthToSpace). ``extra`` are other inputs the terms read through ``helpers`` (indices)."""

    shape: tuple[int, ...]
    sources: list[Source]
    fill: float = 0.0
    extra: dict[str, "PixelTensor"] = field(default_factory=dict)
    helpers: str = ""


# -- GLSL generation --------------------------------------------------------------------------------
def draw_copy(device: "PixelDevice", copy: Copy, out_shape: Sequence[int], dtype: Any,
              post: str | None = None) -> "PixelTensor":
    """(GL thread) Draw ``copy`` into a new tensor of ``out_shape`` in its natural layout."""
    out_shape = tuple(int(d) for d in out_shape)
    if math.prod(out_shape) == 0:  # nothing to draw (and a shader over 0 elements divides by 0)
        return device.empty(out_shape, dtype)
    copy.sources = [s for s in copy.sources if not s.is_empty()]
    layout = natural_layout(out_shape)
    bound = {f"S{k}": s.tensor for k, s in enumerate(copy.sources)} | copy.extra
    depth_axis = _texel_axis(copy, layout)
    mode = "value" if depth_axis is None else "texel"
    body = copy.helpers + "\n" + _body(copy, texel=depth_axis is not None)
    return device.draw(out_shape, body, bound, mode=mode, layout=layout, dtype=dtype, post=post)


def _texel_axis(copy: Copy, layout: Any) -> int | None:
    """The output axis that ``layout`` blocks, when every source can be copied texel by texel
    along it; else None."""
    for j, dim in enumerate(copy.shape):
        if axis_layout(copy.shape, j) == layout and all(_copies_texels(s, j, dim) for s in copy.sources):
            return j
    return None


def _copies_texels(source: Source, j: int, dim: int) -> bool:
    """Whether the four lanes of every output texel blocked along output axis ``j`` are four
    lanes of one texel of ``source``, in order."""
    followers = [t for t in source.terms if t.follows == j]
    if len(followers) != 1 or followers[0].offset % 4:
        return False
    term = followers[0]
    if source.tensor.layout != axis_layout(source.shape, term.axis):
        return False
    # The other coordinates, and where the source is read, must be the same for the four lanes.
    lane_dependent = re.compile(rf"\b(c{j}|i)\b")
    if any(lane_dependent.search(t.expr) for t in source.terms if t is not term):
        return False
    return all(low % 4 == 0 and (high % 4 == 0 or high >= dim) for axis, low, high in source.ranges if axis == j)


def _body(copy: Copy, texel: bool) -> str:
    """``value`` or ``texel`` function reading each source where it applies, else the fill."""
    shape = copy.shape
    lines = [f"int c{j} = {coordinate('i', shape, j) if dim > 1 else '0'};" for j, dim in enumerate(shape)]
    for k, source in enumerate(copy.sources):
        name = f"S{k}"
        fetch = _texel_fetch(name) if texel else f"{name}_at(e)"
        read = f"{{ int e = {_flat_index(source)}; return {fetch}; }}"
        condition = _condition(source.ranges, shape)
        lines.append(f"if ({condition}) {read}" if condition else read)
    fill = glsl_float(copy.fill)
    lines.append(f"return vec4({fill});" if texel else f"return {fill};")
    code = "\n    ".join(lines)
    if texel:  # ``i``: the flat index of the texel's first lane; the others follow along the depth
        return ("vec4 texel(int t, int outer, int block, int inner) {\n"
                f"    int i = (outer * OUT_D + 4 * block) * OUT_I + inner;\n    {code}\n}}")
    return f"float value(int i) {{\n    {code}\n}}"


def _flat_index(source: Source) -> str:
    """GLSL: the flat index into ``source`` of the element its terms address."""
    source_strides = strides(source.shape)
    parts = []
    for term in source.terms:
        if source.shape[term.axis] > 1:  # an axis of size 1 is always read at 0
            stride = source_strides[term.axis]
            parts.append(f"({term.expr})" if stride == 1 else f"({term.expr}) * {stride}")
    return " + ".join(parts) or "0"


def _texel_fetch(name: str) -> str:
    """GLSL: the texel of input ``name`` holding element ``e`` at lane 0 (``e``'s depth
    coordinate is a multiple of 4 on the texel path)."""
    return (f"{name}_texel((e / ({name}_D * {name}_I) * {name}_B + (e / {name}_I % {name}_D >> 2))"
            f" * {name}_I + e % {name}_I)")


def _condition(ranges: list[tuple[int, int, int]], shape: tuple[int, ...]) -> str:
    tests = []
    for axis, low, high in ranges:
        if low > 0:
            tests.append(f"c{axis} >= {low}")
        if high < shape[axis]:
            tests.append(f"c{axis} < {high}")
    return " && ".join(tests)


def index_helper(name: str, dim: int) -> str:
    """GLSL ``int {name}_index(int k)``: element ``k`` of index tensor ``name`` as a coordinate on
    an axis of ``dim``. The host already checked the indices; negative values and the clamp stay
    as a guard, so a shader never reads outside its texture."""
    return (f"int {name}_index(int k) {{ int v = int({name}_at(k)); "
            f"return clamp(v < 0 ? v + {dim} : v, 0, {max(dim - 1, 0)}); }}")


# -- kernels -------------------------------------------------------------------------------------------
class _Movement(PixelKernel):
    """Moves values without computing on them: accepts float32, bool, int32 and int64 data (all
    data inputs and outputs of one type); ``index_inputs`` must be int32 or int64."""

    def supports(self, types: Mapping[str, np.dtype | None]) -> bool:
        data: set[np.dtype] = set()
        for i, name in enumerate(self.layer.inputs):
            if not name or i in self.host_inputs:
                continue
            dtype = types.get(name)
            if dtype is None or (i in self.index_inputs and np.dtype(dtype) not in INDEX_TYPES):
                return False
            if i not in self.index_inputs:
                data.add(np.dtype(dtype))
        for name in self.layer.outputs:
            if name:
                if types.get(name) is None:
                    return False
                data.add(np.dtype(types[name]))
        return len(data) == 1 and data <= set(DATA_TYPES)

    def copy(self, device: "PixelDevice", copy: Copy, out_shape: Sequence[int], like: "PixelTensor",
             post: str | None) -> "PixelTensor":
        """Draw ``copy`` keeping the dtype of ``like``."""
        return draw_copy(device, copy, out_shape, like.dtype, post)


def _probe(tensor: "PixelTensor") -> np.ndarray:
    """A stand-in for ``tensor`` for the CPU op's shape logic: zero strides, so reshaping or
    splitting it allocates nothing."""
    return np.broadcast_to(np.zeros((), tensor.dtype), tensor.shape)


@pixel_kernel("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity")
class View(_Movement):
    """Free reshapes: the output shares the input's texels (no draw). The CPU op, run on a
    zero-stride stand-in, computes the shape, so allowzero, -1 and every opset's axes agree."""

    fuses_activation = False

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        x = inputs[0]
        shape = self.op(_probe(x), *inputs[1:])[0].shape
        return [x.view(tuple(shape))]


@pixel_kernel("Dropout")
class Dropout(_Movement):
    """Inference-mode Dropout that the optimizer kept because its mask output is named: the
    data is a view, the mask a draw of ones. A layer that may run in training mode (the CPU op's
    ``may_train``) is declined: the CPU op draws its random mask."""

    fuses_activation = False

    def __init__(self, layer, op):  # type: ignore[no-untyped-def]
        super().__init__(layer, op)
        self.host_inputs = frozenset({1, 2})  # ratio and training_mode decide on the host

    def supports(self, types: Mapping[str, np.dtype | None]) -> bool:
        names = [self.layer.inputs[0], self.layer.outputs[0]]
        dtypes = {types.get(n) for n in names}
        mask = self.layer.outputs[1] if len(self.layer.outputs) > 1 else ""
        if self.op.may_train:  # type: ignore[attr-defined]
            return False
        # The mask's type is often not inferred (opset < 10): the op knows it, as it writes only ones.
        return None not in dtypes and len(dtypes) == 1 and np.dtype(types[names[0]]) in DATA_TYPES and \
            (not mask or types.get(mask) is None or np.dtype(types[mask]) in DATA_TYPES)

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        x = inputs[0]
        # An empty stand-in tells the mask's dtype (inference mode only: see supports).
        results = self.op(np.zeros(0, x.dtype), *inputs[1:])
        outputs = [x.view(x.shape)]
        if len(results) > 1:
            outputs.append(draw_copy(device, Copy(x.shape, [], fill=1.0), x.shape, results[1].dtype))
        return outputs


@pixel_kernel("Transpose")
class Transpose(_Movement):
    """Any permutation; texels are copied when the blocked axis stays the blocked axis."""

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        x = inputs[0]
        rank = len(x.shape)
        perm = self.op.attr("perm", None)
        perm = list(range(rank))[::-1] if perm is None else normalize_axes(self.op, perm, rank)
        if sorted(perm) != list(range(rank)):
            raise op_error(self.op, f"perm {perm} is not a permutation of rank {rank}")
        out_shape = tuple(x.shape[p] for p in perm)
        source = Source(x, x.shape, [follow(p, j) for j, p in enumerate(perm)])
        return [self.copy(device, Copy(out_shape, [source]), out_shape, x, post)]


@pixel_kernel("Concat")
class Concat(_Movement):
    """Any axis and number of inputs in one draw (a chain of range tests); more inputs than
    texture units are concatenated in groups first."""

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        tensors = [t for t in inputs if t is not None]
        axis = normalize_axis(self.op, self.op.attr("axis", 1), len(tensors[0].shape))
        for t in tensors[1:]:
            if len(t.shape) != len(tensors[0].shape) or any(
                    a != b for j, (a, b) in enumerate(zip(t.shape, tensors[0].shape)) if j != axis):
                raise op_error(self.op, f"cannot concatenate shapes {[t.shape for t in tensors]} on axis {axis}")
        units = int(device.gl.ctx.info["GL_MAX_TEXTURE_IMAGE_UNITS"])
        return [self.concat(device, tensors, axis, units, post)]

    def concat(self, device: "PixelDevice", tensors: list["PixelTensor"], axis: int, units: int,
               post: str | None) -> "PixelTensor":
        if len(tensors) > units:  # each group is a contiguous range of the axis
            groups = [tensors[k:k + units] for k in range(0, len(tensors), units)]
            tensors = [self.concat(device, g, axis, units, None) for g in groups]
            return self.concat(device, tensors, axis, units, post)
        sources, offset = [], 0
        for t in tensors:
            dim = t.shape[axis]
            terms = [follow(j, j, -offset if j == axis else 0) for j in range(len(t.shape))]
            sources.append(Source(t, t.shape, terms, [(axis, offset, offset + dim)]))
            offset += dim
        out_shape = tuple(offset if j == axis else d for j, d in enumerate(tensors[0].shape))
        return self.copy(device, Copy(out_shape, sources), out_shape, tensors[0], post)


@pixel_kernel("Slice")
class Slice(_Movement):
    """starts/ends/axes/steps (inputs, or attributes before opset 10) with ONNX clamping;
    negative steps included."""

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        x = inputs[0]
        ranges = self.ranges(x.shape, list(inputs[1:]) + [None] * 4)
        out_shape = tuple(len(r) for r in ranges)
        # The step only matters past the first element: a step of 2^40 that keeps one element
        # would be a GLSL int literal out of range (a compile error).
        source = Source(x, x.shape, [follow(j, j, r.start, r.step if len(r) > 1 else 1) for j, r in enumerate(ranges)])
        return [self.copy(device, Copy(out_shape, [source]), out_shape, x, post)]

    def ranges(self, shape: tuple[int, ...], args: list) -> list[range]:
        """The input indices kept on each axis."""
        return [range(dim)[cut] for dim, cut in zip(shape, self.op.index(shape, *args[:4]))]


@pixel_kernel("Split")
class Split(_Movement):
    """Sizes from the input, the attribute (before opset 13) or equal parts; one draw per output."""

    fuses_activation = False  # several outputs: the backend applies activations to the first

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        x = inputs[0]
        parts = self.op(_probe(x), inputs[1] if len(inputs) > 1 else None)  # shapes, checked as on the CPU
        axis = normalize_axis(self.op, self.op.attr("axis", 0), len(x.shape))
        outputs, offset = [], 0
        for part in parts:
            terms = [follow(j, j, offset if j == axis else 0) for j in range(len(x.shape))]
            outputs.append(self.copy(device, Copy(part.shape, [Source(x, x.shape, terms)]), part.shape, x, None))
            offset += part.shape[axis]
        return outputs


class _HostIndices(_Movement):
    """Gathers whose indices (input 1, int32/int64) are read on the host: there they are checked
    like the CPU op checks them (an out-of-range index is an error naming it, never a silently
    clamped read), made non-negative, then uploaded. Indices from the model's inputs or constants
    are on the host anyway; computed ones cost a download."""

    def __init__(self, layer, op):  # type: ignore[no-untyped-def]
        super().__init__(layer, op)
        self.host_inputs = self.host_inputs | {1}

    def supports(self, types: Mapping[str, np.dtype | None]) -> bool:
        indices = types.get(self.layer.inputs[1]) if len(self.layer.inputs) > 1 else None
        return indices is not None and np.dtype(indices) in INDEX_TYPES and super().supports(types)

    def device_indices(self, device: "PixelDevice", indices: np.ndarray, dim: int) -> "PixelTensor":
        """(GL thread) The checked, non-negative indices as a texture."""
        return device.upload(normalize_indices(self.op, indices, dim))


@pixel_kernel("Gather")
class Gather(_HostIndices):
    """``np.take`` along ``axis``; indices may be negative."""

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        data = inputs[0]
        rank = len(data.shape)
        axis = normalize_axis(self.op, self.op.attr("axis"), rank)
        indices = self.device_indices(device, inputs[1], data.shape[axis])
        q = len(indices.shape)
        out_shape = data.shape[:axis] + indices.shape + data.shape[axis + 1:]
        flat = " + ".join(f"c{axis + k} * {s}" for k, s in enumerate(strides(indices.shape))
                          if indices.shape[k] > 1) or "0"
        terms = [follow(j, j) for j in range(axis)] + [Term(axis, f"I_index({flat})")]
        terms += [follow(j, j + q - 1) for j in range(axis + 1, rank)]
        copy = Copy(out_shape, [Source(data, data.shape, terms)], extra={"I": indices},
                    helpers=index_helper("I", data.shape[axis]))
        return [self.copy(device, copy, out_shape, data, post)]


@pixel_kernel("GatherElements")
class GatherElements(_HostIndices):
    """``np.take_along_axis``: the output has the indices' shape; indices as in Gather."""

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        data = inputs[0]
        rank = len(data.shape)
        if np.ndim(inputs[1]) != rank:
            raise op_error(self.op, f"indices of rank {np.ndim(inputs[1])} for data of rank {rank}")
        axis = normalize_axis(self.op, self.op.attr("axis"), rank)
        indices = self.device_indices(device, inputs[1], data.shape[axis])
        terms = [follow(j, j) if j != axis else Term(axis, "I_index(i)") for j in range(rank)]
        copy = Copy(indices.shape, [Source(data, data.shape, terms)], extra={"I": indices},
                    helpers=index_helper("I", data.shape[axis]))
        return [self.copy(device, copy, indices.shape, data, post)]


@pixel_kernel("Expand")
class Expand(_Movement):
    """NumPy broadcasting of the input to the shape input."""

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        x = inputs[0]
        try:
            out_shape = tuple(np.broadcast_shapes(x.shape, tuple(int_list(inputs[1]))))
        except ValueError as exc:
            raise op_error(self.op, f"cannot broadcast {x.shape} to {int_list(inputs[1])}") from exc
        lead = len(out_shape) - len(x.shape)
        # A broadcast axis (size 1) has no term: it is read at coordinate 0.
        terms = [follow(a, a + lead) for a, dim in enumerate(x.shape) if dim != 1]
        return [self.copy(device, Copy(out_shape, [Source(x, x.shape, terms)]), out_shape, x, post)]


@pixel_kernel("Tile")
class Tile(_Movement):
    """``np.tile`` with host repeats (Tile-1's single axis included)."""

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        x = inputs[0]
        rank = len(x.shape)
        if self.op.version < 6:
            reps = [1] * rank
            reps[normalize_axis(self.op, int_list(inputs[2])[0], rank)] = int_list(inputs[1])[0]
        else:
            reps = int_list(inputs[1])
        if len(reps) != rank or min(reps, default=0) < 0:
            raise op_error(self.op, f"repeats {reps} do not fit an input of rank {rank}")
        out_shape = tuple(d * r for d, r in zip(x.shape, reps))
        terms = [follow(j, j) if r == 1 else Term(j, f"c{j} % {max(d, 1)}")
                 for j, (d, r) in enumerate(zip(x.shape, reps))]
        return [self.copy(device, Copy(out_shape, [Source(x, x.shape, terms)]), out_shape, x, post)]


# Positive remainders (GLSL's % is undefined for negative operands): callers add a multiple of
# the period first. ``mirror`` folds a position onto 0..n-1 the way numpy's "reflect" does.
_PAD_HELPERS = "int mirror(int u, int period, int n) { int m = u % period; return m < n ? m : period - m; }"


@pixel_kernel("Pad")
class Pad(_Movement):
    """constant, reflect, edge and wrap modes; pads (negative ones crop), constant value and
    axes are read on the host."""

    def __init__(self, layer, op):  # type: ignore[no-untyped-def]
        super().__init__(layer, op)
        self.host_inputs = frozenset({1, 2, 3})  # the constant value too: it is a shader literal

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        x = inputs[0]
        widths, fill = self.widths(x.shape, list(inputs[1:]) + [None] * 3)
        mode = self.op.attr("mode")
        terms, ranges, out_shape = [], [], []
        for j, (dim, (before, after)) in enumerate(zip(x.shape, widths)):
            crop, pad = max(-before, 0), max(before, 0)
            kept = max(dim - crop - max(-after, 0), 0)
            out_shape.append(pad + kept + max(after, 0))
            if pad == 0 and after <= 0:
                terms.append(follow(j, j, crop))
            elif mode == "constant":
                terms.append(follow(j, j, crop - pad))
                ranges.append((j, pad, pad + kept))
            elif kept == 0:
                raise op_error(self.op, f"mode {mode!r} cannot pad an empty axis")
            else:
                terms.append(Term(j, f"{self.fold(mode, f'c{j}', pad, kept)} + {crop}"))
        source = Source(x, x.shape, terms, ranges)
        copy = Copy(tuple(out_shape), [source], fill=fill, helpers=_PAD_HELPERS)
        return [self.copy(device, copy, out_shape, x, post)]

    @staticmethod
    def fold(mode: str, c: str, pad: int, n: int) -> str:
        """GLSL: output coordinate ``c`` as a coordinate in ``0..n-1`` of the (cropped) input."""
        if mode == "edge":
            return f"clamp({c} - {pad}, 0, {n - 1})"
        period = n if mode == "wrap" else 2 * (n - 1)
        if period == 0:  # reflecting a single value repeats it
            return "0"
        shift = period * -(-pad // period) - pad  # makes the operand non-negative
        return f"({c} + {shift}) % {n}" if mode == "wrap" else f"mirror({c} + {shift}, {period}, {n})"

    def widths(self, shape: tuple[int, ...], args: list) -> tuple[list[tuple[int, int]], float]:
        """``(before, after)`` per axis, and the constant value."""
        widths, value = self.op.widths(len(shape), *args[:3])
        fill = 0.0 if value is None else np.asarray(value).reshape(-1)[0]
        if np.asarray(fill).dtype.kind in "iu" and int(fill) != int(np.float32(fill)):
            # Integers are stored as float32 texels: 2^31 + 1 would come back as 2^31.
            raise op_error(self.op, f"constant_value {int(fill)} is not exact in float32, in which the "
                                    "gpu_pixel backend stores integers (every |value| up to 2^24 is)")
        return [(b, e) for b, e in widths], float(fill)


class _Blocks(_Movement):
    """DepthToSpace/SpaceToDepth: a transpose of 6-D views of the 4-D input and output."""

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        x = inputs[0]
        if len(x.shape) != 4:
            raise op_error(self.op, f"expects a 4-D input, got shape {x.shape}")
        view, perm, out_shape = self.rearrangement(x.shape, self.op.attr("blocksize"),
                                                   self.op.attr("mode", "DCR"))
        source = Source(x, view, [follow(p, j) for j, p in enumerate(perm)])
        copy = Copy(tuple(view[p] for p in perm), [source])
        return [self.copy(device, copy, out_shape, x, post)]

    def rearrangement(self, shape: tuple[int, ...], bs: int,
                      mode: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The input's 6-D view, the permutation, and the 4-D output shape."""
        raise NotImplementedError


@pixel_kernel("DepthToSpace")
class DepthToSpace(_Blocks):
    """Channels into ``blocksize²`` spatial blocks, DCR or CRD order."""

    def rearrangement(self, shape, bs, mode):  # type: ignore[no-untyped-def]
        n, c, h, w = shape
        if c % (bs * bs):
            raise op_error(self.op, f"channels {c} not divisible by blocksize² {bs * bs}")
        c2 = c // (bs * bs)
        if mode == "DCR":
            view, perm = (n, bs, bs, c2, h, w), (0, 3, 4, 1, 5, 2)
        else:
            view, perm = (n, c2, bs, bs, h, w), (0, 1, 4, 2, 5, 3)
        return view, perm, (n, c2, h * bs, w * bs)


@pixel_kernel("SpaceToDepth")
class SpaceToDepth(_Blocks):
    """Spatial ``blocksize²`` blocks into channels (the inverse of DepthToSpace)."""

    def rearrangement(self, shape, bs, mode):  # type: ignore[no-untyped-def]
        n, c, h, w = shape
        if h % bs or w % bs:
            raise op_error(self.op, f"spatial size {h}x{w} not divisible by blocksize {bs}")
        perm = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)
        return (n, c, h // bs, bs, w // bs, bs), perm, (n, c * bs * bs, h // bs, w // bs)


@pixel_kernel("Cast")
class Cast(_Movement):
    """Casts between float32, bool, int32 and int64. Those that keep every value (from bool or
    integers, between integers, to the same type) are free views; to bool is ``x != 0`` and
    float32 to an integer truncates, one texel-wise draw each."""

    fuses_activation = False

    def supports(self, types: Mapping[str, np.dtype | None]) -> bool:
        src, dst = types.get(self.layer.inputs[0]), types.get(self.layer.outputs[0])
        return src is not None and dst is not None and np.dtype(src) in DATA_TYPES and \
            np.dtype(dst) in DATA_TYPES and np.dtype(dst) == self.op.dtype

    def run(self, device, inputs, post):  # type: ignore[no-untyped-def]
        x, target = inputs[0], np.dtype(self.op.dtype)
        if target == BOOL and x.dtype != BOOL:
            expression = "vec4(notEqual(a, vec4(0.0)))"
        elif x.dtype == FLOAT32 and target in INDEX_TYPES:
            expression = "trunc(a)"
        else:
            return [x.view(x.shape, target)]
        body = f"vec4 texel(int t, int outer, int block, int inner) {{ vec4 a = A_texel(t); return {expression}; }}"
        return [device.draw(x.shape, body, {"A": x}, mode="texel", layout=x.layout, dtype=target)]
