"""Squeeze-and-excitation in one compiled call: pool, two small products, the gate, the scaling.

MobileNetV3's and EfficientNet's SE blocks do little arithmetic (a 576-channel block: 28 K values
pooled, two products of 83 K multiply-adds, 28 K values scaled) in five steps; run as NumPy and
BLAS calls each step cost 5-25 µs of set-up, 35-80 µs a block on 2 cores. Here the steps run in
one call, the pooled vector and the hidden one in registers' reach.

The products are dot products along rows of the weights, summed as `reduction`s (SIMD partial
sums), so they differ from BLAS's GEMV (the unfused 1x1 convs) by rounding alone.
"""
from __future__ import annotations

import numpy as np

from . import kernel, reduction
from .epilogue import _apply_run
from .rows import row_means

_U = np.uint64


@reduction
def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """``Σ a[i] · b[i]`` in the operands' precision (float32 rows)."""
    total = a.dtype.type(0.0)
    for i in range(a.size):
        total += a[_U(i)] * b[_U(i)]
    return total


@kernel
def squeeze_excite(x: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray,
                   kind1: int, a1: float, c1: float, kind2: int, a2: float, c2: float,
                   gate: np.ndarray, out: np.ndarray, scale: bool) -> None:
    """The gate of each image of ``x`` (N, C, HW), float32, into ``gate`` (N, C):
    ``act2(W2 · act1(W1 · mean(x[i]) + b1) + b2)``, ``w1`` (R, C), ``w2`` (C, R), biases (R,) and
    (C,) (zeros where the model has none); ``kind``/``a``/``c``: each activation's
    `compiled.epilogue` code and parameters. With ``scale``, also ``out[i, c] = x[i, c] · gate[i, c]``
    (``out`` as ``x``); else the caller scales (a large map, shared with the spinning helpers)."""
    n, c, hw = x.shape
    r = w1.shape[0]
    pooled = np.empty(c, np.float32)
    hidden = np.empty(r, np.float32)
    negative_zero = np.float32(-0.0)  # (the activation alone: the bias is in already)
    for i in range(n):
        row_means(x[i], pooled)  # (GlobalAveragePool's own means)
        for j in range(r):
            hidden[j] = _dot(w1[j], pooled) + b1[j]
        _apply_run(hidden, negative_zero, kind1, np.float32(a1), np.float32(c1))
        g = gate[i]
        for k in range(c):
            g[k] = _dot(w2[k], hidden) + b2[k]
        _apply_run(g, negative_zero, kind2, np.float32(a2), np.float32(c2))
        if scale:
            for k in range(c):
                plane, scaled, factor = x[i, k], out[i, k], g[k]
                for p in range(hw):
                    scaled[_U(p)] = plane[_U(p)] * factor
