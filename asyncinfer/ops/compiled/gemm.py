"""A float32 GEMM on the register blocks of `panels`, reading both operands in place:
``y = a @ b (+ bias)`` for ``a`` (M, K) and ``b`` (K, N) with contiguous rows, N a multiple of
the panel width.

BLAS (OpenBLAS, one thread a call inside asyncinfer) ran BERT-tiny's products at 45-50 G
multiply-adds/s a core, and two of them side by side, a team's two halves, 30-40% slower each
(its packing buffers and their locks): a 128 x 128 @ 128 x 512 shared with the spin team took
110-145 µs, against 177 on one thread and ONNX Runtime's 87. Here a block of `BLOCK_ROWS` rows
of a by one panel of b (`panel_width` columns) is summed in vector registers over the whole
depth, the bias (one per column) added as it is stored. b's panels
are its own columns, a strided view (each step of depth reads one contiguous run of a row of
b: the hardware prefetcher follows it), and a's rows are read in place (`panels._rows8`...):
nothing is packed or copied per call. 64 x 128 @ 128 x 512 on one core: 75 µs against BLAS's
90-100, and 76-85 µs against 100-119 with the other core doing the same. Packed panels (a model's
weights) take blocks of `WIDE_ROWS` rows with AVX-512's 32 registers (28 sums: 16 loads to 28
multiply-adds a step, where 8 rows take 10 to 16): one core, 128 x 512 @ 512 x 128 109 -> 106 µs,
196 x 768 @ 768 x 768 1513 -> 1445 (153-156 -> 158-163 GFLOP/s).

A batch of products (attention's heads) runs entry by entry. Parts (`gemm_part`, for the spin
team) are ranges of entries where there are enough, else ranges of panels (each thread then
reads only its columns of b). Each output is the same sum in the same order whoever computes
it: the same bits for any split.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import ARGS, KIND, address_as_pointer, post_and_count_asleep, wait_all
from . import kernel
from .panels import (BIAS, BLOCK_ROWS, RAW, WIDE_BLOCKS, WIDE_ROWS, _rows1, _rows2, _rows4, _rows4_spread, _rows8,
                     _rows8_spread, _rows14_spread, ahead_share, panel_width)

#: The kind of a spin-team part that is a `panel_gemm_batch` range of entries and panels.
PART_KIND = 14

WIDTH = panel_width(np.float32)
#: Rows of a taken through every panel before the next rows (`gemm_on_panels`): a band of a this
#: large stays in L2 while each panel reads it, and b (packed) is read once a band. An a that
#: fits is one band, read again from L2 for each panel.
A_BAND_BYTES = 1 << 20
#: Whether products that BLAS would run go here instead where this GEMM suits them (Winograd's α²
#: products, attention's two per head): with AVX-512's 32-column panels it ran them 1.1-2.5x
#: faster than OpenBLAS on the 2-core Zen 5 VM (2.2x its AVX2 Haswell kernels, 1.3x its
#: SkylakeX ones on a 128 x 64 @ 64 x 128: 8.7 against 19.1 and 11.2 µs). Elsewhere (AVX2,
#: NEON) unmeasured: BLAS.
PANELS_OVER_BLAS = WIDTH == 32


@kernel(contract=False)
def panel_gemm(a: np.ndarray, b: np.ndarray, y: np.ndarray, bias: np.ndarray, p0: int, p1: int,
               biased: bool) -> None:
    """Columns ``p0·W:p1·W`` (panels ``p0:p1``) of ``y = a @ b``, plus ``bias`` (N,) with
    ``biased``: float32, ``a`` (M, K), ``b`` (K, N) and ``y`` (M, N) with contiguous rows, N a
    multiple of W (`WIDTH`). b's panels are read in place (`own_panels`)."""
    gemm_on_panels(a, own_panels(b), y, bias, p0, p1, biased)


