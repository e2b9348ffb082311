"""Reductions (ReduceSum … ReduceLogSumExp), Softmax, LogSoftmax, LayerNormalization and
RMSNormalization: everything that folds a tensor over a set of axes.

One fragment folds one *group* (the values one output of a Reduce op reads, or one row of a
softmax or a normalisation) with compile-time loops. How it walks the group depends on the input's
layout (see layout.py):

- *blocked*: the reduced axes are exactly the layout's depth axes plus some outer axes just before
  them (softmax or layernorm over the last axis of a last-axis blocked tensor, softmax over the
  channels of an NCHW one): the fold reads whole texels, four values at a time, and masks the
  padding lanes of each row's last texel;
- *inner* (Reduce ops only): the reduced axes are exactly the inner axes (a spatial mean of an NCHW
  tensor): each fragment folds four channels at once into one output texel;
- *generic*: anything else reads element by element through ``X_at``, four per step.

Softmax and the normalisations draw twice: the group statistics into a ``(groups, 4)`` tensor,
then the element-wise result, a texel at a time when the layout is blocked.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..layout import Layout
from .base import PixelKernel, broadcast_index, coordinate, glsl_float, pixel_kernel, strides

if TYPE_CHECKING:
    from ....model.ir import Layer
    from ....ops.base import Op
    from ..device import PixelDevice
    from ..storage import PixelTensor

NEG_INF = glsl_float(-math.inf)
POS_INF = glsl_float(math.inf)


# -- what a fold computes -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Pass:
    """One loop over a group: ``term`` (GLSL of the vec4 ``x``) folded by ``kind`` (sum, max, min,
    prod) into ``a{k}`` = ``finish`` of the folded value ``r``. ``identity`` is what a padding lane
    reads as, so that its term is neutral (e.g. -inf for a sum of exponentials)."""

    kind: str
    term: str = "x"
    identity: str = "0.0"
    finish: str = "r"


_INIT = {"sum": "vec4(0.0)", "max": f"vec4({NEG_INF})", "min": f"vec4({POS_INF})", "prod": "vec4(1.0)"}
_UPDATE = {"sum": "acc += {};", "max": "acc = max(acc, {});", "min": "acc = min(acc, {});", "prod": "acc *= {};"}
_LANES = {"sum": "(acc.x + acc.y) + (acc.z + acc.w)", "max": "max(max(acc.x, acc.y), max(acc.z, acc.w))",
          "min": "min(min(acc.x, acc.y), min(acc.z, acc.w))", "prod": "(acc.x * acc.y) * (acc.z * acc.w)"}

# GLSL helpers some folds use, for float and vec4 (the inner path folds per lane)
FOLD_HELPERS = """
float finite_or_zero(float m) { return isinf(m) ? 0.0 : m; }
vec4 finite_or_zero(vec4 m) { return mix(m, vec4(0.0), isinf(m)); }
"""

#: Reduce ops: their passes and the result (GLSL of the passes' ``a0``, ``a1`` and the count ``R``).
REDUCTIONS: dict[str, tuple[tuple[Pass, ...], str]] = {
    "ReduceSum": ((Pass("sum"),), "a0"),
    "ReduceMean": ((Pass("sum"),), "a0 / R"),
    "ReduceMax": ((Pass("max", identity=NEG_INF),), "a0"),
    "ReduceMin": ((Pass("min", identity=POS_INF),), "a0"),
    "ReduceProd": ((Pass("prod", identity="1.0"),), "a0"),
    "ReduceL1": ((Pass("sum", "abs(x)"),), "a0"),
    "ReduceL2": ((Pass("sum", "x * x"),), "sqrt(a0)"),
    "ReduceSumSquare": ((Pass("sum", "x * x"),), "a0"),
    "ReduceLogSum": ((Pass("sum"),), "log(a0)"),
    # all -inf (or +inf) maxima shift by 0, as the CPU op does, so log(0) = -inf and not NaN
    "ReduceLogSumExp": ((Pass("max", identity=NEG_INF),
                         Pass("sum", "exp(x - finite_or_zero(a0))", identity=NEG_INF)),
                        "log(a1) + finite_or_zero(a0)"),
}

#: Softmax statistics: the maximum, and the sum of exponentials shifted by it.
SOFTMAX_PASSES = (Pass("max", identity=NEG_INF), Pass("sum", "exp(x - a0)", identity=NEG_INF))


def layernorm_passes(epsilon: float) -> tuple[Pass, ...]:
    """Mean, then the inverse standard deviation from the centred squares (two passes: stable)."""
    eps = glsl_float(epsilon)
    return (Pass("sum", finish="r / R"),
            Pass("sum", "(x - a0) * (x - a0)", identity="a0", finish=f"1.0 / sqrt(r / R + {eps})"))


def rms_passes(epsilon: float) -> tuple[Pass, ...]:
    return (Pass("sum", "x * x", finish=f"1.0 / sqrt(r / R + {glsl_float(epsilon)})"),)


# -- which elements a group reads -------------------------------------------------------------------
def merge_axes(shape: Sequence[int], reduced: set[int]) -> list[tuple[int, int, bool]]:
    """``(size, stride, reduced)`` of runs of neighbouring axes that are all reduced or all kept,
    without the unit axes (they move no index)."""
    runs: list[tuple[int, int, bool]] = []
    for axis, (size, stride) in enumerate(zip(shape, strides(tuple(shape)))):
        if size == 1:
            continue
        flag = axis in reduced
        if runs and runs[-1][2] == flag:
            runs[-1] = (runs[-1][0] * size, stride, flag)
        else:
            runs.append((size, stride, flag))
    return runs


def offset(index: str, runs: list[tuple[int, int, bool]]) -> str:
    """GLSL: the flat input offset of element ``index`` (C-order) of the runs' own space."""
    sizes = tuple(size for size, _, _ in runs)
    terms = [f"{coordinate(index, sizes, k)} * {stride}" for k, (_, stride, _) in enumerate(runs)]
    return " + ".join(terms) or "0"


