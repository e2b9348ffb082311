"""2-D im2col over exactly the output positions, read from the unpadded input.

``cols[c·kh·kw + i·kw + j, p − p0] = x[c, oh·sh + i·dh − top, ow·sw + j·dw − left]`` for the output
positions ``p = oh·Wo + ow`` in ``[p0, p1)``, zero where that lies in the padding. NumPy builds
the whole matrix with one strided copy of a padded 6-D view, whose innermost run is a single output
row read at stride ``sw``; here each output row's run is written in one pass (zero prefix, body,
zero suffix) without padding the input first, and a range of positions can be built alone: the
tiled conv (`asyncinfer.ops.conv_gemm`) builds one cache-sized block of columns at a time.
"""
from __future__ import annotations

import numpy as np

from . import kernel

_U = np.uint64


@kernel
def im2col2d(x: np.ndarray, cols: np.ndarray, kh: int, kw: int, wo: int, sh: int, sw: int, dh: int, dw: int,
             top: int, left: int, p0: int, p1: int) -> None:
    """Fill ``cols[:C·kh·kw, :p1 - p0]`` (rows, ≥ p1 − p0; rows contiguous) from ``x`` (C, H, W)
    for output positions ``[p0, p1)``; other rows and columns are left untouched. The kernel is
    ``kh × kw``, the output ``wo`` wide; strides ``sh, sw``, dilations ``dh, dw``, ``top`` and
    ``left`` pads (scalars: numba types tuples slowly on every call)."""
    c_in, h, wd = x.shape
    # per kernel column j: the output columns whose input column lies inside the image
    lo = np.empty(kw, np.int64)
    hi = np.empty(kw, np.int64)
    for j in range(kw):
        shift = j * dw - left
        lo[j] = 0 if shift >= 0 else min(wo, (sw - 1 - shift) // sw)
        hi[j] = max(lo[j], min(wo, (wd - 1 - shift) // sw + 1))
    p = p0
    while p < p1:  # one output row (or the part of it in the block) at a time
        oh = p // wo
        ow0 = p - oh * wo
        ow1 = min(wo, ow0 + (p1 - p))
        base = p - p0 - ow0  # column of ow in the block: base + ow (≥ 0 for ow ≥ ow0)
        for c in range(c_in):
            for i in range(kh):
                ih = oh * sh + i * dh - top
                row0 = (c * kh + i) * kw
                if ih < 0 or ih >= h:
                    for j in range(kw):
                        dst_row = cols[row0 + j]
                        for ow in range(ow0, ow1):
                            dst_row[_U(base + ow)] = 0
                    continue
                src = x[c, ih]
                for j in range(kw):
                    dst_row = cols[row0 + j]
                    shift = j * dw - left
                    a, z = max(ow0, min(lo[j], ow1)), max(ow0, min(hi[j], ow1))
                    for ow in range(ow0, a):
                        dst_row[_U(base + ow)] = 0
                    if sw == 1:
                        for ow in range(a, z):
                            dst_row[_U(base + ow)] = src[_U(ow + shift)]
                    else:
                        for ow in range(a, z):
                            dst_row[_U(base + ow)] = src[_U(ow * sw + shift)]
                    for ow in range(z, ow1):
                        dst_row[_U(base + ow)] = 0
        p += ow1 - ow0


@kernel
def im2col_flat(buf: np.ndarray, offsets: np.ndarray, cols: np.ndarray, v0: int, v1: int) -> None:
    """``cols[c·taps + t, :v1 - v0] = buf[c, offsets[t] + v0 : offsets[t] + v1]``: im2col over
    flat windows (``conv.FlatWindows``: the padded, phase-split input flattened per channel, so
    every tap reads one contiguous run of virtual positions). ``buf`` is (C, total)."""
    taps = offsets.size
    n = v1 - v0
    for c in range(buf.shape[0]):
        src_row = buf[c]
        for t in range(taps):
            dst = cols[c * taps + t]
            start = offsets[t] + v0
            for j in range(n):
                dst[_U(j)] = src_row[_U(start + j)]
