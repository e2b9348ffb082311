"""A 1x1 expansion and the depthwise conv after it, a panel of channels at a time, the map between
them channels last in the core's cache (`ops/expand_depthwise.py` says when a layer runs so).

The inverted residual block of MobileNetV2/V3, EfficientNet and their kind widens a thin map with a
1x1 conv, then filters each of the wide map's channels with a depthwise conv. As two layers the
wide map is stored NCHW by the 1x1 conv (each block of results transposed into channel planes)
and read back by the depthwise loops, which either vector along a row (a stride of 2 then takes
shuffles) or copy the map channels last first, padded, and transpose their sums back: that copy
was most of a channels-last depthwise layer (72 channels at 56x56, 3x3/2 on one core: 67 µs,
32 of them the sums). ONNX Runtime keeps the whole network channels last (NCHWc) instead.

Here each panel of `panel_width` expanded channels is summed in registers a block of positions at a
time (`panels._by_column14`..., the blocks `pointwise.small_map_conv` sums: bias and activation
in registers) and stored as it is, a position's channels side by side, into a zero-padded
channels-last buffer (Hp, Wp, W) of the rows the output band's windows read; the depthwise
register blocks (`depthwise_block.output_row`) then sum each vector of those channels over its
window, and the sums, activated, are transposed into the NCHW output. The wide map never leaves
the cache and is never transposed. Each sum is the one the two layers make (the 1x1's from zero
along the input channels, one FMA after another, then bias and activation; the depthwise one from
its bias, tap after tap), so the bits are theirs.

A part is a range of images, of panels and of output rows; a band of rows whose padded buffer
would pass `ops.expand_depthwise.BAND_BYTES` goes in several (each band expands the input rows
its windows read: the rows two bands share are expanded twice). The CPU backend's spinning helpers
run parts posted by `post_expand_depthwise` (`expand_depthwise_part`).
"""
from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ...concurrency.spin_team import (ARGS, HELPERS_ASLEEP, KIND, PARTS_DONE, PARTS_RUNNING, address_as_pointer,
                                      post_and_count_asleep, wait_all)
from . import inline, kernel
from .depthwise import window_extent
from .depthwise_block import output_row, transpose
from .epilogue import NONE, _apply_run
from .panels import (VECTOR_BYTES, WIDE_BLOCKS, WIDE_ROWS, _by_column1, _by_column2, _by_column4, _by_column8,
                     _by_column14, panel_width)
from .pointwise import finishing

PART_KIND = 8

_WIDTH = panel_width(np.float32)
_LANES = VECTOR_BYTES // 4
_NEGATIVE_ZERO = np.float32(-0.0)
_F = np.float32


def scratch_floats(band: int, wo: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int) -> int:
    """Float32 values of scratch one part needs for bands of ``band`` output rows of ``wo``
    (`expand_depthwise_range`: the padded panel, the sums with their bias row, a block)."""
    extent = window_extent.py_func  # (Python here: the compiled helper would be compiled for this call)
    return (extent(band, kh, sh, dh) * extent(wo, kw, sw, dw) * _WIDTH + (band * wo + 1) * _LANES
            + WIDE_ROWS * _WIDTH)


