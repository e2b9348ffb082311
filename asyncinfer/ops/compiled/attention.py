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

from ...concurrency.spin_team import ARGS, address_as_pointer, addresses
from . import inline, kernel, reduction
from .blas_call import ILP64, SGEMM, sgemm, sgemm_bt
from .gemm import WIDTH, panel_gemm, strided
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


#: This module's kinds of spin-team part (see `team_parts`): heads of `attention_heads`, heads
#: of `attention_products`.
PART_KIND, PRODUCTS_PART_KIND = 1, 15
#: Scores `attention_products` holds at once per thread (a block of query rows by every key):
#: 1 MiB, in L2 while the block is masked, normalised and multiplied by V.
PRODUCT_SCORES = 1 << 18


@kernel
def _vector(at: int, n: int) -> np.ndarray:
    """The ``n`` float32 values at address ``at``."""
    return numba.carray(address_as_pointer(at, np.float32), (n,))


@inline
def _mask_and_softmax(scores: np.ndarray, s32: np.float32, divides: bool, use_scale: bool, keep_row: np.ndarray,
                      f32: np.float32, use_keep: bool, bias_row: np.ndarray, use_bias: bool) -> None:
    """One row of raw scores → its attention weights, in place: scaled (divided or multiplied by
    ``s32``), ``f32`` where ``keep_row`` is false, ``bias_row`` added (each mask row of the
    scores' width or 1, broadcast), then softmax: the arithmetic of the layers it replaces."""
    keys = scores.shape[0]
    keep_last, bias_last = keep_row.shape[0] - 1, bias_row.shape[0] - 1
    if not use_keep and (not use_bias or bias_last == keys - 1):  # the common case, vectorised
        for t in range(keys):
            x = scores[t]
            if use_scale:
                x = x / s32 if divides else x * s32
            if use_bias:
                x = x + bias_row[t]
            scores[t] = x
    else:
        for t in range(keys):
            x = scores[t]
            if use_scale:
                x = x / s32 if divides else x * s32
            if use_keep and not keep_row[min(t, keep_last)]:
                x = f32
            if use_bias:
                x = x + bias_row[min(t, bias_last)]
            scores[t] = x
    softmax_row(scores, scores)


@kernel
def masked_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, divides: bool, use_scale: bool,
                     keep: np.ndarray, fill: float, use_keep: bool, bias: np.ndarray, use_bias: bool,
                     y: np.ndarray) -> None:
    """``y[b, h, s] = softmax(mask(scale(q[b, h, s] · k[b, h', t] for each t))) @ v[b, h']`` with
    ``h' = h // (heads / kv_heads)``: float32 Q ``(B, H, S, D)``, K ``(B, Hkv, T, D)``, V
    ``(B, Hkv, T, Dv)``, each with a unit last stride; ``keep`` (bool) and ``bias`` 4-D, each
    dimension that of ``(B, H, S, T)`` or 1 (broadcast). Masked scores are ``fill``
    (``Where(keep, scores, fill)``), then ``bias`` is added."""
    attention_heads(q, k.ctypes.data, k.strides[0], k.strides[1], k.strides[2], v.ctypes.data, v.strides[0],
                    v.strides[1], v.strides[2], k.shape[1], k.shape[2], v.shape[3], scale, divides, use_scale,
                    keep, fill, use_keep, bias, use_bias, y, 0, q.shape[1])


