"""A few rows by weights packed in column panels: a register-blocked GEMM, ``y = a @ b``.

A batched decode step multiplies 2 to 16 rows by every weight matrix. Walking b row by row
(`few_rows._tile`) keeps y's band in L1 and loads and stores it for every few rows of b: that
loop is bound by its loads and stores, at about half the multiply-adds a core can do. The
classic remedy (BLAS, ONNX Runtime's MLAS) keeps a block of y in registers for the whole sum,
which needs b's columns in narrow contiguous panels: read in place, a panel of a row-major b is
one short run per row, 12 KiB apart, and the caches' sets and prefetchers serve that badly (a
cold 768 x 3072 weight took 1.3-1.6 ms, twice the row-wise loop). So a constant weight is packed
once (`pack_panels`, kept by the op beside the model's own copy, at the generation engine's first
batched step: `linalg.packing_weights`), like ORT's prepacked weights.

`panel_product` runs a block of rows against one panel at a time: ``BLOCK_ROWS`` rows x two
vectors of columns of y held in registers while K runs, from the panel's rows (one sequential
stream) and one broadcast value of a per row and step. The block is written in LLVM IR with
explicit vector types (`_register_block`): numba's loops leave such accumulators in memory.

**Each value of y is summed as in every other few-row kernel**: from zero, one multiply-add
after another along K, with the same contraction into FMA, so a row's bits are those it gets
alone in `few_rows._one_row_sequential` and in any batch, whatever the blocking or the CPU's
vector width.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import kernel

#: Vectors of columns each block of rows keeps in registers.
PANEL_VECTORS = 2


def _host_has(feature: str) -> bool:
    return binding.get_host_cpu_features().get(feature, False)


# AVX-512 has 32 vector registers of 64 bytes: 8 rows x 2 vectors of accumulators leave room for
# the panel's two vectors and a broadcast. AVX2 and NEON have 16 (or 32 narrower) ones: 4 rows of
# 32-byte vectors (LLVM splits them into NEON's 16-byte ones).
_WIDE = _host_has("avx512f")
#: Bytes of one vector of the block (LLVM legalises it to the CPU's registers).
VECTOR_BYTES = 64 if _WIDE else 32
#: Rows of a (and of y) per register block.
BLOCK_ROWS = 8 if _WIDE else 4


def panel_width(dtype: Any) -> int:
    """Columns of one panel for ``dtype`` (float32: 32 with AVX-512, 16 otherwise)."""
    return PANEL_VECTORS * VECTOR_BYTES // np.dtype(dtype).itemsize


def pack_panels(b: np.ndarray) -> np.ndarray:
    """``b`` (k, n)'s whole panels, ``(n // W, k, W)`` C-contiguous (W = `panel_width`): panel p
    is ``b[:, p * W:(p + 1) * W]``. The last ``n % W`` columns are left to the row-wise loop.
    Copied in compiled code, without the GIL: a model's weights are hundreds of megabytes, and
    the event loop must not wait for them."""
    width = panel_width(b.dtype)
    k, n = b.shape
    panels = np.empty((n // width, k, width), b.dtype)
    _pack(np.ascontiguousarray(b), panels)
    return panels


# `_pack` copies tiles of this many rows of b by this many panels: runs of 4 KiB on both sides
# (panel by panel, it read 128 bytes from each row of b, a page apart: 0.45 GB/s on GPT-2's
# 768 x 50257 logits weight, which tiles copy at several GB/s).
_PACK_ROWS, _PACK_PANELS = 32, 32


@kernel
def _pack(b: np.ndarray, panels: np.ndarray) -> None:
    count, k, width = panels.shape
    for k0 in range(0, k, _PACK_ROWS):
        for p0 in range(0, count, _PACK_PANELS):
            for p in range(p0, min(p0 + _PACK_PANELS, count)):
                for kk in range(k0, min(k0 + _PACK_ROWS, k)):
                    source = b[kk, p * width:(p + 1) * width]
                    target = panels[p, kk]
                    for j in range(width):
                        target[j] = source[j]


def no_panels(dtype: Any) -> np.ndarray:
    """The empty panels of a product that has none (the kernels' arguments are typed arrays)."""
    return _NO_PANELS[np.dtype(dtype)]


_NO_PANELS = {np.dtype(t): np.empty((0, 0, panel_width(t)), t) for t in (np.float32, np.float64)}


def _register_block(rows: int) -> Any:
    """An intrinsic ``block(columns, panels, y, r0, p, k0, k1)``: ``y[r0:r0 + rows, p*W:(p+1)*W] =
    a[r0:r0 + rows, k0:k1] @ panels[p, k0:k1]`` where ``columns`` is a's block of K transposed
    (``columns[k - k0, r] = a[r, k]``, so a step's values of a are on one cache line). The block of
    y is held in vector registers (allocas that LLVM promotes) while k runs, and the next panel's
    same rows are prefetched as this one's are used (a panel's rows are one sequential run, but a
    split along K leaves a gap between panels that the hardware prefetcher does not cross)."""

    @intrinsic
    def block(typingctx: Any, columns: Any, panels: Any, y: Any, r0: Any, p: Any, k0: Any, k1: Any) -> Any:
        signature = types.void(columns, panels, y, r0, p, k0, k1)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            i64, i32 = ir.IntType(64), ir.IntType(32)
            a_arr, panel_arr, y_arr = (context.make_array(t)(context, builder, v)
                                       for t, v in zip(sig.args[:3], args[:3]))
            r0_, p_, k0_, k1_ = (context.cast(builder, v, t, types.int64) for v, t in zip(args[3:], sig.args[3:]))
            element = context.get_value_type(sig.args[0].dtype)
            size = context.get_abi_sizeof(element)
            lanes = VECTOR_BYTES // size
            vector = ir.VectorType(element, lanes)
            byte_ptr = ir.IntType(8).as_pointer()
            prefetch = builder.module.declare_intrinsic(
                "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]))

            def at(base: Any, offset: Any) -> Any:
                return builder.gep(builder.bitcast(base, byte_ptr), [offset])

            def const(value: int) -> Any:
                return ir.Constant(i64, value)

            a_step = builder.extract_value(a_arr.strides, 0)
            y_stride = builder.extract_value(y_arr.strides, 0)
            panel_stride, row_stride = (builder.extract_value(panel_arr.strides, i) for i in (0, 1))
            a_rows = at(a_arr.data, builder.mul(r0_, const(size)))
            y_block = at(y_arr.data, builder.add(builder.mul(r0_, y_stride),
                                                  builder.mul(p_, const(PANEL_VECTORS * VECTOR_BYTES))))
            panel = at(panel_arr.data, builder.mul(p_, panel_stride))
            zero = ir.Constant(vector, [0.0] * lanes)
            sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(PANEL_VECTORS)] for _ in range(rows)]
            undefined = ir.Constant(vector, ir.Undefined)
            broadcast = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
            with cgutils.for_range(builder, builder.sub(k1_, k0_)) as loop:
                row = at(panel, builder.mul(builder.add(loop.index, k0_), row_stride))
                ahead = at(row, panel_stride)  # (a prefetch never faults, past the last panel too)
                for line in range(0, PANEL_VECTORS * VECTOR_BYTES, 64):
                    builder.call(prefetch, [at(ahead, const(line)), ir.Constant(i32, 0), ir.Constant(i32, 2),
                                            ir.Constant(i32, 1)])
                columns = [builder.load(builder.bitcast(at(row, const(v * VECTOR_BYTES)), vector.as_pointer()),
                                        align=size) for v in range(PANEL_VECTORS)]
                step = at(a_rows, builder.mul(loop.index, a_step))
                for r in range(rows):
                    value = builder.load(builder.bitcast(at(step, const(r * size)), element.as_pointer()), align=size)
                    spread = builder.shuffle_vector(
                        builder.insert_element(undefined, value, ir.Constant(i32, 0)), undefined, broadcast)
                    for v in range(PANEL_VECTORS):
                        # contract, like the kernels' own code: the same FMA (or not) as every few-row sum
                        product = builder.fmul(spread, columns[v], flags=("contract",))
                        builder.store(builder.fadd(builder.load(sums[r][v]), product, flags=("contract",)), sums[r][v])
            for r in range(rows):
                y_row = at(y_block, builder.mul(const(r), y_stride))
                for v in range(PANEL_VECTORS):
                    builder.store(builder.load(sums[r][v]),
                                  builder.bitcast(at(y_row, const(v * VECTOR_BYTES)), vector.as_pointer()), align=size)
            return context.get_dummy_value()

        return signature, codegen

    return block


_block8, _block4, _block2, _block1 = (_register_block(rows) for rows in (8, 4, 2, 1))


@kernel
def panel_product(a: np.ndarray, panels: np.ndarray, y: np.ndarray, k0: int, k1: int) -> None:
    """``y[:, :P*W] = a[:, k0:k1] @ b[k0:k1, :P*W]`` for b packed by `pack_panels` (P panels):
    every block of rows of a panel in turn, so the panel streams from memory once and the other
    blocks find it in L2. ``a`` and ``y`` have contiguous rows."""
    m = a.shape[0]
    columns = np.empty((k1 - k0, m), a.dtype)
    for kk in range(k1 - k0):
        for r in range(m):
            columns[kk, r] = a[r, k0 + kk]
    for p in range(panels.shape[0]):
        r = 0
        if BLOCK_ROWS == 8:
            while r + 8 <= m:
                _block8(columns, panels, y, r, p, k0, k1)
                r += 8
        while r + 4 <= m:
            _block4(columns, panels, y, r, p, k0, k1)
            r += 4
        if r + 2 <= m:
            _block2(columns, panels, y, r, p, k0, k1)
            r += 2
        if r < m:
            _block1(columns, panels, y, r, p, k0, k1)
