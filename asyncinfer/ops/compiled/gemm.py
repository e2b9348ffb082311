"""A float32 GEMM on the register blocks of `panels`, reading both operands in place:
``y = a @ b (+ bias)`` for ``a`` (M, K) and ``b`` (K, N), N a multiple of the panel width.

BLAS (OpenBLAS, one thread a call inside asyncinfer) ran BERT-tiny's products at 45-50 G
multiply-adds/s a core, and two of them side by side, a team's two halves, 30-40% slower each
(its packing buffers and their locks): a 128 x 128 @ 128 x 512 shared with the spin team took
110-145 µs, against 177 on one thread and ONNX Runtime's 87. Here a block of `BLOCK_ROWS` rows
of a by one panel of b (`panel_width` columns) is summed in vector registers over the whole
depth, with the bias (one per column) added, or also an activation, as it is stored. b's panels
are its own columns, a strided view (each step of depth reads one contiguous run of a row of
b: the hardware prefetcher follows it), and a's rows are read in place (`panels._rows8`...):
nothing is packed or copied per call. 64 x 128 @ 128 x 512 on one core: 75 µs against BLAS's
90-100, and 76-85 µs against 100-119 with the other core doing the same.

Parts (`gemm_part`, for the spin team) are ranges of panels: each thread reads only its
columns of b. Each output is the same sum in the same order whoever computes it: the same bits
for any split.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import ARGS, address_as_pointer, addresses
from . import kernel
from .panels import BIAS, BLOCK_ROWS, RAW, _rows1, _rows2, _rows4, _rows8, panel_width

#: The kind of a spin-team part that is a `panel_gemm` range of panels.
PART_KIND = 14

WIDTH = panel_width(np.float32)


@kernel(contract=False)
def panel_gemm(a: np.ndarray, b: np.ndarray, y: np.ndarray, bias: np.ndarray, p0: int, p1: int,
               biased: bool) -> None:
    """Columns ``p0·W:p1·W`` (panels ``p0:p1``) of ``y = a @ b``, plus ``bias`` (N,) with
    ``biased``: float32, ``a`` (M, K) and ``y`` (M, N) with contiguous rows, ``b`` (K, N)
    C-contiguous, N a multiple of W (`WIDTH`)."""
    m, k = a.shape
    n = b.shape[1]
    columns = np.lib.stride_tricks.as_strided(b, shape=(n // WIDTH, k, WIDTH), strides=(WIDTH * 4, n * 4, 4))
    finish = BIAS if biased else RAW
    for p in range(p0, p1):
        r = 0
        while r < m:
            rows = m - r
            if rows >= BLOCK_ROWS:
                rows = BLOCK_ROWS
                if BLOCK_ROWS == 8:
                    _rows8(a, columns, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0)
                else:
                    _rows4(a, columns, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0)
            elif rows >= 4:
                rows = 4
                _rows4(a, columns, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0)
            elif rows >= 2:
                rows = 2
                _rows2(a, columns, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0)
            else:
                _rows1(a, columns, p, 0, k, y, r, p * WIDTH, finish, bias, 0.0, 0.0)
            r += rows


def part_arguments(a: np.ndarray, b: np.ndarray, y: np.ndarray, bias: np.ndarray, p0: int, p1: int,
                   biased: bool) -> list[int]:
    """The integers of a part `gemm_part` runs as ``panel_gemm(a, b, y, bias, p0, p1, biased)``
    (for `SpinTeam.try_run`); the caller keeps every array alive until the part is done."""
    a_at, b_at, y_at, bias_at = addresses(a, b, y, bias)[:4]
    return [PART_KIND, *a.shape, a.strides[0] // 4, b.shape[1], y.strides[0] // 4, a_at, b_at, y_at, bias_at,
            p0, p1, int(biased)]


@numba.njit(inline="always")
def gemm_part(control: np.ndarray) -> None:
    """Run the `panel_gemm` part posted in a spin team's ``control`` row (`part_arguments`): the
    helper's side (`team_parts.serve_parts`)."""
    at = ARGS
    m, k, lda, n, ldy = control[at], control[at + 1], control[at + 2], control[at + 3], control[at + 4]
    a = numba.carray(address_as_pointer(control[at + 5], np.float32), (m, lda))[:, :k]
    b = numba.carray(address_as_pointer(control[at + 6], np.float32), (k, n))
    y = numba.carray(address_as_pointer(control[at + 7], np.float32), (m, ldy))[:, :n]
    bias = numba.carray(address_as_pointer(control[at + 8], np.float32), (n,))
    panel_gemm(a, b, y, bias, control[at + 9], control[at + 10], control[at + 11] != 0)