@kernel
def attention_heads(q: np.ndarray, k_at: int, ks0: int, ks1: int, ks2: int, v_at: int, vs0: int, vs1: int,
                    vs2: int, kv_heads: int, keys: int, width: int, scale: float, divides: bool, use_scale: bool,
                    keep: np.ndarray, fill: float, use_keep: bool, bias: np.ndarray, use_bias: bool,
                    y: np.ndarray, h0: int, h1: int) -> None:
    """`masked_attention` for query heads ``h0:h1`` of every batch entry, K and V given by address
    and byte strides (so that a spin-team helper, which receives integers, runs it too). Each
    row's arithmetic is the same whichever thread runs which heads."""
    batch, heads, queries, depth = q.shape
    group = heads // kv_heads
    s32, f32 = np.float32(scale), np.float32(fill)
    scores = np.empty(keys, np.float32)
    for b in range(batch):
        for h in range(h0, h1):
            kh = h // group
            k_head, v_head = k_at + b * ks0 + kh * ks1, v_at + b * vs0 + kh * vs1
            for s in range(queries):
                row = _row(q, b, h, s)
                keep_row = keep[min(b, keep.shape[0] - 1), min(h, keep.shape[1] - 1), min(s, keep.shape[2] - 1)]
                bias_row = bias[min(b, bias.shape[0] - 1), min(h, bias.shape[1] - 1), min(s, bias.shape[2] - 1)]
                for t in range(keys):
                    scores[t] = _dot(row, _vector(k_head + t * ks2, depth))
                _mask_and_softmax(scores, s32, divides, use_scale, keep_row, f32, use_keep, bias_row, use_bias)
                out = y[b, h, s]
                for j in range(width):
                    out[j] = 0
                for t in range(keys):
                    p = scores[t]
                    value = _vector(v_head + t * vs2, width)
                    for j in range(width):
                        out[j] += p * value[j]


@kernel
def attention_part(control: np.ndarray) -> None:
    """Run the `attention_heads` part posted in a spin team's ``control`` row by `post_heads`
    (the helper's side, a `team_parts` runner)."""
    batch, heads, queries, depth = control[ARGS], control[ARGS + 1], control[ARGS + 2], control[ARGS + 3]
    kv_heads, keys, width = control[ARGS + 4], control[ARGS + 5], control[ARGS + 6]
    q = numba.carray(address_as_pointer(control[ARGS + 7], np.float32), (batch, heads, queries, depth))
    y = numba.carray(address_as_pointer(control[ARGS + 8], np.float32), (batch, heads, queries, width))
    k_at, ks0, ks1, ks2 = control[ARGS + 9], control[ARGS + 10], control[ARGS + 11], control[ARGS + 12]
    v_at, vs0, vs1, vs2 = control[ARGS + 13], control[ARGS + 14], control[ARGS + 15], control[ARGS + 16]
    keep, bias, numbers, flags = _masks_at(control, ARGS)
    attention_heads(q, k_at, ks0, ks1, ks2, v_at, vs0, vs1, vs2, kv_heads, keys, width, numbers[0],
                    (flags & 1) != 0, (flags & 2) != 0, keep, numbers[1], (flags & 4) != 0, bias,
                    (flags & 8) != 0, y, control[ARGS + 29], control[ARGS + 30])


