"""Stride 2 across a row as two unit-stride ones: a row split into its even and odd columns.

A window loop at stride 2 reads every other input column: strided loads, which LLVM does not
vectorise. Split once into its two *phases*, the row gives every tap a contiguous run: the input
column ``2·ow + shift`` is element ``ow + q`` of phase ``shift % 2`` (`phase_tap`). Used by the
depthwise conv and max pool loops.
"""
from __future__ import annotations

import numpy as np

from . import inline

_U = np.uint64


@inline
def split_even_odd(src: np.ndarray, even: np.ndarray, odd: np.ndarray) -> None:
    """``even[q] = src[2q]`` and ``odd[q] = src[2q + 1]`` (``even`` one longer on odd widths)."""
    width = src.shape[0]
    for q in range(width // 2):
        even[_U(q)] = src[_U(2 * q)]
        odd[_U(q)] = src[_U(2 * q + 1)]
    if width % 2:
        even[_U(width // 2)] = src[_U(width - 1)]


@inline
def phase_tap(shift: int, width: int, out_width: int) -> tuple[int, int, int, int]:
    """For the tap reading input column ``2·ow + shift`` of a row ``width`` wide: ``(parity, q,
    lo, hi)``, its phase, the offset into it, and the outputs ``lo <= ow < hi`` it reaches inside
    the row (the phase holds ``(width + 1 - parity) // 2`` columns)."""
    parity = shift % 2
    lo = 0 if shift >= 0 else (1 - shift) // 2
    hi = min(out_width, (width - 1 - shift) // 2 + 1)
    return parity, (shift - parity) // 2, lo, hi
