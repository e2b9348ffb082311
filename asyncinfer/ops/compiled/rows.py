"""Reductions along one row of a float array, vectorised: the building blocks of the row kernels
(LayerNormalization, Softmax, global pooling).

A reduction is a chain of dependent operations that LLVM vectorises only if allowed to reorder it:
sums are compiled as `reduction`s (reassociated into SIMD partial sums: 0.05 ns an element against
0.3 in sequence). A maximum with NaN-aware compares is not vectorised even then, so `row_max` keeps
eight independent running maxima itself (2-3x faster than one). Sums accumulate in float64: no
less accurate than NumPy's pairwise float32 sums.
"""
from __future__ import annotations

import numpy as np

from . import kernel, reduction


@reduction
def row_sum(row: np.ndarray) -> float:
    """``Σ row[i]`` in float64."""
    total = 0.0
    for i in range(row.shape[0]):
        total += np.float64(row[i])
    return total


@reduction
def row_sum_squares(row: np.ndarray, shift: float) -> float:
    """``Σ (row[i] - shift)²`` in float64."""
    total = 0.0
    for i in range(row.shape[0]):
        c = np.float64(row[i] - shift)
        total += c * c
    return total


@reduction
def row_max(row: np.ndarray) -> float:
    """The largest value of ``row`` (NaN ignored; ``-inf`` for an empty row or a row of NaN)."""
    d = row.shape[0]
    whole = d // 8 * 8
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = row.dtype.type(-np.inf)
    for i in range(0, whole, 8):  # eight independent maxima: the compares of one step overlap
        v = row[i]
        m0 = v if v > m0 else m0
        v = row[i + 1]
        m1 = v if v > m1 else m1
        v = row[i + 2]
        m2 = v if v > m2 else m2
        v = row[i + 3]
        m3 = v if v > m3 else m3
        v = row[i + 4]
        m4 = v if v > m4 else m4
        v = row[i + 5]
        m5 = v if v > m5 else m5
        v = row[i + 6]
        m6 = v if v > m6 else m6
        v = row[i + 7]
        m7 = v if v > m7 else m7
    top = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
    for i in range(whole, d):
        top = row[i] if row[i] > top else top
    return top


@kernel
def row_means(x: np.ndarray, out: np.ndarray) -> None:
    """``out[r]`` = the mean of row ``r`` of ``x`` (R, D), summed in float64 (GlobalAveragePool)."""
    rows, d = x.shape
    for r in range(rows):
        out[r] = row_sum(x[r]) / d
