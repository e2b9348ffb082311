"""Scaled, masked softmax attention, one pass per query row: the `MaskedAttention` of a decode step.

A decode step's attention is 1 query row per head against ~100 cached keys: NumPy runs it as two
batched matrix products of 12 tiny matrices each, plus the scale, the masks and the softmax as
whole-array passes, ~100 µs a layer in call overheads. Here each (batch, head, query) row takes
its scores (a vectorised dot product per key), scales and masks them, takes their softmax (the
`Softmax` op's own row kernel) and sums the value rows it weighs, while all of it sits in L1.

The KV cache arrives as a view of the arena it grows in (`ops/cache_append.py`): rows are
contiguous but rows of one head are not adjacent. A non-contiguous array is compiled as strided
element access, which does not vectorise (10x slower), so rows are addressed through their
pointers instead: the caller guarantees a unit stride along the last axis of Q, K and V.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import address_as_pointer
from . import kernel, reduction
from .normalization import softmax_row


@reduction
def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """``Σ a[i]·b[i]`` in float32 (SIMD partial sums, as BLAS's own dot)."""
    total = np.float32(0.0)
    for i in range(a.shape[0]):
        total += a[i] * b[i]
    return total


@kernel
def _row(x: np.ndarray, b: int, h: int, r: int) -> np.ndarray:
    """Row ``x[b, h, r]`` (unit stride) as a contiguous array."""
    at = x.ctypes.data + b * x.strides[0] + h * x.strides[1] + r * x.strides[2]
    return numba.carray(address_as_pointer(at, np.float32), (x.shape[3],))


@kernel
def masked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, divides: bool, use_scale: bool,
                     keep: np.ndarray, fill: float, use_keep: bool, bias: np.ndarray, use_bias: bool,
                     y: np.ndarray) -> None:
    """``y[b, h, s] = softmax(mask(scale(q[b, h, s] · k[b, h', t] for each t))) @ v[b, h']`` with
    ``h' = h // (heads / kv_heads)``: float32 Q ``(B, H, S, D)``, K ``(B, Hkv, T, D)``, V
    ``(B, Hkv, T, Dv)``, each with a unit last stride; ``keep`` (bool) and ``bias`` 4-D, each
    dimension that of ``(B, H, S, T)`` or 1 (broadcast). Masked scores are ``fill``
    (``Where(keep, scores, fill)``), then ``bias`` is added."""
    batch, heads, queries, _ = q.shape
    kv_heads, keys, width = k.shape[1], k.shape[2], v.shape[3]
    group = heads // kv_heads
    s32, f32 = np.float32(scale), np.float32(fill)
    scores = np.empty(keys, np.float32)
    for b in range(batch):
        for h in range(heads):
            kh = h // group
            for s in range(queries):
                row = _row(q, b, h, s)
                keep_row = keep[min(b, keep.shape[0] - 1), min(h, keep.shape[1] - 1), min(s, keep.shape[2] - 1)]
                bias_row = bias[min(b, bias.shape[0] - 1), min(h, bias.shape[1] - 1), min(s, bias.shape[2] - 1)]
                keep_last, bias_last = keep_row.shape[0] - 1, bias_row.shape[0] - 1
                for t in range(keys):
                    x = _dot(row, _row(k, b, kh, t))
                    if use_scale:
                        x = x / s32 if divides else x * s32
                    if use_keep and not keep_row[min(t, keep_last)]:
                        x = f32
                    if use_bias:
                        x = x + bias_row[min(t, bias_last)]
                    scores[t] = x
                softmax_row(scores, scores)
                out = y[b, h, s]
                for j in range(width):
                    out[j] = 0
                for t in range(keys):
                    p = scores[t]
                    value = _row(v, b, kh, t)
                    for j in range(width):
                        out[j] += p * value[j]
