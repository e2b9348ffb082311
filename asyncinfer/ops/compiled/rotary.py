"""Rotary position embedding ("rotate half") in one pass: `RotaryHalfEmbedding`'s float32 kernel.

NumPy runs ``X·cos + Concat(-X[split:], X[:split])·sin`` as five whole-tensor passes (a slice
negated, a concatenation, two products, a sum): 250-360 µs for a Llama block's Q of 16 heads x 128
positions x 64. Here each row of X is read once, with its rows of cos and sin, and every output
element is the layers' own two products and sum (no fused multiply-add), so the bits are theirs.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import address_as_pointer
from . import kernel


@kernel(contract=False)
def rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, split: int, y: np.ndarray) -> None:
    """``y = x·cos + rotated·sin``, ``rotated = Concat(-x[..., split:], x[..., :split])``, over
    4-D float32 ``x`` (any strides, the last axis' unit: heads split by a transposed view) and
    ``y`` (C-contiguous), with ``cos`` and ``sin`` 4-D views broadcast to x's shape (zero
    strides where they broadcast) whose last axis has unit stride. Rows are addressed through
    pointers: views of 4-D arrays made per row cost 3x the arithmetic. (``a·c + (-b)·s`` is
    written ``a·c - b·s``: the same IEEE result.)"""
    d0, d1, d2, width = x.shape
    tail = width - split
    x_at, y_at, cos_at, sin_at = x.ctypes.data, y.ctypes.data, cos.ctypes.data, sin.ctypes.data
    for a in range(d0):
        for b in range(d1):
            for c in range(d2):
                row = numba.carray(address_as_pointer(x_at + a * x.strides[0] + b * x.strides[1] + c * x.strides[2],
                                                      np.float32), (width,))
                out = numba.carray(address_as_pointer(y_at + ((a * d1 + b) * d2 + c) * width * 4, np.float32),
                                   (width,))
                co = numba.carray(address_as_pointer(cos_at + a * cos.strides[0] + b * cos.strides[1]
                                                     + c * cos.strides[2], np.float32), (width,))
                si = numba.carray(address_as_pointer(sin_at + a * sin.strides[0] + b * sin.strides[1]
                                                     + c * sin.strides[2], np.float32), (width,))
                for j in range(tail):
                    out[j] = row[j] * co[j] - row[split + j] * si[j]
                for j in range(split):
                    out[tail + j] = row[tail + j] * co[tail + j] + row[j] * si[tail + j]
