"""The 3x3 pools: at stride 2 (a CNN's downsampling MaxPool, ShuffleNet's AveragePool) on
explicit vectors; the 3x3/1 sum with a pad of one all round (Inception's average pools) in flat
passes over blocks of planes (`sum_three_by_one`, below), divided there by each window's count
where pads do not count (`mean_three_by_one`), and its max.

The general loops (`pool.pool2d_columns_first`, `pool.flat_pool`) leave vectorising to LLVM,
whose vector loop takes 64 values an iteration (four vectors of AVX-512): a 111-wide row ran one
iteration and 47 values one at a time, a 56-wide or narrower row only single values. Here each
block of output rows is two passes over vectors (`panels.VECTOR_BYTES`) written in LLVM IR: for
every row of the block, the window's (up to) three input rows combined down their columns into a
row buffer padded with the neutral value (``down``), then along each of those rows, where output
``ow`` combines ``down[2·ow + j]``, j < 3: two vectors of ``down`` give the even and the odd
columns by two shuffles, and the even ones shifted by one column by a third. A row's last values short of a vector take one more vector ending at
the row's end (overlapping the one before: each value is stored again, never accumulated), and
rows under a vector wide half vectors; only rows under half a vector go value by value.

A max is NaN-exact as ``np.maximum`` (a NaN in the window gives NaN; `_combine3`). A sum adds
the window's rows down, then along, in window order, a row above or below the map as zeros
(``(0 + b) + c``: the sums of `pool.pool2d_columns_first`, but for the sign of a zero sum).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import inline, kernel
from .panels import VECTOR_BYTES
from .pool_folds import EXACT_MAX as MAX
from .pool_folds import SUM, _fold

_U = np.uint64


def _combine3(builder: Any, how: int, a: Any, b: Any, c: Any) -> Any:
    """``(a ⊕ b) ⊕ c`` on vectors: ``(a + b) + c``, or the NaN-exact max. ``x > y ? x : y`` is
    one max instruction that keeps a NaN ``y`` (only): ``c > t ? c : t`` of ``t = a > b ? a : b``
    keeps a NaN ``b``, and a NaN ``a`` or ``c`` (one unordered compare for both) gives ``a + c``,
    a NaN: five instructions, where a compare-or-unordered select per pair took eight."""
    if how == SUM:
        return builder.fadd(builder.fadd(a, b), c)
    t = builder.select(builder.fcmp_ordered(">", a, b), a, b)
    m = builder.select(builder.fcmp_ordered(">", c, t), c, t)
    return builder.select(builder.fcmp_unordered("uno", a, c), builder.fadd(a, c), m)


def _lanes(context: Any, dtype: Any, narrow: bool) -> tuple[Any, int, int]:
    """The element type, its size and the lanes of a vector (half of one: ``narrow``)."""
    element = context.get_value_type(dtype)
    size = context.get_abi_sizeof(element)
    return element, size, VECTOR_BYTES // size // (2 if narrow else 1)


def _down_vector(how: int, narrow: bool = False) -> Any:
    """An intrinsic ``fold(down, at, source, padding, a, b, c, missing, j)``: ``down[at + j + i] =
    (R0[j + i] ⊕ R1[j + i]) ⊕ R2[j + i]`` for the ``i`` < one vector's lanes (half a vector's:
    ``narrow``), where the window's rows ``R0, R1, R2`` start at offsets ``a, b, c`` of the flat
    input ``source``, or are ``padding`` (a row of the neutral value) where bit 0, 1 or 2 of
    ``missing`` is set (a row above or below the map). Offsets, not row views: a view costs a
    reference count's update, a call, each."""

    @intrinsic
    def fold(typingctx: Any, down: Any, at: Any, source: Any, padding: Any, a: Any, b: Any, c: Any, missing: Any,
             j: Any) -> Any:
        if not all(isinstance(t, types.Array) and t.ndim == 1 and t.layout == "C" and t.dtype == down.dtype
                   for t in (down, source, padding)):
            return None
        signature = types.void(down, at, source, padding, a, b, c, missing, j)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            down_arr, source_arr, padding_arr = (context.make_array(sig.args[i])(context, builder, args[i])
                                                 for i in (0, 2, 3))
            at_, a_, b_, c_, missing_, j_ = (context.cast(builder, args[i], sig.args[i], types.int64)
                                             for i in (1, 4, 5, 6, 7, 8))
            element, size, lanes = _lanes(context, sig.args[0].dtype, narrow)
            pointer = ir.VectorType(element, lanes).as_pointer()
            i64 = ir.IntType(64)
            values = []
            for bit, offset in enumerate((a_, b_, c_)):
                absent = builder.icmp_unsigned("!=", builder.and_(missing_, ir.Constant(i64, 1 << bit)),
                                               ir.Constant(i64, 0))
                # the row's start chosen first, then stepped to j: the choice is the same for every
                # vector of a row, and LLVM takes it out of the row's loop (chosen per vector, it
                # was two address computations and a select per load)
                start = builder.select(absent, padding_arr.data, builder.gep(source_arr.data, [offset]))
                row = builder.gep(start, [j_])
                values.append(builder.load(builder.bitcast(row, pointer), align=size))
            value = _combine3(builder, how, *values)
            target = builder.bitcast(builder.gep(down_arr.data, [builder.add(at_, j_)]), pointer)
            builder.store(value, target, align=size)
            return context.get_dummy_value()

        return signature, codegen

    return fold


