"""2-D max and sum pooling on NCHW planes, separably: along rows, then down columns (a sum pool is
AveragePool before its division, `pool.AveragePool`).

As NumPy passes (`pool.MaxPool`'s separable reduction) a 3x3/2 max pool pads the map, then takes
four whole-array maxima: ResNet's first pool (64 channels at 112x112) ran 1.7 ms. Here each plane
is reduced along its rows into a small scratch (one value per input row and output column), then
down its columns into the output: kh + kw maxima per output instead of kh·kw, every loop in L1,
the input read in place (at stride 2 across, each row is first split into its even and odd
columns, so that every tap reads a contiguous run: 0.92 -> 0.48 ms on that pool). A tap only
visits the output columns whose input column lies inside the image, and rows outside it are
skipped: pads never win a max.

When the windows tile the map (kernel = stride, no padding, no dilation: the 2x2/2 pool of most
small CNNs), `max_pool_tiles` takes each window's rows down, then its columns along, with no
per-row set-up: 3-7x faster than the separable loop from 8x8 to 112x112 maps (128 planes of 8x8:
37 -> 5.5 µs).

`flat_pool` is for small maps and unit strides. The loops above walk each plane row by row: on a
14x14 or 7x7 map every row is a loop of 7-14 values, too short for LLVM's vector loop (it runs
64 values an iteration), so they ran one value at a time: Inception-v2's 3x3/1 average pool of
576 x 14x14 took 213 µs on 2 cores, ONNX Runtime's 34. Here a block of planes is copied into a
buffer where each plane is padded to ``Hp x Wp`` with the neutral value (the type's lowest for a
max, 0 for a sum) and the planes lie end to end. Read flat as ``P``, the block takes a pool at
strides ``sh, sw`` and dilations ``dh, dw`` in kh + kw passes, each one loop over the whole block
that LLVM runs on vectors: down the window's rows, ``V[r] = ⊕_i P[r + i·dh·Wp]``, then along
them, ``O[r] = ⊕_j V[r + j·dw]``. Output ``(oh, ow)`` of a plane is ``O[oh·sh·Wp + ow·sw]``,
copied out; the values between (padded columns, rows and columns a stride skips) are computed in
vain, and no output's window crosses into the next plane. One thread, 576 x 14x14 3x3/1 319 ->
120 µs, 1024 x 7x7 239 -> 85. With nothing to pad (no pads, the last window inside the map:
SqueezeNet's 3x3/2 pools) the passes read the input itself, no copy (rows that run on into the
next plane are never read out): 256 x 27x27 114 -> 54 µs against the columns-first loop; at 111
columns the work in vain costs more than it saves. A max takes the one-instruction `_larger` and
redoes a block exactly when it read a NaN; a sum adds down the window's rows, then along (as
`pool2d_columns_first`), the pads' zeros in it.
"""
from __future__ import annotations

from typing import Any

import numba
import numpy as np

from ...concurrency.spin_team import ARGS, KIND, address_as_pointer, post_and_count_asleep
from . import inline, kernel
from .phases import phase_tap, split_even_odd
from .pool_folds import EXACT_MAX, LARGER, SUM, _fold, _max
from .pool_three import max_three_by_one, max_three_by_two, mean_three_by_one, sum_three_by_one, sum_three_by_two

#: The kind of a spin-team part of loop ``loop`` (`LOOP_RANGES`): ``FIRST_PART_KIND + loop``.
FIRST_PART_KIND = 17
#: The loops: `pool2d` (rows first), `pool2d_columns_first`, `pool_tiles`, `flat_pool`, and the
#: 3x3/2 pool's, the 3x3/1 sum's, the 3x3/1 mean's over the values inside the map and the 3x3/1
#: max's (`pool_three`).
ROWS_FIRST, COLUMNS_FIRST, TILES, FLAT, THREE_BY_TWO, THREE_BY_ONE_SUM, THREE_BY_ONE_MEAN, THREE_BY_ONE_MAX = range(8)

_U = np.uint64


@inline
def _combine(r: float, v: float, summing: bool) -> float:
    """``r + v`` for a sum pool, else `_max` (``summing`` is the same all through a call: LLVM
    takes the branch out of the loops)."""
    return r + v if summing else _max(r, v)


