"""Winograd F(4x4, 3x3): the input and output transforms of `asyncinfer.ops.conv_winograd`.

A 3x3 convolution computes each 4x4 block of outputs from a 6x6 window of the input. Winograd's
minimal filtering algorithm (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks")
transforms the window to ``V = Bᵀ d B`` and the filter to ``U = G g Gᵀ`` (6x6 each), multiplies
them element by element (summed over input channels: 36 GEMMs, done by BLAS in the caller) and
transforms the 6x6 product back with ``Aᵀ m A``: 36 multiply-adds per channel pair for 16
outputs instead of 144. The matrices, with interpolation points 0, ±1, ±2 and ∞::

    Bᵀ = [4  0 -5  0 1 0]      Aᵀ = [1 1  1 1  1 0]      G = [ 1/4     0     0 ]
         [0 -4 -4  1 1 0]           [0 1 -1 2 -2 0]          [-1/6  -1/6  -1/6 ]
         [0  4 -4 -1 1 0]           [0 1  1 4  4 0]          [-1/6   1/6  -1/6 ]
         [0 -2 -1  2 1 0]           [0 1 -1 8 -8 1]          [1/24  1/12   1/6 ]
         [0  2 -1 -2 1 0]                                    [1/24 -1/12   1/6 ]
         [0  4  0 -5 0 1]                                    [  0     0     1  ]

Tiles are numbered so that every loop here runs over consecutive memory and vectorises: the
input rows a row of tiles reads are gathered into six *slabs* (slab ``r`` holds input row
``4·ti + r`` of every tile row ``ti``, each ``4·(tw + 1)`` columns wide, zero padded), so tile
``q`` of the virtual grid (``tw + 1`` tiles a row, the last one of each row unused) reads slab
columns ``4q … 4q + 5``: one stride-4 pattern across the whole map instead of a short loop per
tile row.
"""
from __future__ import annotations

import numpy as np

from . import kernel, reduction

_U = np.uint64


@reduction
def non_finite_mark(x: np.ndarray) -> float:
    """NaN if the contiguous 1-D ``x`` holds a NaN or an infinity, else 0 (``v · 0`` is 0 only for
    finite ``v``). The transforms would spread one over a whole tile: such inputs keep the GEMM."""
    acc = 0.0
    for i in range(x.size):
        acc += x[_U(i)] * np.float32(0.0)
    return acc


@kernel
def gather_slabs(x: np.ndarray, slabs: np.ndarray, step: int, top: int, left: int, width: int, ti0: int,
                 rows: int) -> None:
    """``slabs[c, r, k·width + j] = x[c, step·(ti0 + k) + r − top, j − left]`` (zero outside ``x``)
    for the ``rows`` tile rows from ``ti0`` on, tiles ``step`` outputs high; the columns past them
    are zeroed (the last virtual tile reads two of them). ``x`` is (C, H, W), ``slabs`` (C, window
    rows, ≥ rows·width)."""
    c_in, h, w = x.shape
    for c in range(c_in):
        for r in range(slabs.shape[1]):
            dst = slabs[c, r]
            for k in range(rows):
                ih = step * (ti0 + k) + r - top
                base = k * width
                if ih < 0 or ih >= h:
                    for j in range(width):
                        dst[_U(base + j)] = 0.0
                    continue
                src = x[c, ih]
                for j in range(left):
                    dst[_U(base + j)] = 0.0
                for j in range(w):
                    dst[_U(base + left + j)] = src[_U(j)]
                for j in range(left + w, width):
                    dst[_U(base + j)] = 0.0
            for j in range(rows * width, dst.size):
                dst[_U(j)] = 0.0


