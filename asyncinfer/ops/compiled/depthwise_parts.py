"""A depthwise conv's share of images or channels, on whichever of `depthwise`'s loops the layer
takes, as one compiled call: the form in which the CPU backend's spinning helpers
(`concurrency/spin_team.py`) run a part of it.

`conv_kernels.depthwise2d` picks the loop (`FLAT`, `ROWS2`, `ROWS`, `CHANNELS_LAST`) and cuts
the layer into one part per sharer; `depthwise_range` runs a part on the calling thread, and
`depthwise_part` on a helper from the integers `post_depthwise` posts. A MobileNetV3 or
ShuffleNet depthwise layer is 0.2-5 M multiply-adds: too little to wake a pool thread for (100-300
µs on a small VM), enough for two cores once the helper is spinning. Every output is computed by
the same loop as on one thread, so the bits do not depend on the split.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import (ARGS, HELPERS_ASLEEP, KIND, PARTS_DONE, PARTS_RUNNING, address_as_pointer,
                                      post_and_count_asleep, wait_all)
from . import kernel
from .depthwise import (depthwise_channels_last, depthwise_flat, depthwise_rows, depthwise_rows_stride2, vector_groups,
                        window_extent)
from .epilogue import NONE, _apply_run
from .panels import VECTOR_BYTES

PART_KIND = 5

#: The loops of `depthwise`: flat padded planes, rows at stride 2 across, rows, channels last.
FLAT, ROWS2, ROWS, CHANNELS_LAST = 0, 1, 2, 3


def scratch_floats(loop: int, h: int, w: int, ho: int, wo: int, kh: int, kw: int, sh: int, sw: int, dh: int,
                   dw: int, block: int) -> int:
    """Values of scratch `depthwise_range` needs for ``loop`` on an (H, W) map to (Ho, Wo) with
    a kh x kw kernel, strides ``sh, sw``, dilations ``dh, dw``, channel blocks of ``block`` (channels
    last; a multiple of the vector width)."""
    if loop == FLAT:
        wp = wo + (kw - 1) * dw
        positions = -(-ho * wp // 16) * 16
        return 2 * positions + (kh - 1) * dh * wp + (kw - 1) * dw
    if loop == ROWS2:
        return 2 * h * ((w + 1) // 2)
    if loop == CHANNELS_LAST:
        extent = window_extent.py_func  # (Python here: the compiled helper would be compiled for this call)
        return block * (extent(ho, kh, sh, dh) * extent(wo, kw, sw, dw) + ho * wo + 1)
    return 1


@kernel
def depthwise_range(loop: int, x: np.ndarray, taps: np.ndarray, bias: np.ndarray, out: np.ndarray, i0: int, i1: int,
                    m0: int, m1: int, sh: int, sw: int, dh: int, dw: int, top: int, left: int, multiplier: int,
                    block: int, scratch: np.ndarray, act: int, a: float, b: float, oh0: int, oh1: int) -> None:
    """Images ``i0:i1``, output channels ``m0:m1`` of a 2-D depthwise conv of ``x`` (N, C, H, W)
    into ``out`` (N, M, Ho, Wo) on ``loop``, then activated (``act``, ``a``, ``b``: a
    `compiled.epilogue` code, float32 only); output rows ``oh0:oh1`` only on `CHANNELS_LAST`
    (every row: 0, -1; the other loops compute every row). ``taps`` is (M, kh, kw), or for `CHANNELS_LAST`
    (whose channels go ``block`` at a time) (kh, kw, C rounded up to ``CHANNEL_ALIGN``), zero
    past C; strides, dilations, pads and the channel multiplier as in `depthwise`; ``scratch``
    holds `scratch_floats` values."""
    n, c, h, w = x.shape
    ho, wo = out.shape[2], out.shape[3]
    if loop == FLAT:
        kh, kw = taps.shape[1], taps.shape[2]
        wp = wo + (kw - 1) * dw
        positions = -(-ho * wp // 16) * 16
        plane = positions + (kh - 1) * dh * wp + (kw - 1) * dw
        depthwise_flat(x[i0:i1], taps, bias, out[i0:i1], m0, m1, sh, sw, dh, dw, top, left, multiplier,
                       scratch[:plane], scratch[plane:plane + positions])
    elif loop == ROWS2:
        half = (w + 1) // 2
        depthwise_rows_stride2(x[i0:i1], taps, bias, out[i0:i1], m0, m1, sh, dh, top, left, multiplier,
                               scratch[:2 * h * half].reshape(2, h, half))
    elif loop == ROWS:
        depthwise_rows(x[i0:i1], taps, bias, out[i0:i1], m0, m1, sh, sw, dh, dw, top, left, multiplier)
    else:
        hp, wp = window_extent(ho, taps.shape[0], sh, dh), window_extent(wo, taps.shape[1], sw, dw)
        lanes = VECTOR_BYTES // x.itemsize
        for i in range(i0, i1):
            for c0 in range(m0, m1, block):
                groups = vector_groups(min(m1, c0 + block) - c0, x.itemsize)
                padded = groups * hp * wp * lanes
                depthwise_channels_last(x[i], taps, bias, out[i], scratch[:padded].reshape(groups, hp, wp, lanes),
                                        scratch[padded:padded + groups * (ho * wo + 1) * lanes].reshape(
                                            groups, ho * wo + 1, lanes),
                                        c0, min(m1, c0 + block), sh, sw, dh, dw, top, left, act, a, b, oh0, oh1)
        return
    if act != NONE:  # the other loops store their sums: activate this part's channels after
        for i in range(i0, i1):
            _apply_run(out[i, m0:m1].reshape(-1), np.float32(-0.0), act, np.float32(a), np.float32(b))


@kernel
def post_depthwise(control: np.ndarray, loop: int, x: np.ndarray, taps: np.ndarray, bias: np.ndarray,
                   out: np.ndarray, parts: np.ndarray, geometry: np.ndarray, multiplier: int, block: int,
                   scratch: np.ndarray, act: int, numbers: np.ndarray) -> int:
    """Post part ``i + 1`` of ``parts`` (rows i0, i1, m0, m1, oh0, oh1) to helper ``i`` of a
    claimed team's ``control``, its scratch ``scratch[i]``, for `depthwise_part` to run as
    ``depthwise_range(...)`` (``geometry`` = sh, sw, dh, dw, top, left; the activation's ``a, b``
    as float64 ``numbers``); the number of those helpers found asleep (the caller wakes them).
    One compiled call: arguments built in Python cost several microseconds a layer."""
    sleeping = 0
    for i in range(parts.shape[0] - 1):
        row = control[i]
        row[KIND] = PART_KIND
        at = ARGS
        row[at] = loop
        for d in range(4):
            row[at + 1 + d] = x.shape[d]
        for d in range(3):
            row[at + 5 + d] = taps.shape[d]
            row[at + 8 + d] = out.shape[1 + d]
        row[at + 11], row[at + 12] = x.ctypes.data, taps.ctypes.data
        row[at + 13], row[at + 14] = bias.ctypes.data, out.ctypes.data
        for d in range(4):
            row[at + 15 + d] = parts[i + 1, d]
        for d in range(6):
            row[at + 19 + d] = geometry[d]
        row[at + 25], row[at + 26], row[at + 27], row[at + 28] = multiplier, block, scratch[i].ctypes.data, scratch.shape[1]
        row[at + 29], row[at + 30] = act, numbers.ctypes.data
        row[at + 31], row[at + 32] = parts[i + 1, 4], parts[i + 1, 5]
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel
def finish_depthwise(control: np.ndarray, loop: int, x: np.ndarray, taps: np.ndarray, bias: np.ndarray,
                     out: np.ndarray, parts: np.ndarray, geometry: np.ndarray, multiplier: int, block: int,
                     scratch: np.ndarray, act: int, a: float, b: float, rounds: int) -> bool:
    """Run part 0 of ``parts`` here (``scratch`` this thread's), then wait for the parts
    `post_depthwise` posted; False when a helper is not done within ``rounds`` spins (the caller
    then waits the slow way, `SpinTeam.wait`)."""
    depthwise_range(loop, x, taps, bias, out, parts[0, 0], parts[0, 1], parts[0, 2], parts[0, 3], geometry[0],
                    geometry[1], geometry[2], geometry[3], geometry[4], geometry[5], multiplier, block, scratch, act,
                    a, b, parts[0, 4], parts[0, 5])
    return wait_all(control, parts.shape[0] - 1, rounds)


@kernel
def post_and_finish_depthwise(control: np.ndarray, loop: int, x: np.ndarray, taps: np.ndarray, bias: np.ndarray,
                              out: np.ndarray, parts: np.ndarray, geometry: np.ndarray, multiplier: int, block: int,
                              scratch: np.ndarray, own: np.ndarray, act: int, numbers: np.ndarray, rounds: int) -> int:
    """`post_depthwise`, then `finish_depthwise` (``own`` this thread's scratch) unless a helper
    was asleep: `spin_team.HELPERS_ASLEEP` (nothing run here yet), `PARTS_DONE` or
    `PARTS_RUNNING`."""
    if post_depthwise(control, loop, x, taps, bias, out, parts, geometry, multiplier, block, scratch, act, numbers):
        return HELPERS_ASLEEP
    if finish_depthwise(control, loop, x, taps, bias, out, parts, geometry, multiplier, block, own, act, numbers[0],
                        numbers[1], rounds):
        return PARTS_DONE
    return PARTS_RUNNING


@numba.njit(inline="always")
def depthwise_part(control: np.ndarray) -> None:
    """Run the `depthwise_range` part posted in a spin team's ``control`` row (`post_depthwise`):
    the helper's side (a `team_parts` runner)."""
    at = ARGS
    n = control[at + 1]
    x = numba.carray(address_as_pointer(control[at + 11], np.float32),
                     (n, control[at + 2], control[at + 3], control[at + 4]))
    taps = numba.carray(address_as_pointer(control[at + 12], np.float32),
                        (control[at + 5], control[at + 6], control[at + 7]))
    m = control[at + 8]
    bias = numba.carray(address_as_pointer(control[at + 13], np.float32), (m,))
    out = numba.carray(address_as_pointer(control[at + 14], np.float32), (n, m, control[at + 9], control[at + 10]))
    scratch = numba.carray(address_as_pointer(control[at + 27], np.float32), (control[at + 28],))
    numbers = numba.carray(address_as_pointer(control[at + 30], np.float64), (2,))
    p = at + 15
    depthwise_range(control[at], x, taps, bias, out, control[p], control[p + 1], control[p + 2], control[p + 3],
                    control[p + 4], control[p + 5], control[p + 6], control[p + 7], control[p + 8], control[p + 9],
                    control[p + 10], control[p + 11], scratch, control[at + 29], numbers[0], numbers[1], control[at + 31],
                    control[at + 32])
