"""The tiled 2-D conv (`ops.conv_gemm`) as one compiled loop, so that its parts run on the CPU
backend's spinning helpers (`concurrency/spin_team.py`).

`conv_blocks` does what `conv_gemm.conv2d` does block by block in Python: build a cache-sized
block of im2col columns, multiply the weights by it (BLAS's sgemm, called from compiled code:
`blas_call`), store the result through the epilogue (bias and activation). Written once, it runs
on the calling thread and, for the other part of the same conv, on a helper (`conv_part`, from
the arguments `part_arguments` posts). Pool threads wake in 100-300 µs on a small VM, so convs
under ~30 M multiply-adds (SqueezeNet's and MobileNetV3's, ShuffleNet's grouped 1x1s) used to
run on one core; the helpers start a part in microseconds.

Each value is computed as in `conv_gemm.conv2d`: the same im2col, one sgemm per group and block
(BLAS sums along K the same way whatever the block's width), the same epilogue loop.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import ARGS, address_as_pointer, addresses
from . import kernel
from .blas_call import sgemm
from .epilogue import store_rows
from .im2col import im2col2d, im2col_flat

PART_KIND = 2

#: How a block's columns are made: multiplied in place (a 1x1 conv's input, or columns built
#: up front), by the exact im2col, or by the flat-window im2col (see `conv_gemm._Layout`).
DIRECT, EXACT, FLAT = 0, 1, 2


@kernel
def conv_blocks(x: np.ndarray, mode: int, geometry: np.ndarray, offsets: np.ndarray, weights: np.ndarray,
                bias: np.ndarray, y: np.ndarray, cols_buf: np.ndarray, block_buf: np.ndarray, i0: int, i1: int,
                v0: int, v1: int, m0: int, m1: int, width: int, row_width: int, out_width: int, act: int,
                a: float, b: float, fn: int, ilp64: bool) -> None:
    """Images ``i0:i1``, virtual positions ``v0:v1``, output channels ``m0:m1`` of a 2-D conv,
    ``width`` positions a block, into ``y`` (N, M, Ho·Wo), float32.

    ``x`` is 4-D, by ``mode``: `EXACT`: the input (N, C, H, W), with ``geometry`` = (kh, kw, wo,
    sh, sw, dh, dw, top, left); `FLAT`: the flat windows' buffer (N, C, total, 1) and their tap
    ``offsets``; `DIRECT`: the GEMM operand itself (N, K·G, span, 1). ``weights`` is (G, Mg, K);
    channels ``m0:m1`` other than all of them only with one group. ``cols_buf`` holds at least
    K·G·width values, ``block_buf`` (m1 − m0)·width. ``act``, ``a``, ``b``: the epilogue
    (`compiled.epilogue`); ``fn``, ``ilp64``: `blas_call.SGEMM`, `blas_call.ILP64`."""
    group, mg, k = weights.shape
    rows = group * k
    channels = m1 - m0
    for i in range(i0, i1):
        image = x[i]
        out = y[i, m0:m1]
        for s in range(v0, v1, width):
            e = min(v1, s + width)
            n = e - s
            if mode == DIRECT:
                operand = image.ctypes.data + s * 4
                ld = image.shape[1]
            else:
                cols = cols_buf[:rows * n].reshape(rows, n)
                if mode == EXACT:
                    im2col2d(image, cols, geometry[0], geometry[1], geometry[2], geometry[3], geometry[4],
                             geometry[5], geometry[6], geometry[7], geometry[8], s, e)
                else:
                    im2col_flat(image.reshape(image.shape[0], image.shape[1]), offsets, cols, s, e)
                operand = cols.ctypes.data
                ld = n
            block = block_buf[:channels * n].reshape(channels, n)
            if group == 1:
                sgemm(fn, ilp64, channels, n, k, weights.ctypes.data + m0 * k * 4, k, operand, ld,
                      block.ctypes.data, n)
            else:
                for g in range(group):
                    sgemm(fn, ilp64, mg, n, k, weights.ctypes.data + g * mg * k * 4, k, operand + g * k * ld * 4, ld,
                          block.ctypes.data + g * mg * n * 4, n)
            store_rows(block, bias[m0:m1], out, s, row_width, out_width, act, a, b)


def part_arguments(x: np.ndarray, mode: int, geometry: np.ndarray, offsets: np.ndarray, weights: np.ndarray,
                   bias: np.ndarray, y: np.ndarray, cols_buf: np.ndarray, block_buf: np.ndarray,
                   numbers: np.ndarray, i0: int, i1: int, v0: int, v1: int, m0: int, m1: int, width: int,
                   row_width: int, out_width: int, act: int, fn: int, ilp64: bool) -> list[int]:
    """The integers of a part `conv_part` runs as ``conv_blocks(...)`` on the same arguments (for
    `SpinTeam.try_run`): C-contiguous arrays (float32, int64 ``geometry`` and ``offsets``), the
    epilogue's ``a, b`` as float64 ``numbers``; the caller keeps every array alive until the part
    is done."""
    at = addresses(geometry, offsets, x, weights, bias, y, cols_buf, block_buf, numbers)
    return [PART_KIND, mode, *x.shape, at[0], at[1], offsets.size, *weights.shape, *at[2:6], y.shape[1], y.shape[2],
            at[6], cols_buf.size, at[7], block_buf.size, at[8], i0, i1, v0, v1, m0, m1, width, row_width, out_width,
            act, fn, int(ilp64)]


@numba.njit(inline="always")
def conv_part(control: np.ndarray) -> None:
    """Run the `conv_blocks` part posted in a spin team's ``control`` row (`part_arguments`):
    the helper's side (a `team_parts` runner)."""
    at = ARGS
    mode = control[at]
    n, c, h, w = control[at + 1], control[at + 2], control[at + 3], control[at + 4]
    geometry = numba.carray(address_as_pointer(control[at + 5], np.int64), (9,))
    offsets = numba.carray(address_as_pointer(control[at + 6], np.int64), (control[at + 7],))
    group, mg, k = control[at + 8], control[at + 9], control[at + 10]
    x = numba.carray(address_as_pointer(control[at + 11], np.float32), (n, c, h, w))
    weights = numba.carray(address_as_pointer(control[at + 12], np.float32), (group, mg, k))
    bias = numba.carray(address_as_pointer(control[at + 13], np.float32), (group * mg,))
    y = numba.carray(address_as_pointer(control[at + 14], np.float32), (n, control[at + 15], control[at + 16]))
    cols_buf = numba.carray(address_as_pointer(control[at + 17], np.float32), (control[at + 18],))
    block_buf = numba.carray(address_as_pointer(control[at + 19], np.float32), (control[at + 20],))
    numbers = numba.carray(address_as_pointer(control[at + 21], np.float64), (2,))
    p = at + 22
    conv_blocks(x, mode, geometry, offsets, weights, bias, y, cols_buf, block_buf, control[p], control[p + 1],
                control[p + 2], control[p + 3], control[p + 4], control[p + 5], control[p + 6], control[p + 7],
                control[p + 8], control[p + 9], numbers[0], numbers[1], control[p + 10], control[p + 11] != 0)