@dataclass(frozen=True)
class Fold:
    """The groups of ``shape`` over the reduced ``axes``, and how ``layout`` lets them be read."""

    shape: tuple[int, ...]
    axes: frozenset[int]
    layout: Layout

    @property
    def extent(self) -> int:
        """Values per group."""
        return math.prod(self.shape[a] for a in self.axes)

    @property
    def groups(self) -> int:
        return math.prod(d for a, d in enumerate(self.shape) if a not in self.axes)

    def squeezed(self) -> tuple[list[int], set[int]]:
        """The shape without unit axes and the reduced axes among those (unit axes move no index)."""
        keep = [a for a, d in enumerate(self.shape) if d != 1]
        return [self.shape[a] for a in keep], {k for k, a in enumerate(keep) if a in self.axes}

    def blocked(self) -> tuple[int, int] | None:
        """``(G, I)`` when each group is ``G`` consecutive rows of the layout's whole depth at one
        of its ``I`` inner positions: the reduced axes are the depth axes and outer axes just before
        them, the inner axes are kept."""
        dims, red = self.squeezed()
        if not red:
            return None
        lo, q = min(red), max(red) + 1
        if red != set(range(lo, q)) or math.prod(dims[q:]) != self.layout.inner:
            return None
        run, p = 1, q
        while p > lo and run < self.layout.depth:
            p -= 1
            run *= dims[p]
        if run != self.layout.depth or math.prod(dims[:p]) != self.layout.outer:
            return None
        return math.prod(dims[lo:p]), self.layout.inner

    def inner_only(self) -> bool:
        """Whether the reduced axes are exactly the layout's inner axes (more than one value)."""
        dims, red = self.squeezed()
        if not red or self.layout.inner < 2:
            return False
        q = min(red)
        return red == set(range(q, len(dims))) and math.prod(dims[q:]) == self.layout.inner


