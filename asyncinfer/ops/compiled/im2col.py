"""2-D im2col over exactly the output positions, read from the unpadded input.

``cols[c·kh·kw + i·kw + j, oh·Wo + ow] = x[c, oh·sh + i·dh − top, ow·sw + j·dw − left]``, zero
where that lies in the padding. NumPy builds the same matrix with one strided copy of a padded
6-D view, whose innermost run is a single output row read at stride ``sw``; here each row of the
result is written in one pass (zero prefix, body, zero suffix) without padding the input first.
"""
from __future__ import annotations

import numpy as np

from . import kernel

_U = np.uint64


@kernel
def im2col2d(x: np.ndarray, cols: np.ndarray, kernel_shape: tuple, out_width: int, strides: tuple,
             dilations: tuple, pads: tuple) -> None:
    """Fill the first C·kh·kw rows of ``cols`` (rows, Ho·Wo) from ``x`` (C, H, W); further rows
    are left untouched. ``out_width`` is Wo; ``pads`` are the top and left pads."""
    c_in, h, wd = x.shape
    kh, kw = kernel_shape
    wo = out_width
    sh, sw = strides
    dh, dw = dilations
    top, left = pads
    ho = cols.shape[1] // wo
    for c in range(c_in):
        for i in range(kh):
            for j in range(kw):
                dst_row = cols[(c * kh + i) * kw + j]
                shift = j * dw - left
                lo = 0 if shift >= 0 else min(wo, (sw - 1 - shift) // sw)
                hi = max(lo, min(wo, (wd - 1 - shift) // sw + 1))
                for oh in range(ho):
                    dst = dst_row[oh * wo:(oh + 1) * wo]
                    ih = oh * sh + i * dh - top
                    if ih < 0 or ih >= h:
                        for ow in range(wo):
                            dst[_U(ow)] = 0
                        continue
                    src = x[c, ih]
                    for ow in range(lo):
                        dst[_U(ow)] = 0
                    if sw == 1:
                        for ow in range(lo, hi):
                            dst[_U(ow)] = src[_U(ow + shift)]
                    else:
                        for ow in range(lo, hi):
                            dst[_U(ow)] = src[_U(ow * sw + shift)]
                    for ow in range(hi, wo):
                        dst[_U(ow)] = 0