@inline
def _masks_at(args: np.ndarray, at: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The masks, numbers and flags both parts' integers hold from ``args[at + 17]`` on (see
    `head_arguments`, `product_arguments`): keep (4-D bytes), bias (4-D float32), [scale, fill]
    (float64) and the flags (1 divides, 2 scales, 4 keep, 8 bias)."""
    keep = numba.carray(address_as_pointer(args[at + 17], np.uint8),
                        (args[at + 18], args[at + 19], args[at + 20], args[at + 21]))
    bias = numba.carray(address_as_pointer(args[at + 22], np.float32),
                        (args[at + 23], args[at + 24], args[at + 25], args[at + 26]))
    numbers = numba.carray(address_as_pointer(args[at + 27], np.float64), (2,))
    return keep, bias, numbers, args[at + 28]


def head_arguments(q: np.ndarray, k: np.ndarray, v: np.ndarray, numbers: np.ndarray, divides: bool, use_scale: bool,
                   keep: np.ndarray, use_keep: bool, bias: np.ndarray, use_bias: bool, y: np.ndarray, h0: int,
                   h1: int) -> list[int]:
    """The integers of a part `attention_part` runs as heads ``h0:h1`` (for `SpinTeam.try_run`):
    C-contiguous float32 ``q`` and ``y``, ``keep`` as C-contiguous bytes, C-contiguous float32
    ``bias``, ``numbers`` = float64 [scale, fill]; the caller keeps every array alive until the
    part is done."""
    q_at, y_at, k_at, v_at, keep_at, bias_at, numbers_at = addresses(q, y, k, v, keep, bias, numbers)[:7]
    return [PART_KIND, *q.shape, k.shape[1], k.shape[2], v.shape[3], q_at, y_at, k_at, *k.strides[:3], v_at,
            *v.strides[:3], keep_at, *keep.shape, bias_at, *bias.shape, numbers_at,
            int(divides) | int(use_scale) << 1 | int(use_keep) << 2 | int(use_bias) << 3, h0, h1]


@kernel
def attention_products(q_at: int, qs0: int, qs1: int, qs2: int, k_at: int, ks0: int, ks1: int, ks2: int,
                       v_at: int, vs0: int, vs1: int, vs2: int, y_at: int, ys0: int, ys1: int, ys2: int,
                       shape: np.ndarray, scale: float, divides: bool, use_scale: bool, keep: np.ndarray,
                       fill: float, use_keep: bool, bias: np.ndarray, use_bias: bool, fn: int, ilp64: bool,
                       h0: int, h1: int, on_panels: bool) -> None:
    """`masked_attention` for query heads ``h0:h1`` of every batch entry as two BLAS products a
    block of query rows: ``scores = Q Kᵀ`` (`sgemm_bt`), each row masked and normalised
    (`_mask_and_softmax`), ``Y = scores V`` (`sgemm`). For many query rows (an encoder, a
    prefill), where `attention_heads`' dot product per key is 2-3x slower than BLAS.

    ``on_panels``: both products on `gemm.panel_gemm` instead (K's head transposed once into
    whole panels of keys, the padding's scores never read; ``Y = scores V`` by BLAS still where
    the value width is no whole number of panels).

    Q, K, V and Y are given by address and byte strides (their last stride 4: unit), so a head's
    rows are read and written in place whatever the layout: ``(B, S, H, D)`` tensors before the
    heads' transposes, a merged-heads output. ``shape``: batch, heads, kv_heads, queries, keys,
    depth, width. A row's result depends on the shapes alone, not on who runs which heads."""
    batch, heads, kv_heads, queries, keys, depth, width = (shape[0], shape[1], shape[2], shape[3], shape[4],
                                                           shape[5], shape[6])
    group = heads // kv_heads
    s32, f32 = np.float32(scale), np.float32(fill)
    block = max(1, min(queries, PRODUCT_SCORES // max(keys, 1)))
    padded = -(-keys // WIDTH) * WIDTH if on_panels else keys  # (a row of scores, a whole number of panels)
    scores = np.empty((block, padded), np.float32)
    at = scores.ctypes.data
    k_t = np.zeros((depth if on_panels else 0, padded), np.float32)  # a head's keys transposed
    values_on_panels = on_panels and width % WIDTH == 0
    no_bias = scores[0]  # (unread: the products have no bias)
    for b in range(batch):
        for h in range(h0, h1):
            kh = h // group
            k_head, v_head = k_at + b * ks0 + kh * ks1, v_at + b * vs0 + kh * vs1
            if on_panels and (h == h0 or group == 1 or h % group == 0):
                k_rows = strided(k_head, (1, keys, depth), 0, ks2 // 4)[0]
                for j in range(keys):
                    for d in range(depth):
                        k_t[d, j] = k_rows[j, d]
            for s0 in range(0, queries, block):
                rows = min(block, queries - s0)
                q_rows = q_at + b * qs0 + h * qs1 + s0 * qs2
                if on_panels:
                    panel_gemm(strided(q_rows, (1, rows, depth), 0, qs2 // 4)[0], k_t, scores[:rows], no_bias, 0,
                               padded // WIDTH, False)
                else:
                    sgemm_bt(fn, ilp64, rows, keys, depth, q_rows, qs2 // 4, k_head, ks2 // 4, at, keys)
                for r in range(rows):
                    s = s0 + r
                    keep_row = keep[min(b, keep.shape[0] - 1), min(h, keep.shape[1] - 1), min(s, keep.shape[2] - 1)]
                    bias_row = bias[min(b, bias.shape[0] - 1), min(h, bias.shape[1] - 1), min(s, bias.shape[2] - 1)]
                    _mask_and_softmax(scores[r, :keys], s32, divides, use_scale, keep_row, f32, use_keep, bias_row,
                                      use_bias)
                y_rows = y_at + b * ys0 + h * ys1 + s0 * ys2
                if values_on_panels:
                    panel_gemm(strided(at, (1, rows, keys), 0, padded)[0],
                               strided(v_head, (1, keys, width), 0, vs2 // 4)[0],
                               strided(y_rows, (1, rows, width), 0, ys2 // 4)[0], no_bias, 0, width // WIDTH, False)
                else:
                    sgemm(fn, ilp64, rows, width, keys, at, padded, v_head, vs2 // 4, y_rows, ys2 // 4)


@kernel
def products_part(control: np.ndarray) -> None:
    """Run the `attention_products` part posted in a spin team's ``control`` row by
    `product_arguments` (the helper's side, a `team_parts` runner)."""
    products_from(control, ARGS)


@kernel
def products_from(args: np.ndarray, at: int) -> None:
    """Run the `attention_products` part whose integers (`product_arguments`, after the kind)
    start at ``args[at]``: a helper's control row, or the caller's own part in one array (one
    compiled call from Python, where 30 arguments cost microseconds to type)."""
    shape = numba.carray(address_as_pointer(args[at + 16], np.int64), (7,))
    keep, bias, numbers, flags = _masks_at(args, at)
    attention_products(args[at], args[at + 1], args[at + 2], args[at + 3], args[at + 4], args[at + 5], args[at + 6],
                       args[at + 7], args[at + 8], args[at + 9], args[at + 10], args[at + 11], args[at + 12],
                       args[at + 13], args[at + 14], args[at + 15], shape, numbers[0], (flags & 1) != 0,
                       (flags & 2) != 0, keep, numbers[1], (flags & 4) != 0, bias, (flags & 8) != 0, args[at + 29],
                       args[at + 30] != 0, args[at + 31], args[at + 32], (flags & 16) != 0)


def product_arguments(places: list[int], shape: np.ndarray, numbers: np.ndarray, divides: bool, use_scale: bool,
                      keep: np.ndarray, use_keep: bool, bias: np.ndarray, use_bias: bool, h0: int,
                      h1: int, on_panels: bool = False) -> list[int]:
    """The integers of a part `products_part` runs as heads ``h0:h1`` (for `SpinTeam.try_run`,
    or, after the kind, `products_from`): ``places`` the 16 addresses and byte strides of Q, K, V
    and Y as `attention_products` takes them, ``shape`` its 7 sizes (int64), ``keep`` as
    C-contiguous 4-D bytes, ``bias`` C-contiguous 4-D float32, ``numbers`` float64 [scale, fill];
    BLAS is `blas_call.SGEMM`. The caller keeps every array alive until the part is done."""
    shape_at, keep_at, bias_at, numbers_at = addresses(shape, keep, bias, numbers)[:4]
    return [PRODUCTS_PART_KIND, *places, shape_at, keep_at, *keep.shape, bias_at, *bias.shape, numbers_at,
            int(divides) | int(use_scale) << 1 | int(use_keep) << 2 | int(use_bias) << 3 | int(on_panels) << 4, SGEMM,
            int(ILP64), h0, h1]