# -- GLSL of a fold -------------------------------------------------------------------------------------
def _blocked_loop(fold: Fold, rows: int, update: str, identity: str) -> str:
    """Statements folding the group whose first texel is ``base`` (blocked path): ``rows`` rows
    of the depth, each a texel run with stride ``inner``; padding lanes read as ``identity``."""
    lay = fold.layout
    full, rem, step = lay.depth // 4, lay.depth % 4, lay.inner
    if rem == 0:  # no padding: the rows' texels are one evenly spaced run
        return f"for (int u = 0; u < {rows * lay.blocks}; ++u) {{ vec4 x = X_texel(base + u * {step}); {update} }}"
    body = f"for (int u = 0; u < {full}; ++u) {{ vec4 x = X_texel(row + u * {step}); {update} }}" if full else ""
    last = f"mix(vec4({identity}), X_texel(row + {full * step}), lessThan(ivec4(0, 1, 2, 3), ivec4({rem})))"
    body += f" {{ vec4 x = {last}; {update} }}"
    return f"for (int g = 0; g < {rows}; ++g) {{ int row = base + g * {lay.blocks * step}; {body} }}"


def _generic_loop(fold: Fold, update: str, identity: str) -> str:
    """Statements folding the group at input offset ``base`` element by element, four per step."""
    reduced = [run for run in merge_axes(fold.shape, set(fold.axes)) if run[2]]
    full, rem = fold.extent // 4, fold.extent % 4

    def fetch(j: str) -> str:
        return f"X_at(base + {offset(j, reduced)})"

    code = ""
    if full:
        lanes = ", ".join(fetch(f"(j + {k})") for k in range(4))
        code = f"for (int j = 0; j < {4 * full}; j += 4) {{ vec4 x = vec4({lanes}); {update} }}"
    if rem:
        lanes = ", ".join(fetch(str(4 * full + k)) if k < rem else identity for k in range(4))
        code += f" {{ vec4 x = vec4({lanes}); {update} }}"
    return code


def fold_statements(fold: Fold, passes: Sequence[Pass], group: str = "s") -> str:
    """GLSL statements that leave the float ``a0``, ``a1``… of the passes for group ``group``."""
    blocked = fold.blocked()
    lines = [f"const float R = {float(fold.extent)};"]
    if blocked:
        rows, inner = blocked
        lines.append(f"int base = ({group} / {inner}) * {rows * fold.layout.blocks * inner} + {group} % {inner};")
    else:
        kept = [run for run in merge_axes(fold.shape, set(fold.axes)) if not run[2]]
        lines.append(f"int base = {offset(group, kept)};")
    for k, p in enumerate(passes):
        update = _UPDATE[p.kind].format(p.term)
        loop = (_blocked_loop(fold, blocked[0], update, p.identity) if blocked
                else _generic_loop(fold, update, p.identity))
        lines += [f"{'vec4 ' if k == 0 else ''}acc = {_INIT[p.kind]};", loop,
                  f"float a{k}; {{ float r = {_LANES[p.kind]}; a{k} = {p.finish}; }}"]
    return "\n    ".join(lines)


def inner_statements(fold: Fold, passes: Sequence[Pass]) -> str:
    """Like `fold_statements` for the inner path: ``a0``… are vec4s of four channels, the
    fragment's output texel ``t`` folding input texels ``t·I .. t·I + I-1``."""
    lines = [f"const float R = {float(fold.extent)};"]
    inner = fold.layout.inner
    for k, p in enumerate(passes):
        update = _UPDATE[p.kind].format(p.term)
        lines += [f"{'vec4 ' if k == 0 else ''}acc = {_INIT[p.kind]};",
                  f"for (int u = 0; u < {inner}; ++u) {{ vec4 x = X_texel(t * {inner} + u); {update} }}",
                  f"vec4 a{k}; {{ vec4 r = acc; a{k} = {p.finish}; }}"]
    return "\n    ".join(lines)