@intrinsic
def _spills_on_whole_lines(typingctx: Any) -> Any:
    """Make the compiled function that calls this realign its stack to a cache line. A block of
    14 positions x two vectors finishes its 28 sums (bias, then an activation with constants of
    its own) with more values live than AVX-512's 32 registers, and spills vectors; LLVM gave
    them slots only as aligned as the ABI's 16 bytes, so at 3 stack addresses in 4 each spill and
    reload straddled two lines and the reloads waited for the stores: one core, 40 -> 240 at
    28x28 then 5x5/2 took 285-305 µs or 203-218 by the calling thread's stack, and by the parity
    of its call depth. A line-aligned slot the function hands to an empty asm statement makes
    LLVM realign the stack in the prologue, and the spill slots with it: 208-220 at every depth
    (an ``alignstack`` attribute on the function did not reach the code)."""
    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        line = ir.VectorType(ir.FloatType(), VECTOR_BYTES // 4)
        with builder.goto_entry_block():
            slot = builder.alloca(line)
        slot.align = 64
        builder.asm(ir.FunctionType(ir.VoidType(), [slot.type]), "", "r", [slot], True)
        return context.get_dummy_value()
    return types.void(), codegen


@kernel
def _expand_block(source: np.ndarray, panels: np.ndarray, p: int, block: np.ndarray, s: int, rows: int,
                  finish: int, bias: np.ndarray, av: float, bv: float) -> None:
    """Positions ``s:s + rows`` (14, 8, 4, 2 or 1 of them) of panel ``p`` of the expansion into
    ``block``'s first rows, biased and activated (``finish``): a function of its own, its
    stack realigned (`_spills_on_whole_lines`)."""
    _spills_on_whole_lines()
    c = source.shape[0]
    if rows == WIDE_ROWS:
        _by_column14(source[:, s:], panels, p, 0, c, block, 0, 0, finish, bias, av, bv)
    elif rows == 8:
        _by_column8(source[:, s:], panels, p, 0, c, block, 0, 0, finish, bias, av, bv)
    elif rows == 4:
        _by_column4(source[:, s:], panels, p, 0, c, block, 0, 0, finish, bias, av, bv)
    elif rows == 2:
        _by_column2(source[:, s:], panels, p, 0, c, block, 0, 0, finish, bias, av, bv)
    else:
        _by_column1(source[:, s:], panels, p, 0, c, block, 0, 0, finish, bias, av, bv)


@kernel
def _pad(padded: np.ndarray, hp: int, first: int, h: int, lo: int, hi: int) -> None:
    """Zero what of ``padded``'s first ``hp`` rows is not the image: rows outside it (input row
    ``first + r``), and the columns left of ``lo`` and from ``hi`` on."""
    wp, width = padded.shape[1], padded.shape[2]
    for r in range(hp):
        ih = first + r
        row = padded[r]
        inside = 0 <= ih < h
        for q in range(0 if not inside else hi, wp):
            cell = row[q]
            for k in range(width):
                cell[k] = 0.0
        if inside:
            for q in range(lo):
                cell = row[q]
                for k in range(width):
                    cell[k] = 0.0


@kernel
def _expand(source: np.ndarray, panels: np.ndarray, p: int, bias: np.ndarray, padded: np.ndarray, block: np.ndarray,
            s0: int, s1: int, wd: int, first: int, left: int, finish: int, av: float, bv: float) -> None:
    """Expanded positions ``s0:s1`` (whole input rows) of panel ``p`` into ``padded`` (row ``ih -
    first``, column ``left + iw`` for input position ``ih·wd + iw``), in blocks of `WIDE_ROWS`
    (AVX-512) or 8 positions: stored straight into ``padded`` where whole blocks make a row (56,
    28 and 14 wide maps), else through ``block``, the last one overlapping the one before (the
    same sums again), or on fewer positions blocks of 4, 2 and 1."""
    total = s1 - s0
    step = WIDE_ROWS if WIDE_BLOCKS and total >= WIDE_ROWS else 8
    width = padded.shape[2]
    if total >= step and wd % step == 0:
        for ih in range(s0 // wd, s1 // wd):
            row = padded[ih - first]
            for iw in range(0, wd, step):
                _expand_block(source, panels, p, row[left + iw:], ih * wd + iw, step, finish, bias, av, bv)
        return
    r = s0
    while r < s1:
        if total >= step:
            rows = step
            s = min(r, s1 - step)
        else:
            rows = 4 if s1 - r >= 4 else 2 if s1 - r >= 2 else 1
            s = r
        _expand_block(source, panels, p, block, s, rows, finish, bias, av, bv)
        ih = s // wd
        iw = s - ih * wd
        for j in range(rows):
            cell, values = padded[ih - first, left + iw], block[j]
            for k in range(width):
                cell[k] = values[k]
            iw += 1
            if iw == wd:
                iw = 0
                ih += 1
        r = s + rows


@inline
def _band(panels: np.ndarray, source: np.ndarray, taps: np.ndarray, bias1: np.ndarray, bias2: np.ndarray,
          out: np.ndarray, padded: np.ndarray, acc: np.ndarray, block: np.ndarray, h: int, wd: int, q0: int, q1: int,
          oh0: int, oh1: int, sh: int, sw: int, dh: int, dw: int, top: int, left: int, finish: int, a1: float,
          b1: float, act2: int, a2: float, b2: float) -> None:
    """Output rows ``oh0:oh1`` of panels ``q0:q1`` of one image (``source`` (C, H·W) → ``out``
    (M, Ho, Wo)), each panel expanded into ``padded`` and filtered from there."""
    m = out.shape[0]
    kh = taps.shape[0]
    wp, width = padded.shape[1], padded.shape[2]
    hp = window_extent(oh1 - oh0, kh, sh, dh)
    first = oh0 * sh - top  # the input row of padded row 0
    s0, s1 = max(0, first) * wd, min(h, first + hp) * wd
    lo = min(wp, left)
    hi = max(lo, min(wp, left + wd))
    groups = width // _LANES
    for p in range(q0, q1):
        _pad(padded, hp, first, h, lo, hi)
        if s0 < s1:
            _expand(source, panels, p, bias1, padded, block, s0, s1, wd, first, left, finish, a1, b1)
        for j in range(groups):
            g = p * groups + j
            if g * _LANES >= m:
                break
            _filter(padded[:hp, :, j * _LANES:(j + 1) * _LANES], taps, bias2, acc, out, g, oh0, oh1, sh, sw, dh,
                    dw, act2, a2, b2)


@kernel
def _filter(plane: np.ndarray, taps: np.ndarray, bias2: np.ndarray, acc: np.ndarray, out: np.ndarray, g: int,
            oh0: int, oh1: int, sh: int, sw: int, dh: int, dw: int, act2: int, a2: float, b2: float) -> None:
    """The depthwise sums of vector group ``g`` of the channels for output rows ``oh0:oh1`` from
    its padded channels-last ``plane`` (the band's rows), activated, into ``out`` (M, Ho, Wo).
    (Each part a function of its own: inlined into one, their loops' values spilled.)"""
    m, ho, wo = out.shape
    c0 = g * _LANES
    channels = min(_LANES, m - c0)
    count = (oh1 - oh0) * wo
    positions = ho * wo
    start = acc[count]
    for k in range(_LANES):
        start[k] = bias2[c0 + k] if k < channels else 0.0
    for oh in range(oh1 - oh0):
        output_row(plane, taps, start, acc[oh * wo:(oh + 1) * wo], oh * sh, g, sw, dh, dw)
    if act2 != NONE:  # (+ -0.0: the activation alone, as `Epilogue.apply_inplace`)
        _apply_run(acc[:count].reshape(-1), _NEGATIVE_ZERO, act2, a2, b2)
    for p0 in range(0, count, _LANES):
        n = min(_LANES, count - p0)
        transpose(acc, p0 * _LANES, _LANES, n, channels, out, c0 * positions + oh0 * wo + p0, positions, n)


@kernel
def expand_depthwise_range(panels: np.ndarray, x: np.ndarray, taps: np.ndarray, bias1: np.ndarray, bias2: np.ndarray,
                           out: np.ndarray, scratch: np.ndarray, i0: int, i1: int, q0: int, q1: int, oh0: int,
                           oh1: int, band: int, sh: int, sw: int, dh: int, dw: int, top: int, left: int, act1: int,
                           a1: float, b1: float, act2: int, a2: float, b2: float) -> None:
    """Images ``i0:i1``, panels ``q0:q1`` of expanded channels and output rows ``oh0:oh1`` (every
    row: 0, -1) of ``act2(depthwise(act1(expand(x))))``, float32: ``panels`` (P, C, W) the 1x1's
    weights in panels (`pointwise.pack_weights` of one group), ``bias1`` (P·W,) zero past M; ``taps``
    (kh, kw, ≥ P·W) the depthwise weights channels last, zero past M, ``bias2`` (M,); ``x`` (N, C, H, W) and ``out`` (N, M, Ho, Wo)
    C-contiguous; bands of ``band`` output rows; ``scratch`` holds `scratch_floats` values.
    Strides, dilations and the top/left pads are the depthwise conv's; ``act`` codes and their
    ``a``, ``b`` as `compiled.epilogue`'s."""
    n, c, h, wd = x.shape
    ho, wo = out.shape[2], out.shape[3]
    kh, kw = taps.shape[0], taps.shape[1]
    width = panels.shape[2]
    hp, wp = window_extent(band, kh, sh, dh), window_extent(wo, kw, sw, dw)
    size = hp * wp * width
    padded = scratch[:size].reshape(hp, wp, width)
    acc = scratch[size:size + (band * wo + 1) * _LANES].reshape(band * wo + 1, _LANES)
    at = size + (band * wo + 1) * _LANES
    block = scratch[at:at + WIDE_ROWS * width].reshape(WIDE_ROWS, width)
    if oh1 < 0:
        oh1 = ho
    finish = finishing(act1)
    for i in range(i0, i1):
        source = x[i].reshape(c, h * wd)
        for r0 in range(oh0, oh1, band):
            _band(panels, source, taps, bias1, bias2, out[i], padded, acc, block, h, wd, q0, q1, r0,
                  min(oh1, r0 + band), sh, sw, dh, dw, top, left, finish, _F(a1), _F(b1), act2, _F(a2), _F(b2))


@kernel
def post_expand_depthwise(control: np.ndarray, panels: np.ndarray, x: np.ndarray, taps: np.ndarray,
                          bias1: np.ndarray, bias2: np.ndarray, out: np.ndarray, parts: np.ndarray,
                          geometry: np.ndarray, band: int, scratch: np.ndarray, acts: np.ndarray,
                          numbers: np.ndarray) -> int:
    """Post part ``i + 1`` of ``parts`` (rows i0, i1, q0, q1, oh0, oh1) to helper ``i`` of a claimed
    team's ``control``, its scratch ``scratch[i]``, for `expand_depthwise_part` to run (``geometry``
    = sh, sw, dh, dw, top, left; ``acts`` the two activation codes, ``numbers`` their float64 a1,
    b1, a2, b2); the number of those helpers found asleep (the caller wakes them)."""
    sleeping = 0
    for i in range(parts.shape[0] - 1):
        row = control[i]
        row[KIND] = PART_KIND
        at = ARGS
        for d in range(4):
            row[at + d] = x.shape[d]
        for d in range(3):
            row[at + 4 + d] = panels.shape[d]
            row[at + 7 + d] = taps.shape[d]
            row[at + 10 + d] = out.shape[1 + d]
        row[at + 13], row[at + 14], row[at + 15] = panels.ctypes.data, x.ctypes.data, taps.ctypes.data
        row[at + 16], row[at + 17], row[at + 18] = bias1.ctypes.data, bias2.ctypes.data, out.ctypes.data
        row[at + 19], row[at + 20], row[at + 21] = scratch[i].ctypes.data, scratch.shape[1], numbers.ctypes.data
        for d in range(6):
            row[at + 22 + d] = parts[i + 1, d]
            row[at + 28 + d] = geometry[d]
        row[at + 34], row[at + 35], row[at + 36] = band, acts[0], acts[1]
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel
def finish_expand_depthwise(control: np.ndarray, panels: np.ndarray, x: np.ndarray, taps: np.ndarray,
                            bias1: np.ndarray, bias2: np.ndarray, out: np.ndarray, parts: np.ndarray,
                            geometry: np.ndarray, band: int, own: np.ndarray, acts: np.ndarray, numbers: np.ndarray,
                            rounds: int) -> bool:
    """Run part 0 of ``parts`` here (``own`` this thread's scratch), then wait for the parts
    `post_expand_depthwise` posted; False when a helper is not done within ``rounds`` spins (the
    caller then waits the slow way, `SpinTeam.wait`)."""
    expand_depthwise_range(panels, x, taps, bias1, bias2, out, own, parts[0, 0], parts[0, 1], parts[0, 2],
                           parts[0, 3], parts[0, 4], parts[0, 5], band, geometry[0], geometry[1], geometry[2],
                           geometry[3], geometry[4], geometry[5], acts[0], numbers[0], numbers[1], acts[1],
                           numbers[2], numbers[3])
    return wait_all(control, parts.shape[0] - 1, rounds)


@kernel
def post_and_finish_expand_depthwise(control: np.ndarray, panels: np.ndarray, x: np.ndarray, taps: np.ndarray,
                                     bias1: np.ndarray, bias2: np.ndarray, out: np.ndarray, parts: np.ndarray,
                                     geometry: np.ndarray, band: int, scratch: np.ndarray, own: np.ndarray,
                                     acts: np.ndarray, numbers: np.ndarray, rounds: int) -> int:
    """`post_expand_depthwise`, then `finish_expand_depthwise` unless a helper was asleep:
    `spin_team.HELPERS_ASLEEP` (nothing run here yet), `PARTS_DONE` or `PARTS_RUNNING`."""
    if post_expand_depthwise(control, panels, x, taps, bias1, bias2, out, parts, geometry, band, scratch, acts,
                             numbers):
        return HELPERS_ASLEEP
    if finish_expand_depthwise(control, panels, x, taps, bias1, bias2, out, parts, geometry, band, own, acts, numbers,
                               rounds):
        return PARTS_DONE
    return PARTS_RUNNING


@numba.njit(inline="always")
def expand_depthwise_part(control: np.ndarray) -> None:
    """Run the `expand_depthwise_range` part posted in a spin team's ``control`` row
    (`post_expand_depthwise`): the helper's side (a `team_parts` runner)."""
    at = ARGS
    n, c, h, wd = control[at], control[at + 1], control[at + 2], control[at + 3]
    m, ho, wo = control[at + 10], control[at + 11], control[at + 12]
    panels = numba.carray(address_as_pointer(control[at + 13], np.float32),
                          (control[at + 4], control[at + 5], control[at + 6]))
    x = numba.carray(address_as_pointer(control[at + 14], np.float32), (n, c, h, wd))
    taps = numba.carray(address_as_pointer(control[at + 15], np.float32),
                        (control[at + 7], control[at + 8], control[at + 9]))
    bias1 = numba.carray(address_as_pointer(control[at + 16], np.float32), (control[at + 4] * control[at + 6],))
    bias2 = numba.carray(address_as_pointer(control[at + 17], np.float32), (m,))
    out = numba.carray(address_as_pointer(control[at + 18], np.float32), (n, m, ho, wo))
    scratch = numba.carray(address_as_pointer(control[at + 19], np.float32), (control[at + 20],))
    numbers = numba.carray(address_as_pointer(control[at + 21], np.float64), (4,))
    p, q = at + 22, at + 28
    expand_depthwise_range(panels, x, taps, bias1, bias2, out, scratch, control[p], control[p + 1], control[p + 2],
                           control[p + 3], control[p + 4], control[p + 5], control[at + 34], control[q],
                           control[q + 1], control[q + 2], control[q + 3], control[q + 4], control[q + 5],
                           control[at + 35], numbers[0], numbers[1], control[at + 36], numbers[2], numbers[3])
