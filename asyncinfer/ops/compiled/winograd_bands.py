"""Winograd's 3x3 conv (`ops.conv_winograd`) by bands of tile rows in one compiled loop, so that
its parts run on the CPU backend's spinning helpers (`concurrency/spin_team.py`).

`winograd_bands` runs what `conv_winograd._part` runs in Python for each band: gather the input
rows into slabs, transform them, the α² GEMMs (BLAS's sgemm from compiled code: `blas_call`, or
asyncinfer's panel GEMM: `panel_products`), the output transform, bias and activation. The
calling thread takes some bands and a helper the others (`post_bands`, `band_part`), starting in
microseconds where a pool thread takes 100-300 µs to wake, so mid-sized layers (SqueezeNet's,
ResNet's 28x28 stage) run on every core.
Each value is computed as in `_part`: the same transforms, one product per ξ, the same epilogue.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import ARGS, KIND, address_as_pointer, post_and_count_asleep, wait_all
from . import kernel
from .blas_call import sgemm
from .epilogue import apply_rows
from .gemm import WIDTH, panel_gemm_any_width
from .winograd import gather_slabs, input_transform, output_transform

PART_KIND = 4


@kernel
def panel_products(u: np.ndarray, v: np.ndarray, products: np.ndarray, tail_b: np.ndarray,
                   tail_y: np.ndarray) -> None:
    """``products[ξ] = u[ξ] @ v[ξ]`` for every ξ on `gemm.panel_gemm_any_width` (``tail_b`` (C,
    W), ``tail_y`` (M, W): its scratch): ``u`` (α², M, C), ``v`` (α², C, Q), ``products`` (α², M,
    Q), float32, C-contiguous. Bands of any size give the same bits."""
    for xi in range(u.shape[0]):
        panel_gemm_any_width(u[xi], v[xi], products[xi], tail_b, tail_y)


@kernel
def winograd_bands(x: np.ndarray, u: np.ndarray, bias: np.ndarray, y: np.ndarray, bands: np.ndarray, b0: int,
                   b1: int, top: int, left: int, tw: int, scratch: np.ndarray, act: int, a: float, b: float, fn: int,
                   ilp64: bool, on_panels: bool) -> None:
    """Bands ``b0:b1`` of ``bands`` (rows: image, first and end tile row) of the Winograd conv
    of ``x`` (N, C, H, W) by ``u`` (α², M, C: `conv_winograd.transform_weights`) into ``y`` (N,
    M, Ho, Wo), float32, with ``top``/``left`` pads and ``tw`` tiles a row; ``scratch`` holds at
    least `scratch_size` values for the largest band. ``act``, ``a``, ``b``: the epilogue;
    ``fn``, ``ilp64``: `blas_call.SGEMM`, `blas_call.ILP64`; ``on_panels``: the products by
    `panel_products` instead."""
    c = x.shape[1]
    m = u.shape[1]
    window = 6  # (F(4x4, 3x3): a tile reads 6x6 inputs)
    step = window - 2
    ho, wo = y.shape[2], y.shape[3]
    for j in range(b0, b1):
        i, ti0, ti1 = bands[j, 0], bands[j, 1], bands[j, 2]
        tiles = (ti1 - ti0) * (tw + 1)
        sizes = (c * window * (step * tiles + 8), window * window * c * tiles, window * window * tiles,
                 window * window * m * tiles)
        at = 0
        slabs = scratch[at:at + sizes[0]].reshape(c, window, step * tiles + 8)
        at += sizes[0]
        v = scratch[at:at + sizes[1]].reshape(window * window, c, tiles)
        at += sizes[1]
        e = scratch[at:at + sizes[2]].reshape(window, window, tiles)
        at += sizes[2]
        products = scratch[at:at + sizes[3]].reshape(window * window, m, tiles)
        at += sizes[3]
        t = scratch[at:at + step * window * tw].reshape(step, window, tw)
        at += step * window * tw
        gather_slabs(x[i], slabs, step, top, left, step * (tw + 1), ti0, ti1 - ti0)
        input_transform(slabs, v, e)
        if on_panels:
            panel_products(u, v, products, scratch[at:at + c * WIDTH].reshape(c, WIDTH),
                           scratch[at + c * WIDTH:at + (c + m) * WIDTH].reshape(m, WIDTH))
        else:
            for xi in range(window * window):
                sgemm(fn, ilp64, m, tiles, c, u[xi].ctypes.data, c, v[xi].ctypes.data, tiles,
                      products[xi].ctypes.data, tiles)
        oh0, oh1 = step * ti0, min(ho, step * ti1)
        output_transform(products, y[i], tw, oh0, t)
        for ch in range(m):
            apply_rows(y[i, ch, oh0:oh1].reshape(1, (oh1 - oh0) * wo), bias[ch:ch + 1], act, a, b)


def scratch_size(window: int, c: int, m: int, tiles: int, tw: int) -> int:
    """Floats of scratch `winograd_bands` needs for a band of ``tiles`` virtual tiles."""
    step = window - 2
    return (c * window * (step * tiles + 8) + window * window * (c + m + 1) * tiles + step * window * tw
            + (c + m) * WIDTH)


@kernel
def post_bands(control: np.ndarray, x: np.ndarray, u: np.ndarray, bias: np.ndarray, y: np.ndarray, bands: np.ndarray,
               cuts: np.ndarray, top: int, left: int, tw: int, scratch: np.ndarray, act: int, numbers: np.ndarray,
               fn: int, ilp64: bool, on_panels: bool) -> int:
    """Post bands ``cuts[i + 1]:cuts[i + 2]`` to helper ``i`` of a claimed team's ``control``
    (its scratch ``scratch[i]``), for `band_part` to run as `winograd_bands` on the same
    arguments: C-contiguous arrays, int64 ``bands``, the epilogue's ``a, b`` as float64
    ``numbers``; how many of those helpers were asleep (the caller wakes them). The caller keeps
    every array alive until the parts are done."""
    sleeping = 0
    for i in range(cuts.shape[0] - 2):
        row = control[i]
        row[KIND] = PART_KIND
        at = ARGS
        row[at], row[at + 1], row[at + 2], row[at + 3] = x.shape[0], x.shape[1], x.shape[2], x.shape[3]
        row[at + 4], row[at + 5], row[at + 6] = u.shape[0], u.shape[1], u.shape[2]
        row[at + 7], row[at + 8] = y.shape[2], y.shape[3]
        row[at + 9], row[at + 10], row[at + 11] = x.ctypes.data, u.ctypes.data, bias.ctypes.data
        row[at + 12], row[at + 13], row[at + 14] = y.ctypes.data, bands.ctypes.data, bands.shape[0]
        row[at + 15], row[at + 16] = cuts[i + 1], cuts[i + 2]
        row[at + 17], row[at + 18], row[at + 19] = top, left, tw
        row[at + 20], row[at + 21], row[at + 22] = scratch[i].ctypes.data, scratch.shape[1], act
        row[at + 23], row[at + 24], row[at + 25] = numbers.ctypes.data, fn, 1 if ilp64 else 0
        row[at + 26] = 1 if on_panels else 0
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel
def finish_bands(control: np.ndarray, x: np.ndarray, u: np.ndarray, bias: np.ndarray, y: np.ndarray,
                 bands: np.ndarray, cuts: np.ndarray, top: int, left: int, tw: int, scratch: np.ndarray, act: int,
                 a: float, b: float, fn: int, ilp64: bool, on_panels: bool, rounds: int) -> bool:
    """Run bands ``cuts[0]:cuts[1]`` here (``scratch`` this thread's), then wait for the parts
    `post_bands` posted; False when a helper is not done within ``rounds`` spins (the caller then
    waits the slow way)."""
    winograd_bands(x, u, bias, y, bands, cuts[0], cuts[1], top, left, tw, scratch, act, a, b, fn, ilp64, on_panels)
    return wait_all(control, cuts.shape[0] - 2, rounds)


@numba.njit(inline="always")
def band_part(control: np.ndarray) -> None:
    """Run the `winograd_bands` part posted in a spin team's ``control`` row (`post_bands`): the
    helper's side (a `team_parts` runner)."""
    at = ARGS
    n, c, h, w = control[at], control[at + 1], control[at + 2], control[at + 3]
    xi, m = control[at + 4], control[at + 5]
    ho, wo = control[at + 7], control[at + 8]
    x = numba.carray(address_as_pointer(control[at + 9], np.float32), (n, c, h, w))
    u = numba.carray(address_as_pointer(control[at + 10], np.float32), (xi, m, c))
    bias = numba.carray(address_as_pointer(control[at + 11], np.float32), (m,))
    y = numba.carray(address_as_pointer(control[at + 12], np.float32), (n, m, ho, wo))
    bands = numba.carray(address_as_pointer(control[at + 13], np.int64), (control[at + 14], 3))
    scratch = numba.carray(address_as_pointer(control[at + 20], np.float32), (control[at + 21],))
    numbers = numba.carray(address_as_pointer(control[at + 23], np.float64), (2,))
    winograd_bands(x, u, bias, y, bands, control[at + 15], control[at + 16], control[at + 17], control[at + 18],
                   control[at + 19], scratch, control[at + 22], numbers[0], numbers[1], control[at + 24],
                   control[at + 25] != 0, control[at + 26] != 0)
