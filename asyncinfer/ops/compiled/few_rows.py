"""A GEMM of a few rows by a large C-ordered matrix, reading the matrix once: ``y = a @ b``.

A decode step multiplies one row per stream (1 to 16) by every weight matrix of the model, so it
is bound by reading the weights, not by its multiply-adds. BLAS reads them once for one row (a
GEMV), but from two rows on it packs ``b`` into its own layout first: a copy of every weight per
step, measured 1.8 ms for 8 × 768 @ 768 × 3072 against 0.55 ms here (and 0.33 ms for one row).

The loop walks ``b`` row by row, eight rows at a time, adding them into a tile of ``y``'s columns
that stays in L1/L2; rows of ``a`` are taken four at a time, so each value of ``b`` loaded feeds
four rows (one row of ``a`` reads a narrow ``b`` one row at a time, see
`ONE_ROW_SEQUENTIAL_COLUMNS`). **Each row of y is summed in the same order whatever the number of rows** (and the
tiles never split a sum), so a stream's logits are the very bits of its solo run in any batch.
A caller splits the work along K (`linalg` does, across the pool): each part sums a block of
b's rows, and the parts' results are added in a fixed order.

From two rows on, a b also packed in column panels (a model's constant weight, `panels`) runs in
register blocks there instead, at the speed of reading b (8 x 768 @ 768 x 3072, two threads, cold:
390 -> 275 us, the one-row time); this row-wise loop keeps the columns past the last whole panel
and any b fed at run time.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import ARGS, KIND, address_as_pointer, addresses, post_and_count_asleep, wait_all
from . import kernel
from .panels import panel_product, panel_width
from .prefetch import prefetch_lines_for_read

_U = np.uint64
#: This kernel's kind of spin-team part (see `team_parts`).
PART_KIND = 0
#: Rows of b added per pass over a band of y by several rows of a (each pass loads the band once).
K_UNROLL = 8
#: Up to this width a one-row product reads b's rows one at a time (`_one_row_sequential`): y's
#: row stays in L1 and b is one sequential stream. Wider, the interleaved loop (8-16 rows of b a
#: pass over a tile of y) is the faster, cold and warm alike. One core, 2-core AMD EPYC VM, b out
#: of the cache (warm), µs, sequential (with its prefetch) -> interleaved: 768 x 3072 406 (134) ->
#: 204 (99), 768 x 2304 254 (97) -> 152 (79), 2048 x 2048 674 (264) -> 386 (210), 576 x 1024 93
#: (30) -> 71 (30), 768 x 768 77 (33) -> 64 (26); at 512 columns each wins one of 512 x 512 and
#: 2048 x 512 (2048 x 512 cold 97 against 117). OpenBLAS's sgemv on the weights row-major: 269,
#: 201, 455, 76, 76. (An earlier session's loops measured the boundary at 3072.)
ONE_ROW_SEQUENTIAL_COLUMNS = 512
#: How far ahead of the row of b it adds the sequential loop prefetches (whole rows, at least the
#: next): one stream alone leaves the hardware prefetcher too short a reach to cover the memory's
#: latency. One core, b cold, measured while these widths took that loop: 576 x 1024 100 -> 80
#: µs, 1024 x 1000 150 -> 117-140, 3072 x 768 367 -> 303, 768 x 768 110 -> 90; 4 and 16 KiB no
#: better.
AHEAD_BYTES = 8192
# Panel widths of posted parts (`few_rows_part` rebuilds the panels' shape from integers).
NARROW_PANEL, WIDE_PANEL = panel_width(np.float32), panel_width(np.float64)


@kernel
def few_rows_matmul(a: np.ndarray, b: np.ndarray, y: np.ndarray, k0: int, k1: int, tile: int,
                    panels: np.ndarray) -> None:
    """``y = a[:, k0:k1] @ b[k0:k1]``: ``a`` (m, k), ``b`` (k, n) and ``y`` (m, n) C-contiguous, one
    float dtype; ``tile`` columns of y at a time (``m * tile`` values should stay in L1/L2).
    ``panels``: b packed by `panels.pack_panels`, used from two rows on (else `panels.no_panels`)."""
    n = b.shape[1]
    if a.shape[0] == 1 and n <= ONE_ROW_SEQUENTIAL_COLUMNS:
        _one_row_sequential(a, b, y, k0, k1)
        return
    first = 0
    if a.shape[0] > 1 and panels.shape[0]:
        panel_product(a, panels, y, k0, k1)
        first = panels.shape[0] * panels.shape[2]
    for n0 in range(first, n, tile):
        if a.shape[0] == 1:
            _one_row_tile(a, b, y, k0, k1, n0, min(n0 + tile, n))
        else:
            _tile(a, b, y, k0, k1, n0, min(n0 + tile, n))


@kernel
def _one_row_sequential(a: np.ndarray, b: np.ndarray, y: np.ndarray, k0: int, k1: int) -> None:
    """`_one_row_tile` for a row of y that stays in L1 (``n <= ONE_ROW_SEQUENTIAL_COLUMNS``): b's
    rows one at a time, so b streams from memory in one sequential pass. The same sums, in the
    same order."""
    y0 = y[0]
    n = b.shape[1]
    for j in range(n):
        y0[_U(j)] = 0
    ahead = max(1, AHEAD_BYTES // (n * b.itemsize))
    for kk in range(k0, k1):
        p0 = a[0, kk]
        b0 = b[kk]
        if kk + ahead < k1:
            prefetch_lines_for_read(b, (kk + ahead) * n, n)
        for j in range(n):
            y0[_U(j)] = y0[_U(j)] + p0 * b0[_U(j)]


@kernel
def _one_row_tile(a: np.ndarray, b: np.ndarray, y: np.ndarray, k0: int, k1: int, n0: int, n1: int) -> None:
    """`_tile` for one row of a, eight rows of b per pass over the band (measured 5-10% faster than
    four on 768-wide bands). Its sums are `_tile`'s: one multiply-add after another along K,
    unrolled or not, so a stream alone has the bits it has in a batch."""
    y0 = y[0, n0:n1]
    w = n1 - n0
    for j in range(w):
        y0[_U(j)] = 0
    kk = k0
    while kk + 8 <= k1:
        # two passes of eight per round (sixteen rows of b in flight: 3-6% faster on 768-wide bands)
        for base in range(kk, kk + (16 if kk + 16 <= k1 else 8), 8):
            p0, p1, p2, p3 = a[0, base], a[0, base + 1], a[0, base + 2], a[0, base + 3]
            p4, p5, p6, p7 = a[0, base + 4], a[0, base + 5], a[0, base + 6], a[0, base + 7]
            b0, b1, b2, b3 = b[base, n0:n1], b[base + 1, n0:n1], b[base + 2, n0:n1], b[base + 3, n0:n1]
            b4, b5, b6, b7 = b[base + 4, n0:n1], b[base + 5, n0:n1], b[base + 6, n0:n1], b[base + 7, n0:n1]
            for j in range(w):
                y0[_U(j)] = (y0[_U(j)] + p0 * b0[_U(j)] + p1 * b1[_U(j)] + p2 * b2[_U(j)] + p3 * b3[_U(j)]
                             + p4 * b4[_U(j)] + p5 * b5[_U(j)] + p6 * b6[_U(j)] + p7 * b7[_U(j)])
        kk += 16 if kk + 16 <= k1 else 8
    while kk < k1:
        p0 = a[0, kk]
        b0 = b[kk, n0:n1]
        for j in range(w):
            y0[_U(j)] = y0[_U(j)] + p0 * b0[_U(j)]
        kk += 1


@kernel
def _tile(a: np.ndarray, b: np.ndarray, y: np.ndarray, k0: int, k1: int, n0: int, n1: int) -> None:
    """``y[:, n0:n1] = a[:, k0:k1] @ b[k0:k1, n0:n1]``: eight rows of b per pass over a band of
    y, shared by four rows of a (from two rows on, this loop is bound by the band's loads and
    stores, not by memory: eight rows of b per pass measured 15-20% faster than four, one
    core, 8 x 768 @ 768 x 3072 875 -> 684 us; two rows of a per pass were slower)."""
    m = a.shape[0]
    w = n1 - n0
    for r in range(m):
        y[r, n0:n1] = 0
    kk = k0
    while kk + K_UNROLL <= k1:
        b0, b1, b2, b3 = b[kk, n0:n1], b[kk + 1, n0:n1], b[kk + 2, n0:n1], b[kk + 3, n0:n1]
        b4, b5, b6, b7 = b[kk + 4, n0:n1], b[kk + 5, n0:n1], b[kk + 6, n0:n1], b[kk + 7, n0:n1]
        r = 0
        while r + 4 <= m:  # four rows of a share each load of b
            p0, p1, p2, p3 = a[r, kk], a[r, kk + 1], a[r, kk + 2], a[r, kk + 3]
            p4, p5, p6, p7 = a[r, kk + 4], a[r, kk + 5], a[r, kk + 6], a[r, kk + 7]
            q0, q1, q2, q3 = a[r + 1, kk], a[r + 1, kk + 1], a[r + 1, kk + 2], a[r + 1, kk + 3]
            q4, q5, q6, q7 = a[r + 1, kk + 4], a[r + 1, kk + 5], a[r + 1, kk + 6], a[r + 1, kk + 7]
            s0, s1, s2, s3 = a[r + 2, kk], a[r + 2, kk + 1], a[r + 2, kk + 2], a[r + 2, kk + 3]
            s4, s5, s6, s7 = a[r + 2, kk + 4], a[r + 2, kk + 5], a[r + 2, kk + 6], a[r + 2, kk + 7]
            t0, t1, t2, t3 = a[r + 3, kk], a[r + 3, kk + 1], a[r + 3, kk + 2], a[r + 3, kk + 3]
            t4, t5, t6, t7 = a[r + 3, kk + 4], a[r + 3, kk + 5], a[r + 3, kk + 6], a[r + 3, kk + 7]
            y0, y1, y2, y3 = y[r, n0:n1], y[r + 1, n0:n1], y[r + 2, n0:n1], y[r + 3, n0:n1]
            for j in range(w):
                c0, c1, c2, c3 = b0[_U(j)], b1[_U(j)], b2[_U(j)], b3[_U(j)]
                c4, c5, c6, c7 = b4[_U(j)], b5[_U(j)], b6[_U(j)], b7[_U(j)]
                y0[_U(j)] = (y0[_U(j)] + p0 * c0 + p1 * c1 + p2 * c2 + p3 * c3
                             + p4 * c4 + p5 * c5 + p6 * c6 + p7 * c7)
                y1[_U(j)] = (y1[_U(j)] + q0 * c0 + q1 * c1 + q2 * c2 + q3 * c3
                             + q4 * c4 + q5 * c5 + q6 * c6 + q7 * c7)
                y2[_U(j)] = (y2[_U(j)] + s0 * c0 + s1 * c1 + s2 * c2 + s3 * c3
                             + s4 * c4 + s5 * c5 + s6 * c6 + s7 * c7)
                y3[_U(j)] = (y3[_U(j)] + t0 * c0 + t1 * c1 + t2 * c2 + t3 * c3
                             + t4 * c4 + t5 * c5 + t6 * c6 + t7 * c7)
            r += 4
        while r < m:  # the same sum, one row at a time
            p0, p1, p2, p3 = a[r, kk], a[r, kk + 1], a[r, kk + 2], a[r, kk + 3]
            p4, p5, p6, p7 = a[r, kk + 4], a[r, kk + 5], a[r, kk + 6], a[r, kk + 7]
            y0 = y[r, n0:n1]
            for j in range(w):
                y0[_U(j)] = (y0[_U(j)] + p0 * b0[_U(j)] + p1 * b1[_U(j)] + p2 * b2[_U(j)] + p3 * b3[_U(j)]
                             + p4 * b4[_U(j)] + p5 * b5[_U(j)] + p6 * b6[_U(j)] + p7 * b7[_U(j)])
            r += 1
        kk += K_UNROLL
    while kk < k1:
        b0 = b[kk, n0:n1]
        for r in range(m):
            p0 = a[r, kk]
            y0 = y[r, n0:n1]
            for j in range(w):
                y0[_U(j)] = y0[_U(j)] + p0 * b0[_U(j)]
        kk += 1


@kernel
def few_rows_part(control: np.ndarray) -> None:
    """Run the `few_rows_matmul` part posted in a spin team's ``control`` row (by `post_parts` or
    `post_arguments`): the helper's side (a `team_parts` runner)."""
    m, k, n, k0, k1, tile, wide = control[ARGS:ARGS + 7]
    a_at, b_at, y_at, panels_at, count = control[ARGS + 7:ARGS + 12]
    if wide:
        few_rows_matmul(numba.carray(address_as_pointer(a_at, np.float64), (m, k)),
                        numba.carray(address_as_pointer(b_at, np.float64), (k, n)),
                        numba.carray(address_as_pointer(y_at, np.float64), (m, n)), k0, k1, tile,
                        numba.carray(address_as_pointer(panels_at, np.float64), (count, k, WIDE_PANEL)))
    else:
        few_rows_matmul(numba.carray(address_as_pointer(a_at, np.float32), (m, k)),
                        numba.carray(address_as_pointer(b_at, np.float32), (k, n)),
                        numba.carray(address_as_pointer(y_at, np.float32), (m, n)), k0, k1, tile,
                        numba.carray(address_as_pointer(panels_at, np.float32), (count, k, NARROW_PANEL)))


