"""The GEMM epilogue: bias and activation applied while a block of GEMM results is stored.

BLAS writes ``W @ columns`` and stops; a conv still owes a bias per output channel and, after the
optimizer's fusion, an activation. As NumPy passes over the output these are one or two more
trips through memory each (the output of an early CNN layer is megabytes); here they happen in
the one pass that moves a cache-resident block of GEMM results to its place in the output.

``kind`` selects the activation (the ``NONE`` ... ``SWISH`` codes below, with its parameters
``a``/``b``); each has its own loop, so every loop vectorises. The activations are the scalar
forms of `compiled.activations`, so a fused activation gives the very bits of the standalone op.
"""
from __future__ import annotations

import numpy as np

from . import inline, kernel
from .activations import hard_sigmoid1, hard_swish1, sigmoid1, swish1

NONE, RELU, CLIP, LEAKY_RELU, HARD_SIGMOID, HARD_SWISH, SIGMOID, SWISH = range(8)

_U = np.uint64


@inline
def _store_run(src: np.ndarray, dst: np.ndarray, bi: float, kind: int, av: float, bv: float) -> None:
    """``dst[j] = act(src[j] + bi)`` over one contiguous run (both 1-D, same length)."""
    zero = np.float32(0.0)
    if kind == NONE:
        for j in range(src.size):
            dst[_U(j)] = src[_U(j)] + bi
    elif kind == RELU:  # np.maximum(v, 0): NaN passes, -0 stays -0
        for j in range(src.size):
            v = src[_U(j)] + bi
            dst[_U(j)] = zero if v < zero else v
    elif kind == CLIP:  # max with the low bound, then min with the high one (ONNX's order)
        for j in range(src.size):
            v = src[_U(j)] + bi
            v = av if v < av else v
            dst[_U(j)] = bv if v > bv else v
    elif kind == LEAKY_RELU:
        for j in range(src.size):
            v = src[_U(j)] + bi
            dst[_U(j)] = v if v >= zero else av * v
    elif kind == HARD_SIGMOID:
        for j in range(src.size):
            dst[_U(j)] = hard_sigmoid1(src[_U(j)] + bi, av, bv)
    elif kind == HARD_SWISH:
        for j in range(src.size):
            dst[_U(j)] = hard_swish1(src[_U(j)] + bi)
    elif kind == SIGMOID:
        for j in range(src.size):
            dst[_U(j)] = sigmoid1(src[_U(j)] + bi)
    else:  # SWISH
        for j in range(src.size):
            dst[_U(j)] = swish1(src[_U(j)] + bi, av)


@inline
def _apply_run(row: np.ndarray, bi: float, kind: int, av: float, bv: float) -> None:
    """``row[j] = act(row[j] + bi)`` in place: one array, so the loop vectorises (a store from a
    block into itself would make LLVM fall back to scalar code for the overlap)."""
    zero = np.float32(0.0)
    if kind == NONE:
        for j in range(row.size):
            row[_U(j)] = row[_U(j)] + bi
    elif kind == RELU:
        for j in range(row.size):
            v = row[_U(j)] + bi
            row[_U(j)] = zero if v < zero else v
    elif kind == CLIP:
        for j in range(row.size):
            v = row[_U(j)] + bi
            v = av if v < av else v
            row[_U(j)] = bv if v > bv else v
    elif kind == LEAKY_RELU:
        for j in range(row.size):
            v = row[_U(j)] + bi
            row[_U(j)] = v if v >= zero else av * v
    elif kind == HARD_SIGMOID:
        for j in range(row.size):
            row[_U(j)] = hard_sigmoid1(row[_U(j)] + bi, av, bv)
    elif kind == HARD_SWISH:
        for j in range(row.size):
            row[_U(j)] = hard_swish1(row[_U(j)] + bi)
    elif kind == SIGMOID:
        for j in range(row.size):
            row[_U(j)] = sigmoid1(row[_U(j)] + bi)
    else:  # SWISH
        for j in range(row.size):
            row[_U(j)] = swish1(row[_U(j)] + bi, av)


@kernel(contract=False)
def apply_rows(y: np.ndarray, bias: np.ndarray, kind: int, a: float, b: float) -> None:
    """``y[i, j] = act(y[i, j] + bias[i])`` in place, float32 ``y`` (rows, width) with contiguous
    rows: the epilogue of a result BLAS wrote straight into the output."""
    av, bv = np.float32(a), np.float32(b)
    for i in range(y.shape[0]):
        _apply_run(y[i], bias[i], kind, av, bv)


@kernel(contract=False)
def store_rows(block: np.ndarray, bias: np.ndarray, out: np.ndarray, v0: int, row_width: int, out_width: int,
               kind: int, a: float, b: float) -> None:
    """Store ``act(block[i, j] + bias[i])`` for every row ``i`` of ``block`` (rows, width) into
    ``out`` (rows, positions; rows contiguous), float32.

    Column ``j`` of the block is the virtual position ``v = v0 + j`` of a grid ``row_width`` wide:
    output row ``v // row_width``, column ``v % row_width``, of which the first ``out_width`` are
    real and the rest (a flat im2col's padding columns) are dropped. With ``row_width ==
    out_width`` every column is real and the block is one run at ``out[i, v0:]``. Clip's bounds
    are ``a``/``b`` (±inf where absent); LeakyRelu's slope, Swish's alpha and HardSigmoid's
    alpha/beta are ``a``/``b``. ``block`` and ``out`` must not overlap (in place: `apply_rows`)."""
    rows, width = block.shape
    av, bv = np.float32(a), np.float32(b)
    for i in range(rows):
        src = block[i]
        bi = bias[i]
        if row_width == out_width:
            _store_run(src, out[i, v0:v0 + width], bi, kind, av, bv)
            continue
        v = v0
        while v < v0 + width:
            oh = v // row_width
            ow = v - oh * row_width
            end = min(v0 + width, v + row_width - ow)  # the end of this virtual row, or of the block
            real = min(end, v + max(0, out_width - ow))  # its real columns
            if real > v:
                dst0 = oh * out_width + ow
                _store_run(src[v - v0:real - v0], out[i, dst0:dst0 + real - v], bi, kind, av, bv)
            v = end