@kernel
def pool2d(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int,
           dh: int, dw: int, top: int, left: int, lowest: float, summing: bool) -> None:
    """Planes ``p0:p1`` of ``out`` (P, Ho, Wo) = the max (or with ``summing`` the sum) over each
    window of ``x`` (P, H, W); a window wholly in the padding gives ``lowest`` (0 for sums)."""
    _, h, wd = x.shape
    _, ho, wo = out.shape
    rows = np.empty((h, wo), x.dtype)  # the row maxima of one plane
    phases = np.empty((2, (wd + 1) // 2), x.dtype)  # at stride 2 across: a row's even and odd columns
    for p in range(p0, p1):
        for ih in range(h):
            src = x[p, ih]
            dst = rows[ih]
            for ow in range(wo):
                dst[_U(ow)] = lowest
            if sw == 2 and dw == 1:  # contiguous runs of each phase instead of strided loads
                split_even_odd(src, phases[0], phases[1])
                for j in range(kw):
                    parity, q, lo, hi = phase_tap(j - left, wd, wo)
                    run = phases[parity]
                    for ow in range(lo, hi):
                        dst[_U(ow)] = _combine(dst[_U(ow)], run[_U(ow + q)], summing)
                continue
            for j in range(kw):
                shift = j * dw - left
                lo = 0 if shift >= 0 else (sw - 1 - shift) // sw
                hi = min(wo, (wd - 1 - shift) // sw + 1)
                if sw == 1:
                    for ow in range(lo, hi):
                        dst[_U(ow)] = _combine(dst[_U(ow)], src[_U(ow + shift)], summing)
                else:
                    for ow in range(lo, hi):
                        dst[_U(ow)] = _combine(dst[_U(ow)], src[_U(ow * sw + shift)], summing)
        for oh in range(ho):
            row = out[p, oh]
            for ow in range(wo):
                row[_U(ow)] = lowest
            for i in range(kh):
                ih = oh * sh + i * dh - top
                if ih < 0 or ih >= h:
                    continue
                src = rows[ih]
                for ow in range(wo):
                    row[_U(ow)] = _combine(row[_U(ow)], src[_U(ow)], summing)


@kernel
def pool_tiles(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, summing: bool) -> None:
    """Planes ``p0:p1`` of ``out`` (P, Ho, Wo) = the max (or sum) over each ``kh x kw`` tile of ``x``
    (P, H, W), tiles laid edge to edge from the top left (rows and columns past the last whole
    tile are not read)."""
    _, h, width = x.shape
    _, ho, wo = out.shape
    w = wo * kw
    # flat offsets, not row views: a view costs a reference count's update, two runtime calls, and
    # each row of tiles made three (one core, 512 planes of 28x28 2x2 sums: 76 -> 69 µs)
    source, target = x.reshape(x.size), out.reshape(out.size)
    down_columns = np.empty(w, x.dtype)  # one row of tiles: the max (or sum) down each column
    for p in range(p0, p1):
        for oh in range(ho):
            top = (p * h + oh * kh) * width
            for c in range(w):
                down_columns[_U(c)] = source[_U(top + c)]
            for i in range(1, kh):
                row = top + i * width
                for c in range(w):
                    down_columns[_U(c)] = _combine(down_columns[_U(c)], source[_U(row + c)], summing)
            base = (p * ho + oh) * wo
            if kw == 2:  # the common 2x2 tile: a loop LLVM vectorises as pairs
                for o in range(wo):
                    target[_U(base + o)] = _combine(down_columns[_U(2 * o)], down_columns[_U(2 * o + 1)], summing)
                continue
            for o in range(wo):
                m = down_columns[_U(o * kw)]
                for j in range(1, kw):
                    m = _combine(m, down_columns[_U(o * kw + j)], summing)
                target[_U(base + o)] = m


@inline
def _down_rows(x: np.ndarray, p: int, rows: np.ndarray, n: int, down: np.ndarray, at: int, how: int) -> bool:
    """``down[at:at + W]`` = the rows ``rows[:n]`` (n >= 1) of plane ``p`` combined down their
    columns, the first three in one pass; whether any value read was NaN (with ``how`` `LARGER`,
    the result is then not exact)."""
    width = x.shape[2]
    nan = False
    if n >= 3:
        a, b, c = x[p, rows[0]], x[p, rows[1]], x[p, rows[2]]
        for k in range(width):
            va, vb, vc = a[_U(k)], b[_U(k)], c[_U(k)]
            nan |= (va != va) | (vb != vb) | (vc != vc)
            down[_U(at + k)] = _fold(_fold(va, vb, how), vc, how)
        first = 3
    else:
        a = x[p, rows[0]]
        for k in range(width):
            va = a[_U(k)]
            nan |= va != va
            down[_U(at + k)] = va
        first = 1
    for i in range(first, n):
        a = x[p, rows[i]]
        for k in range(width):
            va = a[_U(k)]
            nan |= va != va
            down[_U(at + k)] = _fold(down[_U(at + k)], va, how)
    return nan


@inline
def _along_phases(even: np.ndarray, odd: np.ndarray, dst: np.ndarray, kw: int, how: int) -> None:
    """``dst[ow]`` = the taps ``D[2·ow + j]``, j < kw, of a padded row ``D`` split into its
    ``even`` and ``odd`` columns (``D[2q] = even[q]``, ``D[2q + 1] = odd[q]``): contiguous runs
    LLVM runs on vectors, where ``D[2·ow + j]`` itself is a strided load it does not."""
    wo = dst.shape[0]
    if kw == 3:
        for ow in range(wo):
            dst[_U(ow)] = _fold(_fold(even[_U(ow)], odd[_U(ow)], how), even[_U(ow + 1)], how)
    elif kw == 2:
        for ow in range(wo):
            dst[_U(ow)] = _fold(even[_U(ow)], odd[_U(ow)], how)
    else:
        for ow in range(wo):
            dst[_U(ow)] = even[_U(ow)]
        for j in range(1, kw):
            run = odd if j % 2 else even
            for ow in range(wo):
                dst[_U(ow)] = _fold(dst[_U(ow)], run[_U(ow + j // 2)], how)


@inline
def _along(down: np.ndarray, dst: np.ndarray, kw: int, sw: int, dw: int, how: int) -> None:
    """``dst[ow]`` = the taps ``down[ow·sw + j·dw]``, j < kw (any strides: a pass per tap)."""
    wo = dst.shape[0]
    for ow in range(wo):
        dst[_U(ow)] = down[_U(ow * sw)]
    for j in range(1, kw):
        for ow in range(wo):
            dst[_U(ow)] = _fold(dst[_U(ow)], down[_U(ow * sw + j * dw)], how)


@inline
def _along_row(down: np.ndarray, even: np.ndarray, odd: np.ndarray, dst: np.ndarray, kw: int, sw: int, dw: int,
               how: int) -> None:
    """``dst[ow]`` = the taps ``down[ow·sw + j·dw]``, j < kw, of the padded row ``down``; at
    stride 2 across, through its even and odd columns (`_along_phases`)."""
    if sw == 2 and dw == 1:
        split_even_odd(down, even, odd)
        _along_phases(even, odd, dst, kw, how)
    else:
        _along(down, dst, kw, sw, dw, how)


@inline
def _columns_first(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int,
                   dh: int, dw: int, top: int, left: int, lowest: float, how: int) -> None:
    """The body of `pool2d_columns_first` for a sum (``how`` `SUM`) or a max (`LARGER`, each
    output row redone with `EXACT_MAX` when its input rows hold a NaN)."""
    _, h, wd = x.shape
    _, ho, wo = out.shape
    span = max(left + wd, (wo - 1) * sw + (kw - 1) * dw + 1)  # the padded row the taps read
    half = span // 2 + 1
    down = np.full(2 * half, lowest, x.dtype)  # pads stay ``lowest``: each row writes the same middle
    even = np.empty(half, x.dtype)
    odd = np.empty(half, x.dtype)
    rows = np.empty(kh, np.int64)
    for p in range(p0, p1):
        for oh in range(ho):
            dst = out[p, oh]
            n = 0
            for i in range(kh):
                ih = oh * sh + i * dh - top
                if 0 <= ih < h:
                    rows[n] = ih
                    n += 1
            if n == 0:  # every window row in the padding
                for ow in range(wo):
                    dst[_U(ow)] = lowest
            elif how == SUM:
                _down_rows(x, p, rows, n, down, left, SUM)
                _along_row(down, even, odd, dst, kw, sw, dw, SUM)
            elif _down_rows(x, p, rows, n, down, left, LARGER):
                _down_rows(x, p, rows, n, down, left, EXACT_MAX)
                _along_row(down, even, odd, dst, kw, sw, dw, EXACT_MAX)
            else:
                _along_row(down, even, odd, dst, kw, sw, dw, LARGER)


@kernel
def _max_columns_first(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int,
                       dh: int, dw: int, top: int, left: int, lowest: float) -> None:
    """`pool2d_columns_first` of a max (a kernel of its own: the sum's loops beside it in one
    function slowed this one's by a sixth)."""
    _columns_first(x, out, p0, p1, kh, kw, sh, sw, dh, dw, top, left, lowest, LARGER)


@kernel
def _sum_columns_first(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int,
                       dh: int, dw: int, top: int, left: int) -> None:
    """`pool2d_columns_first` of a sum."""
    _columns_first(x, out, p0, p1, kh, kw, sh, sw, dh, dw, top, left, 0.0, SUM)


@kernel
def pool2d_columns_first(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int,
                         dh: int, dw: int, top: int, left: int, lowest: float, summing: bool) -> None:
    """`pool2d` the other way round, for vertical strides above one: per output row, the window's
    input rows combined down their columns first (the first three in one pass over long
    contiguous runs), into a row padded with ``lowest`` (0 for sums) on both sides, then along
    that row. At stride 2 across, the padded row is split into its even and odd columns, so every
    tap reads a contiguous run and the taps go in one pass (`_along_phases`). A max takes the
    one-instruction `_larger` unless a NaN was read, then the exact `_max`. SqueezeNet's 3x3/2
    pool of 64 x 111x111 on one core: 293 -> 180 µs."""
    if summing:
        _sum_columns_first(x, out, p0, p1, kh, kw, sh, sw, dh, dw, top, left)
    else:
        _max_columns_first(x, out, p0, p1, kh, kw, sh, sw, dh, dw, top, left, lowest)


#: Floats of padded planes a block of `flat_pool` holds (its three buffers then stay in L2).
FLAT_BLOCK_FLOATS = 16384


@inline
def _padded_geometry(h: int, w: int, ho: int, wo: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int,
                     top: int, left: int) -> tuple[int, int]:
    """``Hp, Wp``: as tall and wide as the input with its leading pads and as the last window's
    reach."""
    wp = max(left + w, (wo - 1) * sw + (kw - 1) * dw + 1)
    hp = max(top + h, (ho - 1) * sh + (kh - 1) * dh + 1)
    return hp, wp


@inline
def _flat_passes(source: np.ndarray, base: int, down_count: int, count: int, down: np.ndarray, along: np.ndarray,
                 kh: int, kw: int, dh: int, dw: int, wp: int, how: int) -> bool:
    """`flat_pool`'s kh + kw passes over planes laid end to end from ``source[base]`` (rows ``wp``
    wide): ``down[t]`` for ``t < down_count``, then ``along[t]`` for ``t < count``; whether a value
    read down was NaN (every value of the block is read there)."""
    nan = False
    rows_apart = dh * wp
    if kh == 3:  # (the common 3x3: one pass down)
        for t in range(down_count):
            a, b, c = source[_U(base + t)], source[_U(base + t + rows_apart)], source[_U(base + t + 2 * rows_apart)]
            nan |= (a != a) | (b != b) | (c != c)
            down[_U(t)] = _fold(_fold(a, b, how), c, how)
    else:
        for t in range(down_count):
            a = source[_U(base + t)]
            nan |= a != a
            down[_U(t)] = a
        for i in range(1, kh):
            shift = base + i * rows_apart
            for t in range(down_count):
                a = source[_U(shift + t)]
                nan |= a != a
                down[_U(t)] = _fold(down[_U(t)], a, how)
    if kw == 3:  # (one pass along)
        for t in range(count):
            along[_U(t)] = _fold(_fold(down[_U(t)], down[_U(t + dw)], how), down[_U(t + 2 * dw)], how)
        return nan
    for t in range(count):
        along[_U(t)] = down[_U(t)]
    for j in range(1, kw):
        shift = j * dw
        for t in range(count):
            along[_U(t)] = _fold(along[_U(t)], down[_U(t + shift)], how)
    return nan


@inline
def _flat_block(source: np.ndarray, base: int, down_count: int, count: int, down: np.ndarray, along: np.ndarray,
                kh: int, kw: int, dh: int, dw: int, wp: int, summing: bool) -> None:
    """`_flat_passes` of a sum, or of a max on the one-instruction `_larger`, again exactly when
    the block holds a NaN."""
    if summing:
        _flat_passes(source, base, down_count, count, down, along, kh, kw, dh, dw, wp, SUM)
    elif _flat_passes(source, base, down_count, count, down, along, kh, kw, dh, dw, wp, LARGER):
        _flat_passes(source, base, down_count, count, down, along, kh, kw, dh, dw, wp, EXACT_MAX)


@kernel
def flat_pool(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int, dh: int,
              dw: int, top: int, left: int, fill: float, summing: bool) -> None:
    """Planes ``p0:p1`` of ``out`` (P, Ho, Wo) = the max (or with ``summing`` the sum) over each
    window of ``x`` (P, H, W), pads being ``fill`` (the max's neutral value, or 0 for a sum), as
    long passes over blocks of padded planes laid end to end (see the module docstring). Where
    there are no pads and the windows end inside the map, the passes read the input itself (no
    padded copy): rows that reach into the next plane are never read out."""
    _, h, w = x.shape
    _, ho, wo = out.shape
    hp, wp = _padded_geometry(h, w, ho, wo, kh, kw, sh, sw, dh, dw, top, left)
    in_place = top == 0 and left == 0 and hp == h and wp == w
    plane = hp * wp
    chunk = max(1, FLAT_BLOCK_FLOATS // plane)
    span = chunk * plane
    # in a padded copy every pass reads a little past the block's last plane: the spare tail stays ``fill``
    reach = (kh - 1) * dh * wp + (kw - 1) * dw
    padded = np.full(0 if in_place else span + reach, fill, x.dtype)
    down = np.full(span + reach, fill, x.dtype)
    along = np.empty(span, x.dtype)
    flat_x = x.reshape(x.size)
    for c0 in range(p0, p1, chunk):
        planes = min(chunk, p1 - c0)
        n = planes * plane
        if in_place:  # the last window's rows and columns end inside the block: no pass reads past it
            down_count = n - (kh - 1) * dh * wp
            _flat_block(flat_x, c0 * plane, down_count, down_count - (kw - 1) * dw, down, along, kh, kw, dh, dw, wp,
                        summing)
        else:
            for k in range(planes):  # the input into its place in the padded planes
                source = (c0 + k) * h * w
                target = k * plane + top * wp + left
                for r in range(h):
                    for j in range(w):
                        padded[_U(target + j)] = flat_x[_U(source + j)]
                    source += w
                    target += wp
            _flat_block(padded, 0, n, n, down, along, kh, kw, dh, dw, wp, summing)
        for k in range(planes):  # the outputs out of the virtual grid, ``sh`` rows and ``sw`` apart
            for oh in range(ho):
                source = k * plane + oh * sh * wp
                row = out[c0 + k, oh]
                for ow in range(wo):
                    row[_U(ow)] = along[_U(source + sw * ow)]


@kernel
def tiles_range(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int, dh: int,
                dw: int, top: int, left: int, lowest: float, summing: bool) -> None:
    """`pool_tiles` with the arguments every loop's range takes (`LOOP_RANGES`)."""
    pool_tiles(x, out, p0, p1, kh, kw, summing)


@kernel
def three_by_two_range(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int,
                       dh: int, dw: int, top: int, left: int, lowest: float, summing: bool) -> None:
    """`sum_three_by_two` or `max_three_by_two`, with every loop's arguments (`LOOP_RANGES`)."""
    if summing:
        sum_three_by_two(x, out, p0, p1, top, left)
    else:
        max_three_by_two(x, out, p0, p1, top, left, lowest)


@kernel
def three_by_one_sum_range(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int,
                           dh: int, dw: int, top: int, left: int, lowest: float, summing: bool) -> None:
    """`sum_three_by_one` with every loop's arguments (`LOOP_RANGES`)."""
    sum_three_by_one(x, out, p0, p1)


@kernel
def three_by_one_mean_range(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int,
                            dh: int, dw: int, top: int, left: int, lowest: float, summing: bool) -> None:
    """`mean_three_by_one` with every loop's arguments (`LOOP_RANGES`)."""
    mean_three_by_one(x, out, p0, p1)


@kernel
def three_by_one_max_range(x: np.ndarray, out: np.ndarray, p0: int, p1: int, kh: int, kw: int, sh: int, sw: int,
                           dh: int, dw: int, top: int, left: int, lowest: float, summing: bool) -> None:
    """`max_three_by_one` with every loop's arguments (`LOOP_RANGES`)."""
    max_three_by_one(x, out, p0, p1)


#: Each loop's kernel over a range of planes, indexed by the loop (`ROWS_FIRST`...), all taking
#: ``(x, out, p0, p1, kh, kw, sh, sw, dh, dw, top, left, lowest, summing)`` (`TILES` reads only
#: ``kh, kw, summing`` of them, `THREE_BY_TWO` only ``top, left, lowest, summing``, the 3x3/1
#: ones none). One kernel a loop, not one that branches on the loop: that one compiled every
#: loop (46 s on an empty numba cache, a model's first run) where a model runs one or two.
LOOP_RANGES = (pool2d, pool2d_columns_first, tiles_range, flat_pool, three_by_two_range, three_by_one_sum_range,
               three_by_one_mean_range, three_by_one_max_range)


@kernel
def post_pool(control: np.ndarray, loop: int, x: np.ndarray, out: np.ndarray, cuts: np.ndarray,
              geometry: np.ndarray, lowest: np.ndarray, summing: bool) -> int:
    """Post planes ``cuts[i + 1]:cuts[i + 2]`` to helper ``i`` of a claimed team's ``control``, for
    `pool_part` to run as ``LOOP_RANGES[loop](x, out, p0, p1, *geometry, lowest[0], summing)`` on
    C-contiguous float32 ``x`` (P, H, W) and ``out`` (P, Ho, Wo) (``geometry``: kh, kw, sh, sw, dh,
    dw, top, left, int64; ``lowest`` a float64 array of one); how many of those helpers were
    asleep (the caller wakes them). The caller keeps the arrays alive until the parts are done."""
    sleeping = 0
    for i in range(cuts.shape[0] - 2):
        row = control[i]
        row[KIND] = FIRST_PART_KIND + loop
        at = ARGS
        row[at], row[at + 1], row[at + 2], row[at + 3] = loop, x.shape[0], x.shape[1], x.shape[2]
        row[at + 4], row[at + 5] = out.shape[1], out.shape[2]
        row[at + 6], row[at + 7], row[at + 8] = x.ctypes.data, out.ctypes.data, lowest.ctypes.data
        row[at + 9], row[at + 10] = cuts[i + 1], cuts[i + 2]
        for j in range(8):
            row[at + 11 + j] = geometry[j]
        row[at + 19] = 1 if summing else 0
        sleeping += post_and_count_asleep(row)
    return sleeping


@numba.njit(inline="always")
def pool_part(control: np.ndarray, loop_range: Any) -> None:
    """Run the part posted in a spin team's ``control`` row (`post_pool`) on ``loop_range``, the
    posted loop's `LOOP_RANGES` kernel: the helper's side (`team_parts`, a runner a loop)."""
    at = ARGS
    planes = control[at + 1]
    x = numba.carray(address_as_pointer(control[at + 6], np.float32), (planes, control[at + 2], control[at + 3]))
    out = numba.carray(address_as_pointer(control[at + 7], np.float32), (planes, control[at + 4], control[at + 5]))
    lowest = numba.carray(address_as_pointer(control[at + 8], np.float64), (1,))
    p = at + 9
    loop_range(x, out, control[p], control[p + 1], control[p + 2], control[p + 3], control[p + 4], control[p + 5],
               control[p + 6], control[p + 7], control[p + 8], control[p + 9], lowest[0], control[p + 10] != 0)