def group_of(fold: Fold, index: str) -> str:
    """GLSL: the group of input element ``index`` (C-order over the kept axes)."""
    runs = merge_axes(fold.shape, set(fold.axes))
    sizes = tuple(size for size, _, _ in runs)
    kept = [k for k, run in enumerate(runs) if not run[2]]
    kept_strides = strides(tuple(sizes[k] for k in kept))
    terms = [f"{coordinate(index, sizes, k)} * {stride}" for k, stride in zip(kept, kept_strides)]
    return " + ".join(terms) or "0"


def check_loops(device: PixelDevice, fold: Fold, passes: Sequence[Pass], inner: bool = False) -> None:
    """Raise a clear error where a group is too long for one fragment's loops on this GL: llvmpipe
    stops them after a fixed count, which would give a silently wrong result."""
    if device.loop_limit is None:
        return
    blocked = fold.blocked()
    if inner:
        per_pass = fold.layout.inner
    elif blocked:
        per_pass = blocked[0] * fold.layout.blocks
    else:
        per_pass = fold.extent // 4
    if per_pass * len(passes) > device.loop_limit:
        raise ValueError(f"a group of {fold.extent} values takes {per_pass * len(passes)} loop iterations in one "
                         f"fragment; {device.renderer} runs at most {device.loop_limit} (it stops longer loops "
                         "without an error): run this layer on another backend")


# -- draws ----------------------------------------------------------------------------------------------
def draw_stats(device: PixelDevice, x: PixelTensor, fold: Fold, passes: Sequence[Pass], result: str) -> PixelTensor:
    """A ``(groups, 4)`` tensor, texel ``s`` = ``result`` (GLSL vec4 of the passes) for group ``s``."""
    check_loops(device, fold, passes)
    body = f"""{FOLD_HELPERS}
vec4 texel(int t, int outer, int block, int inner) {{
    int s = t;
    {fold_statements(fold, passes)}
    return {result};
}}"""
    return device.draw((fold.groups, 4), body, {"X": x}, mode="texel", layout=Layout(fold.groups, 4, 1))


def draw_reduction(device: PixelDevice, x: PixelTensor, fold: Fold, passes: Sequence[Pass], result: str,
                   out_shape: tuple[int, ...], post: str | None) -> PixelTensor:
    """One value per group, ``result`` (GLSL of ``a0``…, ``R``) shaped ``out_shape``."""
    check_loops(device, fold, passes, inner=fold.inner_only())
    if fold.inner_only():  # four channels per fragment, one output texel each
        lay = fold.layout
        body = f"""{FOLD_HELPERS}
vec4 texel(int t, int outer, int block, int inner) {{
    {inner_statements(fold, passes)}
    return {result};
}}"""
        return device.draw(out_shape, body, {"X": x}, mode="texel", layout=Layout(lay.outer, lay.depth, 1),
                           post=post)
    body = f"""{FOLD_HELPERS}
float value(int s) {{
    {fold_statements(fold, passes)}
    return {result};
}}"""
    return device.draw(out_shape, body, {"X": x}, mode="value", post=post)


def _param_texel(name: str, param: PixelTensor, x: PixelTensor, fold: Fold) -> str:
    """GLSL vec4 of ``param`` broadcast against ``x`` at the texel-mode fragment's four lanes."""
    lay = x.layout
    if param.shape == x.shape and param.layout == lay:
        return f"{name}_texel(t)"
    rows = (fold.blocked() or (0, 0))[0]
    if lay.inner == 1 and rows and _is_trailing(param.shape, x.shape, rows * lay.depth) \
            and param.layout == Layout(rows, lay.depth, 1):
        return f"{name}_texel((outer % {rows}) * {lay.blocks} + block)"  # a group's rows, blocked alike
    lanes = []
    for j in range(4):
        flat = f"((outer * {lay.depth} + min(4 * block + {j}, {lay.depth - 1})) * {lay.inner} + inner)"
        lanes.append(f"{name}_at({broadcast_index(flat, tuple(x.shape), tuple(param.shape))})")
    return f"vec4({', '.join(lanes)})"


