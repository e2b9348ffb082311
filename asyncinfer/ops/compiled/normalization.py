"""Row-wise LayerNormalization and Softmax for float32, one call over all rows.

As NumPy expressions each is 6-10 whole-array operations, which on the small tensors of a
transformer (a few tokens × a few hundred features) cost 1-2 µs each in call overhead alone, and
on large ones stream the tensor through memory that many times. Here each row is read once for
its statistics and once to write the result, while it is in L1.

Statistics are accumulated in float64 (then rounded to float32, the stash type): no less accurate
than NumPy's pairwise float32 sums.
"""
from __future__ import annotations

import numpy as np

from . import kernel
from .activations import _exp


@kernel
def layer_norm_rows(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, has_bias: bool, epsilon: float,
                    y: np.ndarray, mean: np.ndarray, inv_std: np.ndarray) -> None:
    """Each row of ``x`` (R, D) normalised to ``y`` (R, D): ``(x - mean)·inv_std·scale + bias``
    with ``scale``/``bias`` of D values; ``mean`` and ``inv_std`` (R,) receive the statistics."""
    rows, d = x.shape
    for r in range(rows):
        row = x[r]
        total = 0.0
        for i in range(d):
            total += row[i]
        m = np.float32(total / d)
        sq = 0.0
        for i in range(d):
            c = np.float64(row[i] - m)
            sq += c * c
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
    """Each row of ``x`` (R, D) → ``y``: ``e^(x - max) / Σ e^(x - max)`` (NaN rows stay NaN;
    a row of -inf gives NaN, as the definition's 0/0)."""
    rows, d = x.shape
    for r in range(rows):
        row = x[r]
        out = y[r]
        top = row[0]
        for i in range(1, d):
            v = row[i]
            top = v if (v > top or v != v) else top
        total = 0.0
        for i in range(d):
            e = _exp(row[i] - top)
            out[i] = e
            total += e
        inv = np.float32(1.0 / total)
        for i in range(d):
            out[i] = out[i] * inv
