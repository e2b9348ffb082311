"""Row-wise LayerNormalization and Softmax for float32, one call over all rows.

As NumPy expressions each is 6-10 whole-array operations, which on the small tensors of a
transformer (a few tokens × a few hundred features) cost 1-2 µs each in call overhead alone, and
on large ones stream the tensor through memory that many times. Here each row is read once for
its statistics and once to write the result, while it is in L1.

A reduction along a row (sum, max) is a chain of dependent adds that LLVM does not vectorise
without reordering it, which these kernels do themselves: `LANES` running partials, one per SIMD
lane, combined at the end of the row (the loop over lanes has no carried dependency, so it
vectorises; measured 2-6x faster than one accumulator on BERT's 128-wide rows). Statistics are
accumulated in float64 (then rounded to float32, the stash type): no less accurate than NumPy's
pairwise float32 sums.
"""
from __future__ import annotations

import numpy as np

from . import inline, kernel
from .activations import _exp

# Partial results per row reduction: one per float32 lane of a 512-bit register.
LANES = 16


@inline
def _row_sum(row: np.ndarray, shift: float, partial: np.ndarray) -> float:
    """``Σ (row[i] - shift)`` in float64, over `LANES` partial sums held in ``partial``."""
    d = row.shape[0]
    whole = d // LANES * LANES
    for j in range(LANES):
        partial[j] = 0.0
    for i in range(0, whole, LANES):
        for j in range(LANES):
            partial[j] += np.float64(row[i + j] - shift)
    total = 0.0
    for j in range(LANES):
        total += partial[j]
    for i in range(whole, d):
        total += np.float64(row[i] - shift)
    return total


@inline
def _row_sum_squares(row: np.ndarray, shift: float, partial: np.ndarray) -> float:
    """``Σ (row[i] - shift)²`` in float64, over `LANES` partial sums held in ``partial``."""
    d = row.shape[0]
    whole = d // LANES * LANES
    for j in range(LANES):
        partial[j] = 0.0
    for i in range(0, whole, LANES):
        for j in range(LANES):
            c = np.float64(row[i + j] - shift)
            partial[j] += c * c
    total = 0.0
    for j in range(LANES):
        total += partial[j]
    for i in range(whole, d):
        c = np.float64(row[i] - shift)
        total += c * c
    return total


@inline
def _row_max(row: np.ndarray, partial: np.ndarray) -> float:
    """The largest value of ``row`` (NaN ignored; ``-inf`` for a row of NaN), over `LANES`
    partial maxima held in ``partial``."""
    d = row.shape[0]
    whole = d // LANES * LANES
    for j in range(LANES):
        partial[j] = -np.inf
    for i in range(0, whole, LANES):
        for j in range(LANES):
            v = row[i + j]
            partial[j] = v if v > partial[j] else partial[j]
    top = partial[0]
    for j in range(1, LANES):
        top = partial[j] if partial[j] > top else top
    for i in range(whole, d):
        top = row[i] if row[i] > top else top
    return top


@kernel
def layer_norm_rows(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, has_bias: bool, epsilon: float,
                    y: np.ndarray, mean: np.ndarray, inv_std: np.ndarray) -> None:
    """Each row of ``x`` (R, D) normalised to ``y`` (R, D): ``(x - mean)·inv_std·scale + bias``
    with ``scale``/``bias`` of D values; ``mean`` and ``inv_std`` (R,) receive the statistics."""
    rows, d = x.shape
    partial = np.empty(LANES, np.float64)
    for r in range(rows):
        row = x[r]
        m = np.float32(_row_sum(row, np.float32(0.0), partial) / d)
        sq = _row_sum_squares(row, m, partial)
        inv = np.float32(1.0) / np.sqrt(np.float32(sq / d) + np.float32(epsilon))
        mean[r] = m
        inv_std[r] = inv
        out = y[r]
        if has_bias:
            for i in range(d):
                out[i] = (row[i] - m) * inv * scale[i] + bias[i]
        else:
            for i in range(d):
                out[i] = (row[i] - m) * inv * scale[i]


@kernel
def softmax_rows(x: np.ndarray, y: np.ndarray) -> None:
    """Each row of ``x`` (R, D) → ``y``: ``e^(x - max) / Σ e^(x - max)`` (a NaN anywhere in a row
    makes the whole row NaN through the sum; a row of -inf gives NaN, as the definition's 0/0)."""
    rows, d = x.shape
    partial = np.empty(LANES, np.float32)
    sums = np.empty(LANES, np.float64)
    for r in range(rows):
        row = x[r]
        out = y[r]
        top = _row_max(row, partial)
        if top != top or top == -np.inf:  # every value NaN or -inf: NaN, as e^(x - max) gives
            top = row[0]
        for i in range(d):
            out[i] = _exp(row[i] - top)
        inv = np.float32(1.0 / _row_sum(out, np.float32(0.0), sums))
        for i in range(d):
            out[i] = out[i] * inv