@kernel
def post_parts(control: np.ndarray, a: np.ndarray, b: np.ndarray, scratch: np.ndarray, bounds: np.ndarray,
               tile: int, panels: np.ndarray) -> int:
    """Post part ``i + 1`` of ``a @ b`` split along K at ``bounds`` (b's rows ``bounds[i + 1]`` to
    ``bounds[i + 2]``, into ``scratch[i]``) to helper ``i`` of a claimed team's ``control``; the
    number of those helpers found asleep (the caller wakes them). Part 0 is `finish_parts`'s."""
    m, k = a.shape
    n = b.shape[1]
    sleeping = 0
    for i in range(bounds.size - 2):
        row = control[i]
        row[KIND] = PART_KIND
        row[ARGS], row[ARGS + 1], row[ARGS + 2] = m, k, n
        row[ARGS + 3], row[ARGS + 4], row[ARGS + 5], row[ARGS + 6] = bounds[i + 1], bounds[i + 2], tile, a.itemsize == 8
        row[ARGS + 7], row[ARGS + 8], row[ARGS + 9] = a.ctypes.data, b.ctypes.data, scratch[i].ctypes.data
        row[ARGS + 10], row[ARGS + 11] = panels.ctypes.data, panels.shape[0]
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel
def finish_parts(control: np.ndarray, a: np.ndarray, b: np.ndarray, y: np.ndarray, scratch: np.ndarray,
                 bias: np.ndarray, bounds: np.ndarray, tile: int, panels: np.ndarray, rounds: int) -> bool:
    """Run part 0 of a split posted by `post_parts` into ``y``, wait for the helpers' parts and
    `add_parts`; False (nothing added) when a helper is not done within ``rounds`` spins (the
    caller then waits the slow way, `SpinTeam.wait`, and adds)."""
    few_rows_matmul(a, b, y, bounds[0], bounds[1], tile, panels)
    if not wait_all(control, bounds.size - 2, rounds):
        return False
    add_parts(y, scratch, bounds.size - 2, bias)
    return True


@kernel
def add_parts(y: np.ndarray, scratch: np.ndarray, parts: int, bias: np.ndarray) -> None:
    """``y += scratch[0] + … (in order)``, then ``y += bias`` (a row of y's width; empty: none),
    the additions ``y + p0 + p1 + bias`` of unfused code, element by element."""
    m, n = y.shape
    for i in range(parts):
        for r in range(m):
            for j in range(n):
                y[r, j] += scratch[i, r, j]
    if bias.size:
        for r in range(m):
            for j in range(n):
                y[r, j] += bias[j]


def post_arguments(a: np.ndarray, b: np.ndarray, y: np.ndarray, k0: int, k1: int, tile: int,
                   panels: np.ndarray) -> list[int]:
    """The integers of a part `few_rows_part` runs as ``few_rows_matmul(a, b, y, k0, k1, tile,
    panels)`` (for `SpinTeam.try_run`; C-contiguous float32 or float64 arrays, which the caller
    keeps alive until the part is done)."""
    m, k = a.shape
    return [PART_KIND, m, k, b.shape[1], k0, k1, tile, int(a.dtype == np.float64), *addresses(a, b, y, panels)[:4],
            panels.shape[0]]
