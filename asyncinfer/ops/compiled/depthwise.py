"""2-D depthwise convolution (one input channel per group) on NCHW tensors, four loops.

The two row loops make no padded copy: a tap only visits the output columns whose input column
lies inside the image (the others would read zero padding), and rows outside the image are
skipped.

- `depthwise_rows`: each output row is accumulated tap by tap; the inner loop runs along the row
  (SIMD over output columns). Best on wide maps at unit stride (little loop overhead per row).
- `depthwise_rows_stride2`: the row loop at stride 2 across, on each input row's even and odd
  columns (`phases`), so that every tap still reads a contiguous run. Best on wide maps.
- `depthwise_channels_last`: one image's channel block is first copied, a vector of channels at
  a time, into zero-padded channels-last scratch (ONNX Runtime's NCHWc layout), then runs of
  output pixels are summed in registers over the whole window (`depthwise_block`), and the
  result is written back to NCHW. Best with strides (no strided loads) and on small maps.
- `depthwise_flat`: square windows of 3, 5 or 7 at equal strides of 1 or 2, unit dilation and
  finite taps are summed in registers straight from NCHW (`depthwise_block.rows_block`: blocks
  of 4 output rows x 32 columns, or 8 rows x 16 on narrow maps, each input vector loaded once
  for every row of the block that reads it; rows and columns outside the image are not read, so
  there is no padded copy and no transpose). Other windows at unit stride: each channel is
  copied into a zero-padded plane, and every kernel row's taps add into the whole (virtual,
  padded-width) output in one contiguous pass. Best for 3x3 from about 20 columns out.

Indices are cast to unsigned where the loop makes them non-negative: numba then emits no
negative-index wraparound test, which would stop the loop vectorising.
"""
from __future__ import annotations

import numpy as np

from . import inline, kernel
from .depthwise_block import NARROW_BLOCK, ROW_STRIDES, ROW_WINDOWS, WIDE_BLOCK, output_row, rows_block, transpose
from .epilogue import NONE, _apply_run
from .panels import VECTOR_BYTES
from .phases import phase_tap, split_even_odd

_U = np.uint64
_F = np.float32
_NEGATIVE_ZERO = np.float32(-0.0)


@inline
def _tap(row: np.ndarray, src: np.ndarray, weight: float, shift: int, a: int, b: int) -> None:
    """``row[ow] += weight · src[ow + shift]`` for ``ow`` in ``[a, b)`` where ``src`` has it."""
    lo = max(a, -shift)
    hi = min(b, src.shape[0] - shift)
    for ow in range(lo, hi):
        row[_U(ow)] += weight * src[_U(ow + shift)]


@inline
def _three_taps(row: np.ndarray, src: np.ndarray, w0: float, w1: float, w2: float, s0: int, s1: int,
                s2: int) -> None:
    """One kernel row of three taps at unit stride (input columns ``ow + s0/s1/s2``, s0 < s1 < s2):
    where all three are inside the image, one pass adds their sum (a third of the passes over the
    output row); at the borders, each tap alone."""
    wo = row.shape[0]
    lo = min(wo, max(0, -s0))
    hi = max(lo, min(wo, src.shape[0] - s2))
    for ow in range(lo, hi):
        row[_U(ow)] += w0 * src[_U(ow + s0)] + w1 * src[_U(ow + s1)] + w2 * src[_U(ow + s2)]
    for weight, shift in ((w0, s0), (w1, s1), (w2, s2)):
        _tap(row, src, weight, shift, 0, lo)
        _tap(row, src, weight, shift, hi, wo)