def _along_vector(how: int, narrow: bool = False) -> Any:
    """An intrinsic ``along(down, dst, row, base, o)``: ``dst[base + o + i] = (D[2(o + i)] ⊕
    D[2(o + i) + 1]) ⊕ D[2(o + i) + 2]`` for the ``i`` < one vector's lanes (half a vector's:
    ``narrow``), ``D`` the row of ``down`` from offset ``row`` (holding at least ``2·o +
    2·lanes + 1`` values)."""

    @intrinsic
    def along(typingctx: Any, down: Any, dst: Any, row: Any, base: Any, o: Any) -> Any:
        if not (isinstance(down, types.Array) and isinstance(dst, types.Array) and down.dtype == dst.dtype
                and down.layout == "C" and dst.layout == "C" and down.ndim == dst.ndim == 1):
            return None
        signature = types.void(down, dst, row, base, o)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            down_arr, dst_arr = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1))
            row_, base_, o_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3, 4))
            element, size, lanes = _lanes(context, sig.args[0].dtype, narrow)
            vector = ir.VectorType(element, lanes)
            picks = ir.VectorType(ir.IntType(32), lanes)

            def load(index: Any) -> Any:
                return builder.load(builder.bitcast(builder.gep(down_arr.data, [index]), vector.as_pointer()),
                                    align=size)
            start = builder.add(row_, builder.mul(o_, ir.Constant(ir.IntType(64), 2)))
            low = load(start)
            high = load(builder.add(start, ir.Constant(ir.IntType(64), lanes)))
            even = builder.shuffle_vector(low, high, ir.Constant(picks, [2 * i for i in range(lanes)]))
            odd = builder.shuffle_vector(low, high, ir.Constant(picks, [2 * i + 1 for i in range(lanes)]))
            # the even columns one further along: this block's from the second on, then the next block's first
            after = builder.insert_element(ir.Constant(vector, ir.Undefined),
                                           builder.load(builder.gep(down_arr.data, [builder.add(
                                               start, ir.Constant(ir.IntType(64), 2 * lanes))]), align=size),
                                           ir.Constant(ir.IntType(32), 0))
            shifted = builder.shuffle_vector(even, after, ir.Constant(picks, list(range(1, lanes + 1))))
            value = _combine3(builder, how, even, odd, shifted)
            builder.store(value, builder.bitcast(builder.gep(dst_arr.data, [builder.add(base_, o_)]),
                                                 vector.as_pointer()), align=size)
            return context.get_dummy_value()

        return signature, codegen

    return along


#: Values of the rows `_three_by_two_loop` combines down before it combines them along (32 KiB
#: of float32: they stay in L1 for the second pass).
DOWN_BLOCK_VALUES = 8192