def _is_trailing(shape: tuple[int, ...], of: tuple[int, ...], size: int) -> bool:
    """Whether ``shape``, less its leading unit axes, is the trailing axes of ``of`` holding ``size``
    values: broadcast against ``of``, element ``i`` reads ``i % size``."""
    first = next((k for k, d in enumerate(shape) if d != 1), len(shape))
    trimmed = tuple(shape[first:])
    return math.prod(trimmed) == size and tuple(of[len(of) - len(trimmed):]) == trimmed


def draw_map(device: PixelDevice, x: PixelTensor, fold: Fold, stats: PixelTensor, expression: str,
             params: dict[str, PixelTensor], post: str | None) -> PixelTensor:
    """``x``'s shape and layout, each element ``expression`` of ``x``, its group's stats ``st``
    (vec4) and the broadcast ``params`` (lower-case name in GLSL; float or vec4 alike)."""
    inputs = {"X": x, "S": stats, **{name.upper(): p for name, p in params.items()}}
    blocked = fold.blocked()
    if blocked:  # all four lanes of a texel are in one group
        rows, inner = blocked
        fetch = " ".join(f"vec4 {name} = {_param_texel(name.upper(), p, x, fold)};" for name, p in params.items())
        body = f"""
vec4 texel(int t, int outer, int block, int inner) {{
    vec4 st = S_texel((outer / {rows}) * {inner} + inner);
    vec4 x = X_texel(t); {fetch}
    return {expression};
}}"""
        return device.draw(x.shape, body, inputs, mode="texel", layout=x.layout, post=post)
    fetch = " ".join(f"float {name} = {name.upper()}_at({broadcast_index('i', tuple(x.shape), tuple(p.shape))});"
                     for name, p in params.items())
    body = f"""
float value(int i) {{
    vec4 st = S_texel({group_of(fold, 'i')});
    float x = X_at(i); {fetch}
    return {expression};
}}"""
    return device.draw(x.shape, body, inputs, mode="value", layout=x.layout, post=post)


def draw_lane(device: PixelDevice, stats: PixelTensor, lane: int, shape: tuple[int, ...]) -> PixelTensor:
    """The ``lane`` of each group's stats as a tensor of ``shape`` (one value per group)."""
    body = f"float value(int i) {{ return S_texel(i)[{lane}]; }}"
    return device.draw(shape, body, {"S": stats}, mode="value")


def copy(device: PixelDevice, x: PixelTensor, post: str | None) -> PixelTensor:
    """``x`` itself, or a copy with ``post`` applied."""
    if post is None:
        return x.view(x.shape)
    body = "vec4 texel(int t, int outer, int block, int inner) { return X_texel(t); }"
    return device.draw(x.shape, body, {"X": x}, mode="texel", layout=x.layout, post=post)


# -- kernels ------------------------------------------------------------------------------------------------
@pixel_kernel(*REDUCTIONS)
class Reduce(PixelKernel):
    """ReduceSum … ReduceLogSumExp over axes given as an attribute or as a host input."""

    def __init__(self, layer: Layer, op: Op):
        super().__init__(layer, op)
        self.from_input = bool(getattr(op, "axes_as_input", False))
        self.attr_axes = op.attr("axes", None)
        self.keepdims = bool(int(op.attr("keepdims")))
        self.noop = bool(int(op.attr("noop_with_empty_axes", 0)))

    def axes(self, inputs: list, ndim: int) -> frozenset[int] | None:
        """The reduced axes (normalised); None: the identity (no axes and noop_with_empty_axes)."""
        given = (inputs[1] if len(inputs) > 1 else None) if self.from_input else self.attr_axes
        if given is None or len(np.asarray(given).reshape(-1)) == 0:
            return None if self.noop else frozenset(range(ndim))
        return frozenset(int(a) % ndim for a in np.asarray(given).reshape(-1)) if ndim else frozenset()

    def run(self, device: PixelDevice, inputs: list, post: str | None) -> list[PixelTensor | None]:
        x = inputs[0]
        axes = self.axes(inputs, len(x.shape))
        if axes is None:
            return [copy(device, x, post)]
        if self.keepdims:
            out_shape = tuple(1 if a in axes else d for a, d in enumerate(x.shape))
        else:
            out_shape = tuple(d for a, d in enumerate(x.shape) if a not in axes)
        passes, result = REDUCTIONS[self.layer.op_type]
        return [draw_reduction(device, x, Fold(tuple(x.shape), axes, x.layout), passes, result, out_shape, post)]