@numba.njit(inline="always")
def own_panels(b: np.ndarray) -> np.ndarray:
    """b (K, N)'s whole panels as a strided view (N / W, K, W): panel p is ``b[:, p·W:(p + 1)·W]``."""
    return np.lib.stride_tricks.as_strided(b, shape=(b.shape[1] // WIDTH, b.shape[0], WIDTH),
                                           strides=(WIDTH * 4, b.strides[0], 4))


@kernel(contract=False)
def gemm_on_panels(a: np.ndarray, panels: np.ndarray, y: np.ndarray, bias: np.ndarray, p0: int, p1: int,
                   biased: bool) -> None:
    """`panel_gemm` of b given as its panels (P, K, W), each with contiguous rows: b's own columns
    in place (`own_panels`), or b packed once (`panels.pack_panels`: a model's constant weight,
    whose panels then stream from memory; read in place, each step of depth reads 128 bytes of a
    row of b a row apart, a stride at which a wide b's rows share a few cache sets)."""
    m, k = a.shape
    finish = BIAS if biased else RAW
    band = max(BLOCK_ROWS, A_BAND_BYTES // (max(k, 1) * 4) // BLOCK_ROWS * BLOCK_ROWS)  # (K 0: one band of zeros)
    for r0 in range(0, m, band):
        _band(a, panels, y, bias, p0, p1, finish, r0, min(m, r0 + band))


@numba.njit(inline="always")
def _band(a: np.ndarray, panels: np.ndarray, y: np.ndarray, bias: np.ndarray, p0: int, p1: int, finish: int,
          r0: int, r1: int) -> None:
    """Rows ``r0:r1`` of `gemm_on_panels`'s product, panel after panel. Packed panels (a model's
    weight, in memory between runs) come in while the panel before is summed, a share in each of
    its last blocks (`panels.ahead_share`), where each block prefetched all of the next panel
    (on 2 threads: ViT-B/16 0.943x, ConvNeXt-T 0.966x, the Llama block 0.949x). Panels read in
    place (b's own columns, a row of b apart, not one run each) keep every block's prefetch of
    the next panel's row beside each of its own. Packed panels go by blocks of `WIDE_ROWS` rows
    first (AVX-512), the rows left by the smaller blocks."""
    k = a.shape[1]
    row_bytes = WIDTH * panels.itemsize
    packed = panels.strides[1] == row_bytes
    blocks = (r1 - r0) // BLOCK_ROWS
    wide = WIDE_ROWS if WIDE_BLOCKS and packed else r1 - r0 + 1  # (no wide blocks)
    wide_blocks = (r1 - r0) // wide
    for p in range(p0, p1):
        r = r0
        while r + wide <= r1:
            ahead_at, ahead_step = ahead_share(p + 1 < p1, (r - r0) // wide, wide_blocks, k, row_bytes)
            _rows14_spread(a, panels, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0, ahead_at, ahead_step)
            r += wide
        while r < r1:
            rows = r1 - r
            if rows >= BLOCK_ROWS and packed:
                rows = BLOCK_ROWS
                # (after wide blocks, which brought the next panel in, none)
                ahead_at, ahead_step = ahead_share(p + 1 < p1 and not wide_blocks, (r - r0) // BLOCK_ROWS, blocks, k,
                                                   row_bytes)
                if BLOCK_ROWS == 8:
                    _rows8_spread(a, panels, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0, ahead_at, ahead_step)
                else:
                    _rows4_spread(a, panels, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0, ahead_at, ahead_step)
            elif rows >= BLOCK_ROWS:
                rows = BLOCK_ROWS
                if BLOCK_ROWS == 8:
                    _rows8(a, panels, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0)
                else:
                    _rows4(a, panels, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0)
            elif rows >= 4:
                rows = 4
                _rows4(a, panels, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0)
            elif rows >= 2:
                rows = 2
                _rows2(a, panels, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0)
            else:
                _rows1(a, panels, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0)
            r += rows


@kernel
def panel_gemm_any_width(a: np.ndarray, b: np.ndarray, y: np.ndarray, tail_b: np.ndarray, tail_y: np.ndarray) -> None:
    """``y = a @ b`` as `panel_gemm` for any N: b's whole panels read in place, its last ``N mod
    W`` columns through ``tail_b`` (K, W) into ``tail_y`` (M, W), a panel padded with zeros
    (scratch of the caller's). Every value is the sum `panel_gemm` makes for it wherever its
    column falls, so products cut into any widths give the same bits."""
    n = b.shape[1]
    full = n // WIDTH
    tail = n - full * WIDTH
    no_bias = tail_y[0]  # (unread: ``biased`` is False)
    if full:
        panel_gemm(a, b, y, no_bias, 0, full, False)
    if tail:
        start = full * WIDTH
        for k in range(b.shape[0]):
            for j in range(tail):
                tail_b[k, j] = b[k, start + j]
            for j in range(tail, WIDTH):
                tail_b[k, j] = 0.0
        panel_gemm(a, tail_b, tail_y, no_bias, 0, 1, False)
        for r in range(y.shape[0]):
            for j in range(tail):
                y[r, start + j] = tail_y[r, j]


#: No packed panels (`panel_gemm_batch` then reads each entry's b in place).
NO_PACKED = np.zeros((0, 1, WIDTH), np.float32)


@kernel(contract=False)
def panel_gemm_batch(a: np.ndarray, b: np.ndarray, packed: np.ndarray, y: np.ndarray, bias: np.ndarray, e0: int,
                     e1: int, p0: int, p1: int, biased: bool) -> None:
    """`gemm_on_panels` of entries ``e0:e1`` of a batch: ``a`` (E, M, K) and ``b`` (E, K, N) with
    contiguous rows, ``y`` (E, M, N); ``packed``: the one b's panels (`panels.pack_panels`), or
    `NO_PACKED` to read each b's in place."""
    _entries(a, _batch_panels(b, packed), y, bias, e0, e1, p0, p1, biased)


@numba.njit(inline="always")
def _entries(a: np.ndarray, panels: np.ndarray, y: np.ndarray, bias: np.ndarray, e0: int, e1: int, p0: int, p1: int,
             biased: bool) -> None:
    for e in range(e0, e1):
        gemm_on_panels(a[e], panels[e], y[e], bias, p0, p1, biased)


@numba.njit(inline="always")
def _batch_panels(b: np.ndarray, packed: np.ndarray) -> np.ndarray:
    """The batch's panels (E, N / W, K, W): ``packed`` for every entry where it has panels, else
    each b's own in place (a view made here, in compiled code: NumPy's ``as_strided`` costs
    microseconds a call)."""
    if packed.shape[0]:
        return np.lib.stride_tricks.as_strided(packed, shape=(b.shape[0], packed.shape[0], packed.shape[1], WIDTH),
                                               strides=(0, packed.strides[0], packed.strides[1], 4))
    count, k, n = b.shape
    return np.lib.stride_tricks.as_strided(b, shape=(count, n // WIDTH, k, WIDTH),
                                           strides=(b.strides[0], WIDTH * 4, b.strides[1], 4))


@kernel(contract=False)
def post_gemm(control: np.ndarray, a: np.ndarray, b: np.ndarray, packed: np.ndarray, y: np.ndarray,
              bias: np.ndarray, parts: np.ndarray, biased: bool) -> int:
    """Post part ``i + 1`` of ``parts`` (rows ``e0, e1, p0, p1``) to helper ``i`` of a claimed
    team's ``control``, for `gemm_part` to run as ``panel_gemm_batch(a, b, packed, y, bias, e0,
    e1, p0, p1, biased)``; how many of those helpers were asleep (the caller wakes them). ``a``
    (E, M, K) and ``b`` (E, K, N) with contiguous rows, ``y`` C-contiguous; the caller keeps them
    alive until the parts are done. Posted in one compiled call: building the parts' integers in
    Python cost about 5 µs a product (BERT-tiny's 128 x 128 @ 128 x 128 takes 20 µs a half)."""
    count, m, k = a.shape
    panels = _batch_panels(b, packed)
    sleeping = 0
    for i in range(parts.shape[0] - 1):
        row = control[i]
        row[KIND] = PART_KIND
        at = ARGS
        row[at], row[at + 1], row[at + 2], row[at + 3] = count, m, k, panels.shape[1]
        row[at + 4], row[at + 5], row[at + 6] = a.ctypes.data, a.strides[0] // 4, a.strides[1] // 4
        row[at + 7], row[at + 8] = panels.ctypes.data, panels.strides[0] // 4
        row[at + 9], row[at + 10] = panels.strides[1] // 4, panels.strides[2] // 4
        row[at + 11], row[at + 12] = y.ctypes.data, bias.ctypes.data
        for j in range(4):
            row[at + 13 + j] = parts[i + 1, j]
        row[at + 17] = 1 if biased else 0
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel(contract=False)
def finish_gemm(control: np.ndarray, a: np.ndarray, b: np.ndarray, packed: np.ndarray, y: np.ndarray,
                bias: np.ndarray, parts: np.ndarray, biased: bool, rounds: int) -> bool:
    """Run part 0 of ``parts`` here, then wait for the parts `post_gemm` posted; False when a
    helper is not done within ``rounds`` spins (the caller then waits the slow way)."""
    panel_gemm_batch(a, b, packed, y, bias, parts[0, 0], parts[0, 1], parts[0, 2], parts[0, 3], biased)
    return wait_all(control, parts.shape[0] - 1, rounds)


@numba.njit(inline="always")
def strided(address: int, shape: tuple[int, int, int], outer: int, row: int) -> np.ndarray:
    """The float32 array (E, R, C) at ``address`` with entries ``outer`` and rows ``row`` values
    apart, its values within a row contiguous (compiled code: operands posted by address)."""
    extent = (shape[0] - 1) * outer + (shape[1] - 1) * row + shape[2]
    flat = numba.carray(address_as_pointer(address, np.float32), (extent,))
    return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=(outer * 4, row * 4, 4))


@numba.njit(inline="always")
def _strided_panels(address: int, shape: tuple[int, int, int, int], entry: int, panel: int,
                    row: int) -> np.ndarray:
    """`strided` of a batch of panels (E, P, K, W): entries, panels and rows that many values apart."""
    extent = (shape[0] - 1) * entry + (shape[1] - 1) * panel + (shape[2] - 1) * row + shape[3]
    flat = numba.carray(address_as_pointer(address, np.float32), (extent,))
    return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=(entry * 4, panel * 4, row * 4, 4))


@numba.njit(inline="always")
def gemm_part(control: np.ndarray) -> None:
    """Run the `panel_gemm_batch` part posted in a spin team's ``control`` row (`post_gemm`): the
    helper's side (a `team_parts` runner)."""
    at = ARGS
    count, m, k, p = control[at], control[at + 1], control[at + 2], control[at + 3]
    a = strided(control[at + 4], (count, m, k), control[at + 5], control[at + 6])
    panels = _strided_panels(control[at + 7], (count, p, k, WIDTH), control[at + 8], control[at + 9],
                             control[at + 10])
    y = numba.carray(address_as_pointer(control[at + 11], np.float32), (count, m, p * WIDTH))
    bias = numba.carray(address_as_pointer(control[at + 12], np.float32), (p * WIDTH,))
    q = at + 13
    _entries(a, panels, y, bias, control[q], control[q + 1], control[q + 2], control[q + 3], control[q + 4] != 0)