def _three_by_two_loop(how: int) -> Any:
    """The loop of `max_three_by_two` (``how`` `MAX`) or `sum_three_by_two` (`SUM`, ``neutral``
    0), its vector intrinsics called directly: through an `inline` helper that took the arrays and
    dispatched on ``how`` and ``narrow``, numba counted a reference to each array around every
    vector, four calls into its runtime (and the vector registers saved around them) a vector:
    one core, 192 planes of 56x56 158 -> 90 µs, SqueezeNet's 256 of 27x27 87 -> 45. The rows go
    down in blocks (`DOWN_BLOCK_VALUES`), then along, rather than each row down and at once along
    (its vectors read just after they were stored), and the vectors of a row are counted once per
    call: SqueezeNet's 64 planes of 111x111 108 -> 90 µs, 128 of 55x55 61 -> 48, 256 of 27x27
    46 -> 28."""
    down_vector, down_half = _down_vector(how), _down_vector(how, narrow=True)
    along_vector, along_half = _along_vector(how), _along_vector(how, narrow=True)

    @inline
    def loop(x: np.ndarray, out: np.ndarray, p0: int, p1: int, top: int, left: int, neutral: float) -> None:
        _, h, wd = x.shape
        _, ho, wo = out.shape
        source, target = x.reshape(x.size), out.reshape(out.size)
        lanes = VECTOR_BYTES // x.itemsize
        half = lanes // 2
        # a block of rows combined down, each padded (room for a vector of outputs' reads: 2·wo + 1
        # values) to whole vectors, the input's first column of each on a vector's boundary: the
        # down pass's stores never straddle two cache lines (with the row chosen once a row, in
        # `_down_vector`: 12-18% less time a pool, one core)
        stride = (max(left + wd, 2 * wo + 1) + 3 * lanes - 1) // lanes * lanes
        rows = max(1, min(ho, DOWN_BLOCK_VALUES // stride))
        room = np.full(rows * stride + lanes, neutral, x.dtype)
        first = np.int64(room.ctypes.data) // x.itemsize + left  # (in elements: itemsize-aligned)
        skip = (lanes - first % lanes) % lanes
        down = room[skip:skip + rows * stride]
        # whole vectors before a row's last one (which overlaps them): counted once, not by a
        # stepped range in each row (its trip count a division)
        down_vectors, along_vectors = (wd - 1) // lanes, (wo - 1) // lanes
        padding = np.full(wd, neutral, x.dtype)  # a window's row above or below the map
        for p in range(p0, p1):
            for r0 in range(0, ho, rows):
                r1 = min(ho, r0 + rows)
                for oh in range(r0, r1):  # down: every row of the block first
                    at = (oh - r0) * stride + left
                    first = (p * h + 2 * oh - top) * wd  # (the window's first row, perhaps above the map)
                    missing = 0
                    for i in range(3):
                        if not 0 <= 2 * oh - top + i < h:
                            missing |= 1 << i
                    if missing == 7:  # (the window wholly in the padding)
                        for j in range(wd):
                            down[_U(at + j)] = neutral
                    elif wd >= lanes:  # whole vectors, the last one overlapping the one before
                        for v in range(down_vectors):
                            down_vector(down, at, source, padding, first, first + wd, first + 2 * wd, missing,
                                        v * lanes)
                        down_vector(down, at, source, padding, first, first + wd, first + 2 * wd, missing, wd - lanes)
                    elif wd >= half:
                        down_half(down, at, source, padding, first, first + wd, first + 2 * wd, missing, 0)
                        down_half(down, at, source, padding, first, first + wd, first + 2 * wd, missing, wd - half)
                    else:
                        for j in range(wd):
                            a = padding[_U(j)] if missing & 1 else source[_U(first + j)]
                            b = padding[_U(j)] if missing & 2 else source[_U(first + wd + j)]
                            c = padding[_U(j)] if missing & 4 else source[_U(first + 2 * wd + j)]
                            down[_U(at + j)] = _fold(_fold(a, b, how), c, how)
                for oh in range(r0, r1):  # then along: its rows stored long before they are read
                    base = (p * ho + oh) * wo
                    row = (oh - r0) * stride
                    if wo >= lanes:  # (as above: outputs are stored, never accumulated)
                        for v in range(along_vectors):
                            along_vector(down, target, row, base, v * lanes)
                        along_vector(down, target, row, base, wo - lanes)
                    elif wo >= half:
                        along_half(down, target, row, base, 0)
                        along_half(down, target, row, base, wo - half)
                    else:
                        for ow in range(wo):
                            k = _U(row + 2 * ow)
                            target[_U(base + ow)] = _fold(_fold(down[k], down[k + _U(1)], how), down[k + _U(2)], how)

    return loop


_max_three_by_two, _sum_three_by_two = _three_by_two_loop(MAX), _three_by_two_loop(SUM)


@kernel
def max_three_by_two(x: np.ndarray, out: np.ndarray, p0: int, p1: int, top: int, left: int, lowest: float) -> None:
    """Planes ``p0:p1`` of ``out`` (P, Ho, Wo) = the max over each 3x3 window at stride 2 of ``x``
    (P, H, W), ``top`` and ``left`` rows and columns of padding before it (pads never win: they
    hold ``lowest``). C-contiguous float arrays."""
    _max_three_by_two(x, out, p0, p1, top, left, lowest)


@kernel
def sum_three_by_two(x: np.ndarray, out: np.ndarray, p0: int, p1: int, top: int, left: int) -> None:
    """Planes ``p0:p1`` of ``out`` (P, Ho, Wo) = the sum over each 3x3 window at stride 2 of ``x``
    (P, H, W), the pads' zeros in it (an AveragePool divides it)."""
    _sum_three_by_two(x, out, p0, p1, top, left, 0.0)


#: Values a block of `three_by_one` takes: whole planes (at least one), so that each flat pass
#: is one vector loop over several small planes while the block (input, row sums, output) stays
#: in L1.
THREE_BY_ONE_BLOCK = 2048
# A position's neighbours inside its plane (`_three_by_one`'s flags): above, below, left, right.
_ABOVE, _BELOW, _LEFT, _RIGHT = 1, 2, 4, 8


@inline
def _down_at(src: np.ndarray, k: int, w: int, flags: np.ndarray) -> float:
    """The sum down one window's rows at ``k`` of a block, a pad (above or below the plane) as
    ``0 +`` or ``+ 0``."""
    zero = src.dtype.type(0.0)
    f = flags[k]
    a = src[k - w] if f & _ABOVE else zero
    c = src[k + w] if f & _BELOW else zero
    return (a + src[k]) + c


@inline
def _plane_flags(h: int, w: int, group: int, mean: bool, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """Each position's neighbours inside its plane (`_ABOVE`...), and with ``mean`` how many
    values its 3x3 window holds inside the map: one plane's, repeated over a block of ``group``."""
    n = h * w
    flags = np.empty(group * n, np.uint8)
    divisors = np.empty(group * n if mean else 0, dtype)
    for r in range(h):
        for j in range(w):
            flags[r * w + j] = ((_ABOVE if r > 0 else 0) | (_BELOW if r < h - 1 else 0) | (_LEFT if j > 0 else 0)
                                | (_RIGHT if j < w - 1 else 0))
            if mean:
                divisors[r * w + j] = (min(r + 1, h - 1) - max(r - 1, 0) + 1) * (min(j + 1, w - 1) - max(j - 1, 0) + 1)
    for k in range(n, group * n):
        flags[k] = flags[k - n]
        if mean:
            divisors[k] = divisors[k - n]
    return flags, divisors


@inline
def _sum_block(src: np.ndarray, dst: np.ndarray, down: np.ndarray, flags: np.ndarray, divisors: np.ndarray, w: int,
               mean: bool) -> None:
    """``dst`` = the 3x3/1 sums (with ``mean``, means) of the block of whole planes ``src``, a pad
    of one all round, in two flat passes (`sum_three_by_one`)."""
    m = src.shape[0]
    zero = src.dtype.type(0.0)
    # down the rows: one loop over the block, whose reads across a plane's top or bottom (into
    # the plane beside it) a select drops; the block's first and last rows read only inside it
    inner_end = max(w, m - w)
    for k in range(min(w, m)):
        down[k] = _down_at(src, k, w, flags)
    for k in range(_U(w), _U(inner_end)):
        up, below = src[k - _U(w)], src[k + _U(w)]
        f = flags[k]
        down[k] = ((up if f & _ABOVE else zero) + src[k]) + (below if f & _BELOW else zero)
    for k in range(inner_end, m):
        down[k] = _down_at(src, k, w, flags)
    # along each row, the same way: the block's first and last values alone
    f = flags[0]
    dst[0] = (zero + down[0]) + (down[1] if f & _RIGHT else zero)
    for k in range(_U(1), _U(m - 1)):
        left, right = down[k - _U(1)], down[k + _U(1)]
        f = flags[k]
        dst[k] = ((left if f & _LEFT else zero) + down[k]) + (right if f & _RIGHT else zero)
    if m > 1:
        f = flags[m - 1]
        dst[m - 1] = ((down[m - 2] if f & _LEFT else zero) + down[m - 1]) + zero
    if mean:
        for k in range(m):
            dst[k] = dst[k] / divisors[k]


@inline
def _max3(a: float, b: float, c: float) -> float:
    """``np.maximum(np.maximum(a, b), c)``: a NaN in any of them gives NaN (the first select keeps
    a NaN ``b``, the second a NaN of the first's, and ``a + c`` is NaN where ``a`` or ``c`` is)."""
    t = a if a > b else b
    m = c if c > t else t
    return a + c if a != a or c != c else m


@inline
def _max_down_at(src: np.ndarray, k: int, w: int, flags: np.ndarray) -> float:
    """The max down one window's rows at ``k`` of a block, a row above or below the plane left out
    (the value itself in its place)."""
    f = flags[k]
    here = src[k]
    return _max3(src[k - w] if f & _ABOVE else here, here, src[k + w] if f & _BELOW else here)


@inline
def _max_block(src: np.ndarray, dst: np.ndarray, down: np.ndarray, flags: np.ndarray, w: int) -> None:
    """``dst`` = the 3x3/1 maxima of the block of whole planes ``src`` (`max_three_by_one`)."""
    m = src.shape[0]
    inner_end = max(w, m - w)  # (the block's first and last rows read only inside it)
    for k in range(min(w, m)):
        down[k] = _max_down_at(src, k, w, flags)
    for k in range(_U(w), _U(inner_end)):
        here, f = src[k], flags[k]
        down[k] = _max3(src[k - _U(w)] if f & _ABOVE else here, here, src[k + _U(w)] if f & _BELOW else here)
    for k in range(inner_end, m):
        down[k] = _max_down_at(src, k, w, flags)
    dst[0] = _max3(down[0], down[0], down[1] if flags[0] & _RIGHT else down[0])
    for k in range(_U(1), _U(m - 1)):
        here, f = down[k], flags[k]
        dst[k] = _max3(down[k - _U(1)] if f & _LEFT else here, here, down[k + _U(1)] if f & _RIGHT else here)
    if m > 1:
        here = down[m - 1]
        dst[m - 1] = _max3(down[m - 2] if flags[m - 1] & _LEFT else here, here, here)


#: What `_three_by_one` computes in each window: the max, the sum, the mean over the values inside the map.
MAX_OF_THREE, SUM_OF_THREE, MEAN_OF_THREE = 0, 1, 2
#: Planes this wide or wider take `_three_block` (a flat pass with no test per value, the edges
#: written over after it); narrower ones the passes with a select by each position's flags
#: (`_sum_block`, `_max_block`), whose work does not grow with the edges. One core, 256 x 28x28
#: sum 70 -> 45 µs, mean 107 -> 83, max 89 -> 61; 576 x 14x14 36 -> 31, 57 -> 52, 47 -> 39;
#: 1024 x 7x7 17 -> 22, 27 -> 31, 22 -> 27 (two of every seven values an edge).
EDGES_AFTER_MIN_WIDTH = 14


@inline
def _fold3(a: float, b: float, c: float, how: int) -> float:
    """``(a + b) + c``, or the NaN-exact `_max3` (``how`` the same all through a call)."""
    return _max3(a, b, c) if how == MAX_OF_THREE else (a + b) + c


@inline
def _three_block(src: np.ndarray, dst: np.ndarray, down: np.ndarray, divisors: np.ndarray, h: int, w: int,
                 how: int) -> None:
    """``dst`` = ``how`` over the 3x3/1 windows of the block of whole ``h x w`` planes ``src``, a
    pad of one all round: down the window's rows, then along, each pass one flat loop over the
    whole block as if it were one tall plane (no test per value: LLVM's vector loop), then the
    values whose window crosses a plane's top or bottom, or a row's ends, written over. A
    neighbour outside the plane is a zero for a sum (``0 +``, ``+ 0``: the sums of
    `pool.flat_pool`), the value itself for a max (the max's neutral there). A mean divides each sum
    by ``divisors`` (its window's count) as it stores it."""
    m = src.shape[0]
    zero = src.dtype.type(0.0)
    summing = how != MAX_OF_THREE
    for k in range(_U(w), _U(max(w, m - w))):
        down[k] = _fold3(src[k - _U(w)], src[k], src[k + _U(w)], how)
    uw = _U(w)
    for base in range(_U(0), _U(m), _U(h * w)):  # each plane's first and last row (unsigned: no wraparound test)
        for k in range(base, base + uw):
            here = src[k]
            below = src[k + uw] if h > 1 else (zero if summing else here)
            down[k] = _fold3(zero if summing else here, here, below, how)
        if h > 1:
            last = base + _U((h - 1) * w)
            for k in range(last, last + uw):
                here = src[k]
                down[k] = _fold3(src[k - uw], here, zero if summing else here, how)
    mean = how == MEAN_OF_THREE
    for k in range(_U(1), _U(max(1, m - 1))):
        value = _fold3(down[k - _U(1)], down[k], down[k + _U(1)], how)
        dst[k] = value / divisors[k] if mean else value
    for k0 in range(_U(0), _U(m), uw):  # each row's first and last value
        here = down[k0]
        value = _fold3(zero if summing else here, here, down[k0 + _U(1)] if w > 1 else (zero if summing else here),
                       how)
        dst[k0] = value / divisors[k0] if mean else value
        if w > 1:
            k1 = k0 + uw - _U(1)
            here = down[k1]
            value = _fold3(down[k1 - _U(1)], here, zero if summing else here, how)
            dst[k1] = value / divisors[k1] if mean else value


@inline
def _three_by_one(x: np.ndarray, out: np.ndarray, p0: int, p1: int, how: int) -> None:
    """Planes ``p0:p1`` of ``out`` (P, H, W) = ``how`` over the 3x3/1 windows of ``x`` (P, H, W), a
    pad of one all round, in two flat passes over each block of whole planes."""
    _, h, w = x.shape
    n = h * w
    group = max(1, min(THREE_BY_ONE_BLOCK // n, p1 - p0))  # planes a block
    down = np.empty(group * n, x.dtype)
    flags, divisors = _plane_flags(h, w, group, how == MEAN_OF_THREE, x.dtype)
    flat_x, flat_out = x.reshape(x.size), out.reshape(out.size)
    for b0 in range(p0, p1, group):
        m = min(group, p1 - b0) * n
        src, dst = flat_x[b0 * n:b0 * n + m], flat_out[b0 * n:b0 * n + m]
        if w >= EDGES_AFTER_MIN_WIDTH:
            _three_block(src, dst, down, divisors, h, w, how)
        elif how == MAX_OF_THREE:
            _max_block(src, dst, down, flags, w)
        else:
            _sum_block(src, dst, down, flags, divisors, w, how == MEAN_OF_THREE)


@kernel
def max_three_by_one(x: np.ndarray, out: np.ndarray, p0: int, p1: int) -> None:
    """Planes ``p0:p1`` of ``out`` (P, H, W) = the max over each 3x3 window of ``x`` (P, H, W), a pad
    of one all round (pads never win), stride 1, NaN-exact as ``np.maximum``: the two flat passes
    of `sum_three_by_one` over blocks of whole planes, a neighbour outside the plane replaced by
    the value itself (the max's neutral there), where the general flat loop (`pool.flat_pool`)
    copied each plane into a padded one first. One core, 1024 planes of 7x7 (Inception-v2's last
    pool): 53 -> 12 µs, 576 of 14x14 67 -> 29."""
    _three_by_one(x, out, p0, p1, MAX_OF_THREE)


@kernel
def sum_three_by_one(x: np.ndarray, out: np.ndarray, p0: int, p1: int) -> None:
    """Planes ``p0:p1`` of ``out`` (P, H, W) = the sum over each 3x3 window of ``x`` (P, H, W), a
    pad of one (zeros) all round, stride 1: the sums of `pool.flat_pool` (down the window's rows,
    then along, in window order, a pad taken as ``0 +`` or ``+ 0``: the same bits) in two flat
    passes over a block of whole planes at a time (`THREE_BY_ONE_BLOCK` values). A block stays in
    L1, and each pass is one loop over all of it, which LLVM vectorises where a plane's own loop
    (49 values of a 7x7 plane) ran value by value: a select by each position's flags drops the
    values across a plane's top or bottom and a row's ends (pads: ``0 +``, ``+ 0``). One core,
    1024 planes of 7x7: 75 -> 31 µs (the sums at the edges written over after each pass), -> 11
    (the selects). From `EDGES_AFTER_MIN_WIDTH` columns the edges are a small share of the values,
    and each pass has no test per value, the edges written over after it (`_three_block`).
    (Indices are unsigned: a signed ``k - w`` costs a wraparound test that stops the vectorising,
    or gathers and scatters in its place.)"""
    _three_by_one(x, out, p0, p1, SUM_OF_THREE)


@kernel
def mean_three_by_one(x: np.ndarray, out: np.ndarray, p0: int, p1: int) -> None:
    """`sum_three_by_one` divided by each window's count of values inside the map (an
    AveragePool's ``count_include_pad=0``), in the same block: each sum divided by the count as
    a float of the input's type, the bits of the sums then ``/=`` the counts' array."""
    _three_by_one(x, out, p0, p1, MEAN_OF_THREE)