@kernel
def input_transform(slabs: np.ndarray, v: np.ndarray, e: np.ndarray) -> None:
    """``v[6a + b, c, q] = (Bᵀ d B)[a, b]`` for the 6x6 window ``d`` of virtual tile ``q`` of every
    channel ``c``: ``slabs`` (C, 6, ≥ 4·Q + 2) from `gather_slabs`, ``v`` (36, C, Q), ``e`` a
    scratch (6, 6, Q). Rows first (``e = d B``, one input row at a time), then columns."""
    q_count = v.shape[2]
    for c in range(slabs.shape[0]):
        for r in range(6):
            src = slabs[c, r]
            er = e[r]
            for q in range(q_count):
                i = _U(4 * q)
                d0, d1, d2, d3 = src[i], src[i + _U(1)], src[i + _U(2)], src[i + _U(3)]
                d4, d5 = src[i + _U(4)], src[i + _U(5)]
                er[0, _U(q)] = 4.0 * d0 - 5.0 * d2 + d4
                er[1, _U(q)] = d3 + d4 - 4.0 * (d1 + d2)
                er[2, _U(q)] = 4.0 * (d1 - d2) - d3 + d4
                er[3, _U(q)] = 2.0 * (d3 - d1) - d2 + d4
                er[4, _U(q)] = 2.0 * (d1 - d3) - d2 + d4
                er[5, _U(q)] = 4.0 * d1 - 5.0 * d3 + d5
        for b in range(6):
            e0, e1, e2, e3, e4, e5 = e[0, b], e[1, b], e[2, b], e[3, b], e[4, b], e[5, b]
            v0, v1, v2, v3, v4, v5 = v[b, c], v[6 + b, c], v[12 + b, c], v[18 + b, c], v[24 + b, c], v[30 + b, c]
            for q in range(q_count):
                j = _U(q)
                d0, d1, d2, d3, d4, d5 = e0[j], e1[j], e2[j], e3[j], e4[j], e5[j]
                v0[j] = 4.0 * d0 - 5.0 * d2 + d4
                v1[j] = d3 + d4 - 4.0 * (d1 + d2)
                v2[j] = 4.0 * (d1 - d2) - d3 + d4
                v3[j] = 2.0 * (d3 - d1) - d2 + d4
                v4[j] = 2.0 * (d1 - d3) - d2 + d4
                v5[j] = 4.0 * d1 - 5.0 * d3 + d5


@kernel
def output_transform(m: np.ndarray, y: np.ndarray, tw: int, oh0: int, t: np.ndarray) -> None:
    """``y[k, oh0 + 4·ti + r, 4·tj + s] = (Aᵀ M A)[r, s]`` where ``M`` is the 6x6 product of tile
    (ti, tj) of output channel ``k``, cropped to ``y``: ``m`` (36, K, Q) over the virtual tiles of
    the tile rows from ``oh0 / 4`` on (``tw + 1`` a row), ``y`` (K, Ho, Wo) with contiguous rows,
    ``t`` a scratch (4, 6, tw). Columns first (``t = Aᵀ M``), then rows."""
    channels, ho, wo = y.shape
    row_tiles = tw + 1
    tile_rows = m.shape[2] // row_tiles
    for k in range(channels):
        for ti in range(tile_rows):
            q0 = ti * row_tiles
            if oh0 + 4 * ti >= ho:
                break
            for s in range(6):
                m0, m1, m2 = m[s, k, q0:q0 + tw], m[6 + s, k, q0:q0 + tw], m[12 + s, k, q0:q0 + tw]
                m3, m4, m5 = m[18 + s, k, q0:q0 + tw], m[24 + s, k, q0:q0 + tw], m[30 + s, k, q0:q0 + tw]
                t0, t1, t2, t3 = t[0, s], t[1, s], t[2, s], t[3, s]
                for j in range(tw):
                    i = _U(j)
                    a0, a1, a2, a3, a4, a5 = m0[i], m1[i], m2[i], m3[i], m4[i], m5[i]
                    t0[i] = a0 + a1 + a2 + a3 + a4
                    t1[i] = a1 - a2 + 2.0 * (a3 - a4)
                    t2[i] = a1 + a2 + 4.0 * (a3 + a4)
                    t3[i] = a1 - a2 + 8.0 * (a3 - a4) + a5
            for r in range(4):
                oh = oh0 + 4 * ti + r
                if oh >= ho:
                    break
                row = y[k, oh]
                tr = t[r]
                for j in range(tw):
                    i = _U(j)
                    a0, a1, a2, a3, a4, a5 = tr[0, i], tr[1, i], tr[2, i], tr[3, i], tr[4, i], tr[5, i]
                    o0 = a0 + a1 + a2 + a3 + a4
                    o1 = a1 - a2 + 2.0 * (a3 - a4)
                    o2 = a1 + a2 + 4.0 * (a3 + a4)
                    o3 = a1 - a2 + 8.0 * (a3 - a4) + a5
                    ow = 4 * j
                    if ow + 4 <= wo:
                        row[_U(ow)] = o0
                        row[_U(ow + 1)] = o1
                        row[_U(ow + 2)] = o2
                        row[_U(ow + 3)] = o3
                    else:  # the last tile of a row overhangs the map
                        row[_U(ow)] = o0
                        if ow + 1 < wo:
                            row[_U(ow + 1)] = o1
                        if ow + 2 < wo:
                            row[_U(ow + 2)] = o2