@kernel
def depthwise_rows(x: np.ndarray, w: np.ndarray, bias: np.ndarray, out: np.ndarray, m0: int, m1: int,
                   sh: int, sw: int, dh: int, dw: int, top: int, left: int, multiplier: int) -> None:
    """Output channels ``m0:m1`` of every image of ``out`` (N, M, Ho, Wo).

    ``x`` is (N, C, H, W); ``w`` is (M, kh, kw); ``bias`` is (M,); output channel ``m`` reads
    input channel ``m // multiplier`` (ONNX's group order); strides ``sh, sw``, dilations
    ``dh, dw``, ``top`` and ``left`` pads (scalars: numba types tuples slowly on every call).
    """
    n_images, _, h, wd = x.shape
    _, _, ho, wo = out.shape
    kh, kw = w.shape[1], w.shape[2]
    for n in range(n_images):
        for m in range(m0, m1):
            c = m // multiplier
            b = bias[m]
            for oh in range(ho):
                row = out[n, m, oh]
                for ow in range(wo):
                    row[_U(ow)] = b
                for i in range(kh):
                    ih = oh * sh + i * dh - top
                    if ih < 0 or ih >= h:
                        continue
                    src = x[n, c, ih]
                    if sw == 1 and kw == 3:
                        _three_taps(row, src, w[m, i, 0], w[m, i, 1], w[m, i, 2], -left, dw - left, 2 * dw - left)
                        continue
                    for j in range(kw):
                        weight = w[m, i, j]
                        shift = j * dw - left
                        lo = 0 if shift >= 0 else (sw - 1 - shift) // sw
                        hi = min(wo, (wd - 1 - shift) // sw + 1)
                        if sw == 1:
                            for ow in range(lo, hi):
                                row[_U(ow)] += weight * src[_U(ow + shift)]
                        else:
                            for ow in range(lo, hi):
                                row[_U(ow)] += weight * src[_U(ow * sw + shift)]


@inline
def window_extent(out: int, kernel: int, stride: int, dilation: int) -> int:
    """Input rows (or columns) the windows of ``out`` outputs span, padding included: the height
    (width) of `depthwise_channels_last`'s padded copy."""
    return (out - 1) * stride + (kernel - 1) * dilation + 1


@inline
def vector_groups(channels: int, itemsize: int) -> int:
    """Groups of one register vector that ``channels`` channels of ``itemsize`` bytes take."""
    return -(-channels * itemsize // VECTOR_BYTES)


@kernel
def depthwise_channels_last(x: np.ndarray, w: np.ndarray, bias: np.ndarray, out: np.ndarray,
                            padded: np.ndarray, acc: np.ndarray, c0: int, c1: int,
                            sh: int, sw: int, dh: int, dw: int, top: int, left: int,
                            act: int, a: float, b: float, oh0: int, oh1: int) -> None:
    """Channels ``c0:c1`` of one image (multiplier 1), output rows ``oh0:oh1`` (every row: 0, -1):
    ``x`` (C, H, W) → ``out`` (C, Ho, Wo).

    The block's channels go by groups of one register vector (L lanes, `depthwise_block`): each
    group's map is copied channels last into ``padded[g]`` (Hp, Wp, L; Hp and Wp the
    `window_extent`), zero outside the image and past ``c1``; its output rows are summed in
    registers into ``acc[g]`` (at least Ho·Wo + 1 rows of L; the last holds the bias), activated
    there (``act``, ``a``, ``b``: a `compiled.epilogue` code, float32 only) while in cache, then
    written back to NCHW. ``padded`` has at least ``⌈(c1 − c0) / L⌉`` groups. ``w`` is (kh, kw,
    ≥ c0 + groups·L), zero past C; ``bias`` (C,). Scratch of ``x``'s dtype, C-contiguous. A range
    of rows copies only the input rows its windows read (a few channels on a large map, shared
    with the spinning helpers by rows: MobileNetV3's 16 channels at 112x112).
    """
    _, h, wd = x.shape
    _, ho, wo = out.shape
    _, hp, wp, lanes = padded.shape
    if oh1 < 0:
        oh1 = ho
    cb = c1 - c0
    positions = ho * wo
    first = oh0 * wo  # the range's first output position, and its count
    count = (oh1 - oh0) * wo
    hp = window_extent(oh1 - oh0, w.shape[0], sh, dh)  # (padded rows from the range's first window's)
    lo = min(wp, left)  # the padded columns that hold the image: [lo, hi)
    hi = max(lo, min(wp, left + wd))
    taps = w[:, :, c0:]
    flat = padded.reshape(-1)
    row_floats = wp * lanes
    for g in range(-(-cb // lanes)):
        channels = min(lanes, cb - g * lanes)
        plane = padded[g]
        for r in range(hp):
            ih = oh0 * sh + r - top
            base = (g * padded.shape[1] + r) * row_floats
            inside = 0 <= ih < h
            for e in range(base + (hi * lanes if inside else 0), base + row_floats):  # right of the image
                flat[_U(e)] = 0.0
            if inside:
                for e in range(base, base + lo * lanes):  # left of it
                    flat[_U(e)] = 0.0
                for q0 in range(lo, hi, lanes):
                    transpose(x, ((c0 + g * lanes) * h + ih) * wd + q0 - left, h * wd, channels, min(lanes, hi - q0),
                              padded, ((g * padded.shape[1] + r) * wp + q0) * lanes, lanes, lanes)
        sums = acc[g]
        start = sums[count]
        for k in range(lanes):
            start[_U(k)] = bias[c0 + g * lanes + k] if k < channels else 0.0
        for oh in range(oh1 - oh0):
            output_row(plane, taps, start, sums[oh * wo:(oh + 1) * wo], oh * sh, g, sw, dh, dw)
        if act != NONE:  # (+ -0.0: the activation alone, as `Epilogue.apply_inplace`)
            _apply_run(sums[:count].reshape(-1), _NEGATIVE_ZERO, act, _F(a), _F(b))
        for p0 in range(0, count, lanes):
            n = min(lanes, count - p0)
            transpose(acc, (g * acc.shape[1] + p0) * lanes, lanes, n, channels,
                      out, (c0 + g * lanes) * positions + first + p0, positions, n)


@kernel
def depthwise_rows_stride2(x: np.ndarray, w: np.ndarray, bias: np.ndarray, out: np.ndarray, m0: int, m1: int,
                           sh: int, dh: int, top: int, left: int, multiplier: int, phases: np.ndarray) -> None:
    """`depthwise_rows` for a horizontal stride of 2 (dilation 1): each input plane is first split
    into its even and odd columns (``phases``, at least (2, H, (W + 1) // 2), of ``x``'s dtype),
    so that every tap reads a contiguous run and the row loop vectorises as at stride 1.

    A kernel of its own, though its loop skeleton is `depthwise_rows`'s: folded into that one as a
    branch, it made LLVM compile the unit-stride loop 1.7x slower (measured, then reverted)."""
    n_images, _, h, wd = x.shape
    _, _, ho, wo = out.shape
    kh, kw = w.shape[1], w.shape[2]
    last = -1
    for n in range(n_images):
        for m in range(m0, m1):
            c = m // multiplier
            if n * x.shape[1] + c != last:  # a new input plane: split its columns by parity
                last = n * x.shape[1] + c
                for ih in range(h):
                    split_even_odd(x[n, c, ih], phases[0, ih], phases[1, ih])
            b = bias[m]
            for oh in range(ho):
                row = out[n, m, oh]
                for ow in range(wo):
                    row[_U(ow)] = b
                for i in range(kh):
                    ih = oh * sh + i * dh - top
                    if ih < 0 or ih >= h:
                        continue
                    for j in range(kw):
                        weight = w[m, i, j]
                        parity, q, lo, hi = phase_tap(j - left, wd, wo)
                        src = phases[parity, ih]
                        for ow in range(lo, hi):
                            row[_U(ow)] += weight * src[_U(ow + q)]


@inline
def _row_taps(acc: np.ndarray, plane: np.ndarray, w: np.ndarray, m: int, i: int, row0: int, step: int,
              count: int) -> None:
    """``acc[v] += Σ_j w[m, i, j] · plane[v + row0 + j·step]`` over ``v < acc.size`` for the ``count``
    taps of kernel row ``i``: 3, 5 and 7 taps in one pass (one load and store of ``acc`` for all of
    them), others one pass each."""
    n = acc.shape[0]
    if count == 3:
        w0, w1, w2 = w[m, i, 0], w[m, i, 1], w[m, i, 2]
        for v in range(n):
            p = _U(v + row0)
            acc[_U(v)] += w0 * plane[p] + w1 * plane[p + _U(step)] + w2 * plane[p + _U(2 * step)]
    elif count == 5:
        w0, w1, w2, w3, w4 = w[m, i, 0], w[m, i, 1], w[m, i, 2], w[m, i, 3], w[m, i, 4]
        for v in range(n):
            p = _U(v + row0)
            acc[_U(v)] += (w0 * plane[p] + w1 * plane[p + _U(step)] + w2 * plane[p + _U(2 * step)]
                           + w3 * plane[p + _U(3 * step)] + w4 * plane[p + _U(4 * step)])
    elif count == 7:
        w0, w1, w2, w3 = w[m, i, 0], w[m, i, 1], w[m, i, 2], w[m, i, 3]
        w4, w5, w6 = w[m, i, 4], w[m, i, 5], w[m, i, 6]
        for v in range(n):
            p = _U(v + row0)
            acc[_U(v)] += (w0 * plane[p] + w1 * plane[p + _U(step)] + w2 * plane[p + _U(2 * step)]
                           + w3 * plane[p + _U(3 * step)] + w4 * plane[p + _U(4 * step)]
                           + w5 * plane[p + _U(5 * step)] + w6 * plane[p + _U(6 * step)])
    else:
        for j in range(count):
            wt = w[m, i, j]
            off = row0 + j * step
            for v in range(n):
                acc[_U(v)] += wt * plane[_U(v + off)]


@inline
def _finite(w: np.ndarray, w0: int, count: int) -> bool:
    """Whether the ``count`` taps of ``w`` (flat) from ``w0`` are finite (an infinite one times a
    zero of the padding is NaN, which only the padded planes compute)."""
    for t in range(w0, w0 + count):
        if not np.isfinite(w[t]):
            return False
    return True


@inline
def _in_registers(x: np.ndarray, x0: int, h: int, wd: int, w: np.ndarray, w0: int, k: int, stride: int,
                  bias: float, y: np.ndarray, y0: int, ho: int, wo: int, top: int, left: int) -> None:
    """One channel's output (Ho, Wo) by a ``k`` x ``k`` window (`depthwise_block.ROW_WINDOWS`) at
    ``stride`` both ways (`ROW_STRIDES`) and unit dilation, straight from its input plane (H, W)
    at ``x0`` of the flat ``x``: strips of columns, blocks of their rows summed in registers
    (`depthwise_block.rows_block`; rows and columns outside the image are not read, so no padded
    copy is made). ``w0`` and ``y0`` locate the channel's taps and output in the flat ``w``, ``y``."""
    lanes = VECTOR_BYTES // x.itemsize
    narrow = wo <= lanes
    run = lanes * (NARROW_BLOCK[1] if narrow else WIDE_BLOCK[1])  # columns a strip
    for ox0 in range(0, wo, run):
        rows_block(x, x0, -top, h, wd, stride * ox0 - left, min(run, wo - ox0), ho, w, w0, k, stride, bias, y,
                   y0 + ox0, wo, narrow)


@kernel
def depthwise_flat(x: np.ndarray, w: np.ndarray, bias: np.ndarray, out: np.ndarray, m0: int, m1: int,
                   sh: int, sw: int, dh: int, dw: int, top: int, left: int, multiplier: int, plane: np.ndarray,
                   acc: np.ndarray) -> None:
    """Output channels ``m0:m1`` of every image of ``out`` (N, M, Ho, Wo).

    A channel whose window is 3, 5 or 7 square, at equal strides of 1 or 2 and unit dilation, with
    finite taps, is summed in registers from its NCHW plane (`_in_registers`; ``plane`` and ``acc``
    unused). At other strides, or with an infinite tap, the channel takes `depthwise_rows`. Any
    other at unit stride, on a flat padded plane: the channel's input is copied once into ``plane``,
    zero padded to ``Wp = Wo + (kw - 1)·dw`` columns, so that tap (i, j) of every output reads
    ``plane[v + i·dh·Wp + j·dw]`` for the virtual position ``v = oh·Wp + ow``: one long contiguous
    pass over all of ``acc`` per kernel row (the row loop's passes are one output row long, the
    width of a vector or two on small maps), the columns ``ow ≥ Wo`` computed and dropped. ``acc``
    has at least ``Ho·Wp`` entries (a multiple of 16: no scalar remainder), ``plane`` at least
    ``acc.size + (kh − 1)·dh·Wp + (kw − 1)·dw`` (its tail is zeroed here). ``x``, ``w`` (M, kh, kw),
    ``bias`` as `depthwise_rows`."""
    n_images, _, h, wd = x.shape
    _, _, ho, wo = out.shape
    kh, kw = w.shape[1], w.shape[2]
    wp = wo + (kw - 1) * dw
    hp = ho + (kh - 1) * dh
    for k in range(hp * wp, plane.shape[0]):
        plane[_U(k)] = 0.0
    in_registers = dh == 1 and dw == 1 and kh == kw and kh in ROW_WINDOWS and sh == sw and sh in ROW_STRIDES
    x_flat, w_flat, out_flat = x.reshape(-1), w.reshape(-1), out.reshape(-1)
    for n in range(n_images):
        for m in range(m0, m1):
            c = m // multiplier
            if in_registers and _finite(w_flat, m * kh * kw, kh * kw):
                _in_registers(x_flat, (n * x.shape[1] + c) * h * wd, h, wd, w_flat, m * kh * kw, kh, sh, bias[m],
                              out_flat, (n * out.shape[1] + m) * ho * wo, ho, wo, top, left)
                continue
            if sh != 1 or sw != 1:
                depthwise_rows(x[n:n + 1], w, bias, out[n:n + 1], m, m + 1, sh, sw, dh, dw, top, left, multiplier)
                continue
            for r in range(hp):
                ih = r - top
                row = plane[r * wp:(r + 1) * wp]
                if ih < 0 or ih >= h:
                    for q in range(wp):
                        row[_U(q)] = 0.0
                    continue
                src = x[n, c, ih]
                lo = min(wp, left)
                hi = max(lo, min(wp, left + wd))
                for q in range(lo):
                    row[_U(q)] = 0.0
                for q in range(lo, hi):
                    row[_U(q)] = src[_U(q - left)]
                for q in range(hi, wp):
                    row[_U(q)] = 0.0
            b = bias[m]
            for v in range(acc.shape[0]):
                acc[_U(v)] = b
            for i in range(kh):
                _row_taps(acc, plane, w, m, i, i * dh * wp, dw, kw)
            for oh in range(ho):
                dst = out[n, m, oh]
                base = oh * wp
                for ow in range(wo):
                    dst[_U(ow)] = acc[_U(base + ow)]