@pixel_kernel("Softmax", "LogSoftmax")
class Softmax(PixelKernel):
    """Softmax and LogSoftmax: before opset 13 over the 2-D coercion at ``axis``, then over ``axis``."""

    def axes(self, ndim: int) -> frozenset[int]:
        if self.op.version >= 13:
            return frozenset({int(self.op.attr("axis", -1)) % ndim}) if ndim else frozenset()
        axis = int(self.op.attr("axis", 1)) % max(ndim, 1)
        return frozenset(range(axis, ndim))

    def run(self, device: PixelDevice, inputs: list, post: str | None) -> list[PixelTensor | None]:
        x = inputs[0]
        fold = Fold(tuple(x.shape), self.axes(len(x.shape)), x.layout)
        stats = draw_stats(device, x, fold, SOFTMAX_PASSES, "vec4(a0, a1, 0.0, 0.0)")
        expression = "exp(x - st.x) / st.y" if self.layer.op_type == "Softmax" else "(x - st.x) - log(st.y)"
        return [draw_map(device, x, fold, stats, expression, {}, post)]


class _Normalization(PixelKernel):
    """Shared by LayerNormalization and RMSNormalization: statistics over the axes from ``axis``."""

    def fold(self, x: PixelTensor) -> Fold:
        ndim = len(x.shape)
        axis = int(self.op.attr("axis"))
        axis = axis + ndim if axis < 0 else axis
        return Fold(tuple(x.shape), frozenset(range(axis, ndim)), x.layout)


@pixel_kernel("LayerNormalization")
class LayerNormalization(_Normalization):
    """``(x - mean) · invstd · scale + bias``; also the Mean and InvStdDev outputs when asked for."""

    def run(self, device: PixelDevice, inputs: list, post: str | None) -> list[PixelTensor | None]:
        x, scale = inputs[0], inputs[1]
        bias = inputs[2] if len(inputs) > 2 else None
        fold = self.fold(x)
        stats = draw_stats(device, x, fold, layernorm_passes(float(self.op.attr("epsilon"))),
                           "vec4(a0, a1, 0.0, 0.0)")
        params = {"w": scale} if bias is None else {"w": scale, "z": bias}
        expression = "(x - st.x) * st.y * w" + ("" if bias is None else " + z")
        outputs = [draw_map(device, x, fold, stats, expression, params, post)]
        stat_shape = tuple(1 if a in fold.axes else d for a, d in enumerate(x.shape))
        for lane, name in enumerate(self.layer.outputs[1:3]):
            outputs.append(draw_lane(device, stats, lane, stat_shape) if name else None)
        return outputs


@pixel_kernel("RMSNormalization")
class RMSNormalization(_Normalization):
    """``x / sqrt(mean(x²) + epsilon) · scale`` over the axes from ``axis``."""

    def run(self, device: PixelDevice, inputs: list, post: str | None) -> list[PixelTensor | None]:
        x, scale = inputs[0], inputs[1]
        fold = self.fold(x)
        stats = draw_stats(device, x, fold, rms_passes(float(self.op.attr("epsilon"))), "vec4(a0)")
        return [draw_map(device, x, fold, stats, "x * st.x * w", {"w": scale}, post)]
