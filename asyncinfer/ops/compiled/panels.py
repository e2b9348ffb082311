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

import math
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...concurrency.aligned import aligned_bytes
from . import kernel
from .activations import exp_vector

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
#: Rows of a wide block, whose rows' values one pointer reaches (adjacent, or a constant stride
#: apart): 14 x two vectors of sums, the panel's two vectors and a broadcast fill AVX-512's 32
#: registers, where 8 rows leave the loop's loads and addressing a larger share. Only with AVX-512
#: (`WIDE_BLOCKS`): with 16 registers they would spill (and are not measured there).
WIDE_ROWS = 14
WIDE_BLOCKS = _WIDE


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
    shape = (n // width, k, width)
    # on a cache line: each step of a panel loads its row as whole vectors, and a row 16 bytes
    # off a line (NumPy's own alignment) straddles two lines at every step (2-3% of a conv's time)
    panels = aligned_bytes(math.prod(shape) * b.dtype.itemsize).view(b.dtype).reshape(shape)
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


class BlockIR:
    """What the codegen of every register block starts with, for arrays of ``dtype``: the element
    ``size`` in bytes, the ``vector`` type (`VECTOR_BYTES`), ``at(base, offset)`` (the address
    ``offset`` bytes past a pointer, as a byte pointer) and ``const(value)`` (an i64 constant)."""

    def __init__(self, context: Any, builder: Any, dtype: Any):
        self.builder = builder
        element = context.get_value_type(dtype)
        self.size = context.get_abi_sizeof(element)
        self.vector = ir.VectorType(element, VECTOR_BYTES // self.size)
        self.byte_ptr = ir.IntType(8).as_pointer()

    def at(self, base: Any, offset: Any) -> Any:
        return self.builder.gep(self.builder.bitcast(base, self.byte_ptr), [offset])

    @staticmethod
    def const(value: int) -> Any:
        return ir.Constant(ir.IntType(64), value)


def columns_of_eight(builder: Any, rows: list[Any]) -> list[Any]:
    """The 8x8 transpose of ``rows``, eight vectors of 8 floats: column ``j`` = ``rows[r][j]`` for
    r < 8, in three rounds of two-vector shuffles (pairs of lanes, then of pairs, then halves)."""
    def mix(a: Any, b: Any, picks: list[int]) -> Any:
        return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(ir.IntType(32), 8), picks))

    pairs = [(mix(rows[k], rows[k + 1], [0, 8, 1, 9, 4, 12, 5, 13]),
              mix(rows[k], rows[k + 1], [2, 10, 3, 11, 6, 14, 7, 15])) for k in range(0, 8, 2)]
    quads = []
    for first, second in (pairs[0:2], pairs[2:4]):
        quads.append([mix(first[h], second[h], picks) for h in (0, 1)
                      for picks in ([0, 1, 8, 9, 4, 5, 12, 13], [2, 3, 10, 11, 6, 7, 14, 15])])
    low, high = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    return ([mix(quads[0][j], quads[1][j], low) for j in range(4)]
            + [mix(quads[0][j], quads[1][j], high) for j in range(4)])


def transposed_writer(context: Any, builder: Any, y_arr: Any, first: Any, channel0: Any,
                      vector: Any, residual: Any = None) -> Callable[..., None]:
    """``write(values)`` for `_store_column_biased`: a block's finished ``values`` (positions x
    vectors of channels) stored transposed into ``y`` (channels, positions), ``y[channel0 + j,
    first + r]`` (i64 IR values), eight positions and eight channels at a time
    (`columns_of_eight`), a vector of 8 positions per channel (a last group of fewer positions:
    stores of 4, 2 and 1 of them): where a store of each value through a scratch block took a
    sixth of a shallow conv's time (16 -> 64 channels at 55x55).

    With ``residual`` (an array of y's shape, channels x positions), ``write(values, post)``
    stores ``post(value + residual[...])`` instead (``post`` None: the sum), a vector of
    positions of one channel at a time: a residual Add and its activation on the way out
    (`_store_residual`)."""
    i32, i64 = ir.IntType(32), ir.IntType(64)
    lanes = vector.count
    size = context.get_abi_sizeof(vector.element)
    undefined = ir.Constant(vector, ir.Undefined)
    y_stride = builder.extract_value(y_arr.strides, 0)
    r_stride = None if residual is None else builder.extract_value(residual.strides, 0)
    byte_ptr = ir.IntType(8).as_pointer()

    def write(values: list[list[Any]], post: Callable[[Any], Any] | None = None) -> None:
        for group in range(0, len(values), 8):
            rows = values[group:group + 8]
            count = len(rows)
            rows = rows + [[undefined] * len(rows[0])] * (8 - count)  # (lanes past count: never stored)
            for chunk in range(len(rows[0]) * lanes // 8):
                v, lane = divmod(chunk * 8, lanes)

                def channels(row: list[Any]) -> Any:  # the chunk's 8 channels of a row (past one vector: the next)
                    picks = ir.Constant(ir.VectorType(i32, 8), [lane + k for k in range(8)])
                    return builder.shuffle_vector(row[v], row[v + 1] if lane + 8 > lanes else undefined, picks)
                for j, column in enumerate(columns_of_eight(builder, [channels(row) for row in rows])):
                    channel = builder.add(channel0, ir.Constant(i64, chunk * 8 + j))
                    start = 0
                    for piece in (8, 4, 2, 1):  # count's binary digits, widest first
                        if count - start < piece:
                            continue
                        position = builder.mul(builder.add(first, ir.Constant(i64, group + start)),
                                               ir.Constant(i64, size))
                        target = builder.gep(builder.bitcast(y_arr.data, byte_ptr),
                                             [builder.add(builder.mul(channel, y_stride), position)])
                        part = column if piece == 8 else builder.shuffle_vector(
                            column, column, ir.Constant(ir.VectorType(i32, piece), list(range(start, start + piece))))
                        if residual is not None:
                            source = builder.gep(builder.bitcast(residual.data, byte_ptr),
                                                 [builder.add(builder.mul(channel, r_stride), position)])
                            part = builder.fadd(part, builder.load(builder.bitcast(source, part.type.as_pointer()),
                                                                   align=size))
                            part = part if post is None else post(part)
                        builder.store(part, builder.bitcast(target, part.type.as_pointer()), align=size)
                        start += piece
    return write


def _register_block(rows: int, column_bias: bool = False, rows_in_place: bool = False,
                    to_output: bool = False, ahead: int = 1, a_ahead: int = 0, residual: bool = False,
                    spread: bool = False) -> Any:
    """An intrinsic ``block(columns, panels, p, k0, k1, y, r0, c0, finish, bias, lo, hi)``:
    ``y[r0:r0 + rows, c0:c0 + W] = a[r0:r0 + rows, k0:k1] @ panels[p, k0:k1]``, finished as
    ``finish`` says (`RAW`, `BIAS`...; ``+=`` with `ADD_TO_Y` set in it: a later block of K,
    continuing each sum where the earlier one left it, so the bits are those of one pass), where
    ``columns`` is a's block of K transposed (``columns[k - k0, r] = a[r, k]``, so a step's values
    of a are on one cache line). The block of y is held in vector registers (allocas that LLVM
    promotes) while k runs, and the same rows of the panel ``ahead`` panels on are prefetched as
    this one's are used (a panel's rows are one sequential run, but a split along K leaves a gap
    between panels that the hardware prefetcher does not cross; `_strided8`... look two panels
    ahead; ``ahead`` 0: no prefetch).

    ``column_bias``: each of the block's columns has its own bias, ``bias[p·W + j]``, read whole
    vectors at a time (``bias`` padded to whole panels): the panels are a 1x1 conv's output
    channels and a's rows its positions (`pointwise.small_map_conv`).

    ``rows_in_place``: ``columns`` is a itself, rows of K (``a[r0 + r, k - k0]``, its rows a
    row stride apart), read in place: no transposed copy (128 x 512 took 47-147 µs to
    transpose, as long as its product), each step's values of a on ``rows`` cache lines that
    the next 15 steps read too (`gemm.panel_gemm`).

    ``to_output`` (8 or `WIDE_ROWS` rows, ``column_bias``): ``y`` is the conv's output (channels, positions) and
    the block's sums go to ``y[c0 + j, r0 + r]``, transposed in registers (`transposed_writer`);
    ``r0`` is also the first of a's columns read. The sums start from zero (no `ADD_TO_Y`).

    ``a_ahead``: each step also prefetches a's values that many bytes further on (`A_AHEAD`).

    ``residual``: the block takes one more argument, ``res``, an array of y's shape, and stores
    the conv's result plus ``res`` at the same place, then the residual Add's activation: `finish`
    `BIAS` (none) or `BIAS_RELU` (`_store_residual` for ``to_output``, else `_store_rows_residual`).

    ``spread`` (with ``ahead`` 0): the block takes two last arguments, ``ahead_at`` and
    ``ahead_step`` (bytes): step ``k`` prefetches the next panel's line at ``ahead_at + k·ahead_step``
    (and the one after where the step is more than a line), none with a step of 0: a panel's last
    blocks each prefetch a share of the next panel (`ahead_share`), one line a step or less,
    where each prefetched all of it two lines a step."""
    assert not to_output or (rows in (8, WIDE_ROWS) and column_bias and not rows_in_place)
    assert not residual or to_output or not column_bias

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        a_arr, panel_arr, y_arr = (context.make_array(t)(context, builder, v)
                                   for t, v in zip((sig.args[0], sig.args[1], sig.args[5]),
                                                   (args[0], args[1], args[5])))
        p_, k0_, k1_, r0_, c0_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 3, 4, 6, 7))
        code = BlockIR(context, builder, sig.args[0].dtype)
        size, vector, at, const = code.size, code.vector, code.at, code.const
        prefetch = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [code.byte_ptr, i32, i32, i32]))

        y_stride = builder.extract_value(y_arr.strides, 0)
        panel_stride, row_stride = (builder.extract_value(panel_arr.strides, i) for i in (0, 1))
        if rows_in_place:  # a step is the next value of each row; the rows a row stride apart
            spacing = builder.extract_value(a_arr.strides, 0)
            a_step = const(size)
            a_rows = at(a_arr.data, builder.mul(r0_, spacing))
        else:  # a step is a row of ``columns``, the block's rows side by side in it
            spacing = None
            a_step = builder.extract_value(a_arr.strides, 0)
            a_rows = at(a_arr.data, builder.mul(r0_, const(size)))
        y_block = at(y_arr.data, builder.add(builder.mul(r0_, y_stride), builder.mul(c0_, const(size))))
        panel = at(panel_arr.data, builder.mul(p_, panel_stride))

        def y_vector(r: int, v: int) -> Any:
            return builder.bitcast(at(y_block, builder.add(builder.mul(const(r), y_stride), const(v * VECTOR_BYTES))),
                                   vector.as_pointer())
        sums = initial_sums(context, builder, sig, args, None if to_output else y_vector, rows, PANEL_VECTORS,
                            vector)
        res_arr = context.make_array(sig.args[12])(context, builder, args[12]) if residual else None
        if spread:
            first = 13 if residual else 12
            ahead_at, ahead_step = (context.cast(builder, args[i], sig.args[i], types.int64)
                                    for i in (first, first + 1))
            spread_from = at(at(panel, panel_stride), ahead_at)

        def steps(spread_lines: int) -> None:
            """Every step into the sums, each prefetching ``spread_lines`` lines of the next panel."""
            with cgutils.for_range(builder, builder.sub(k1_, k0_)) as loop:
                row = at(panel, builder.mul(builder.add(loop.index, k0_), row_stride))
                later = at(row, builder.mul(panel_stride, const(ahead)))  # (a prefetch never faults)
                for line in range(0, PANEL_VECTORS * VECTOR_BYTES, 64) if ahead else ():
                    builder.call(prefetch, [at(later, const(line)), ir.Constant(i32, 0), ir.Constant(i32, 2),
                                            ir.Constant(i32, 1)])
                if spread_lines:
                    later = at(spread_from, builder.mul(loop.index, ahead_step))
                    for line in range(0, spread_lines * 64, 64):
                        builder.call(prefetch, [at(later, const(line)), ir.Constant(i32, 0), ir.Constant(i32, 2),
                                                ir.Constant(i32, 1)])
                columns = [builder.load(builder.bitcast(at(row, const(v * VECTOR_BYTES)), vector.as_pointer()),
                                        align=size) for v in range(PANEL_VECTORS)]
                step = at(a_rows, builder.mul(loop.index, a_step))
                if a_ahead:
                    builder.call(prefetch, [at(step, const(a_ahead)), ir.Constant(i32, 0), ir.Constant(i32, 3),
                                            ir.Constant(i32, 1)])
                multiply_add(builder, sums, step, columns, spacing)

        if spread:
            loops_by_ahead_step(builder, ahead_step, steps)
        else:
            steps(0)
        values = [[builder.load(v) for v in row] for row in sums]
        if residual and to_output:
            _store_residual(context, builder, sig, args, values, p_,
                            transposed_writer(context, builder, y_arr, r0_, c0_, vector, res_arr))
        elif residual:  # a's rows are y's: each vector plus the residual's at the same place
            res_stride = builder.extract_value(res_arr.strides, 0)
            res_block = at(res_arr.data, builder.add(builder.mul(r0_, res_stride), builder.mul(c0_, const(size))))

            def res_vector(r: int, v: int) -> Any:
                return builder.bitcast(at(res_block, builder.add(builder.mul(const(r), res_stride),
                                                                 const(v * VECTOR_BYTES))), vector.as_pointer())
            _store_rows_residual(context, builder, sig, args, values, y_vector, res_vector, r0_)
        elif column_bias:
            write = transposed_writer(context, builder, y_arr, r0_, c0_, vector) if to_output else None
            _store_column_biased(context, builder, sig, args, values, y_vector, p_, write)
        else:
            _store_finished(context, builder, sig, args, values, y_vector, r0_)
        return context.get_dummy_value()

    assert not spread or not ahead
    if residual and spread:
        @intrinsic
        def block_residual_spread(typingctx: Any, columns: Any, panels: Any, p: Any, k0: Any, k1: Any, y: Any,
                                  r0: Any, c0: Any, finish: Any, bias: Any, lo: Any, hi: Any, res: Any, ahead_at: Any,
                                  ahead_step: Any) -> Any:
            return (types.void(columns, panels, p, k0, k1, y, r0, c0, finish, bias, lo, hi, res, ahead_at,
                               ahead_step), codegen)
        return block_residual_spread

    if residual:
        @intrinsic
        def block_residual(typingctx: Any, columns: Any, panels: Any, p: Any, k0: Any, k1: Any, y: Any, r0: Any,
                           c0: Any, finish: Any, bias: Any, lo: Any, hi: Any, res: Any) -> Any:
            return types.void(columns, panels, p, k0, k1, y, r0, c0, finish, bias, lo, hi, res), codegen
        return block_residual

    if spread:
        @intrinsic
        def block_spread(typingctx: Any, columns: Any, panels: Any, p: Any, k0: Any, k1: Any, y: Any, r0: Any,
                         c0: Any, finish: Any, bias: Any, lo: Any, hi: Any, ahead_at: Any, ahead_step: Any) -> Any:
            return (types.void(columns, panels, p, k0, k1, y, r0, c0, finish, bias, lo, hi, ahead_at, ahead_step),
                    codegen)
        return block_spread

    @intrinsic
    def block(typingctx: Any, columns: Any, panels: Any, p: Any, k0: Any, k1: Any, y: Any, r0: Any, c0: Any,
              finish: Any, bias: Any, lo: Any, hi: Any) -> Any:
        return types.void(columns, panels, p, k0, k1, y, r0, c0, finish, bias, lo, hi), codegen

    return block


def initial_sums(context: Any, builder: Any, sig: Any, args: Any, y_vector: Callable[[int, int], Any] | None,
                 rows: int, vectors: int, vector: Any) -> list[list[Any]]:
    """A register block's sums (rows x vectors, allocas that LLVM promotes to registers): zero,
    or y's values where the ``finish`` code (``args[8]``) has `ADD_TO_Y` (never without a
    ``y_vector``: a block stored transposed, `transposed_writer`)."""
    zero = ir.Constant(vector, [0.0] * vector.count)
    if y_vector is None:
        return [[cgutils.alloca_once_value(builder, zero) for _ in range(vectors)] for _ in range(rows)]
    size = context.get_abi_sizeof(vector.element)
    finish = context.cast(builder, args[8], sig.args[8], types.int64)
    adding = builder.icmp_unsigned("!=", builder.and_(finish, ir.Constant(ir.IntType(64), ADD_TO_Y)),
                                   ir.Constant(ir.IntType(64), 0))
    sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(vectors)] for _ in range(rows)]
    # a branch, not a select: an unconditional load of y stalled every block's sums on y's lines,
    # cold when y is a fresh output (a stem's 3 MB: ~400 cycles a block, 3x3/2 3 -> 64 at half speed)
    with builder.if_then(adding, likely=False):
        for r in range(rows):
            for v in range(vectors):
                builder.store(builder.load(y_vector(r, v), align=size), sums[r][v])
    return sums


def multiply_add(builder: Any, sums: list[list[Any]], step: Any, columns: list[Any], spacing: Any = None) -> None:
    """One step of a register block: ``sums[r][v] += step[r] · columns[v]``, ``step`` a byte
    pointer to the step's value of each row (one broadcast each), the rows' values adjacent or
    ``spacing`` bytes apart (an i64 IR value)."""
    vector = columns[0].type
    element, lanes, i32, i64 = vector.element, vector.count, ir.IntType(32), ir.IntType(64)
    size = {ir.FloatType: 4, ir.DoubleType: 8}[type(element)]
    undefined = ir.Constant(vector, ir.Undefined)
    broadcast = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
    for r, row in enumerate(sums):
        offset = ir.Constant(i64, r * size) if spacing is None else builder.mul(spacing, ir.Constant(i64, r))
        at = builder.gep(step, [offset])
        value = builder.load(builder.bitcast(at, element.as_pointer()), align=size)
        spread = builder.shuffle_vector(builder.insert_element(undefined, value, ir.Constant(i32, 0)), undefined,
                                        broadcast)
        for v, column in enumerate(columns):
            # contract, like the kernels' own code: the same FMA (or not) as every few-row sum
            product = builder.fmul(spread, column, flags=("contract",))
            builder.store(builder.fadd(builder.load(row[v]), product, flags=("contract",)), row[v])


#: What a register block does to its sums before it stores them (``finish``): nothing, or add the
#: row's bias, then nothing more, Relu, Clip to [lo, hi], LeakyRelu of slope lo, HardSigmoid
#: (alpha lo, beta hi), HardSwish, Sigmoid or Swish (alpha lo; float32 only). Each as the scalar
#: loops of `compiled.epilogue` do it (the same comparisons, FMAs and `activations.exp_vector`,
#: NaN and -0 kept alike), so the same bits as the standalone op.
(RAW, BIAS, BIAS_RELU, BIAS_CLIP, BIAS_LEAKY_RELU, BIAS_HARD_SIGMOID, BIAS_HARD_SWISH, BIAS_SIGMOID,
 BIAS_SWISH) = range(9)
#: Set in a register block's ``finish``: its sums start from y's values (a later block of K).
ADD_TO_Y = 16


class _Finisher:
    """What `_store_finished` and `_store_column_biased` share: the ``finish`` code (``args[8]``, one
    of `RAW`...), the ``bias`` array (``args[9]``), the bounds ``lo``, ``hi`` (``args[10:12]``) as
    vectors, and each finish's activation on a vector."""

    def __init__(self, context: Any, builder: Any, sig: Any, args: Any, vector: Any):
        self.builder = builder
        self.code = builder.and_(context.cast(builder, args[8], sig.args[8], types.int64),
                                 ir.Constant(ir.IntType(64), ADD_TO_Y - 1))
        self.bias = context.make_array(sig.args[9])(context, builder, args[9])
        self.vector = vector
        i32 = ir.IntType(32)
        self._undefined = ir.Constant(vector, ir.Undefined)
        self._broadcast = ir.Constant(ir.VectorType(i32, vector.count), [0] * vector.count)
        zero = ir.Constant(vector, [0.0] * vector.count)
        lo, hi = (self.spread(context.cast(builder, args[i], sig.args[i], sig.args[9].dtype)) for i in (10, 11))

        def select(condition: str, a: Any, b: Any, then: Any, otherwise: Any) -> Any:
            return builder.select(builder.fcmp_ordered(condition, a, b), then, otherwise)

        bits = 32 if isinstance(vector.element, ir.FloatType) else 64
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                             f"llvm.fma.v{vector.count}f{bits}")
        one, half, sixth = (ir.Constant(vector, [value] * vector.count)
                            for value in (1.0, 0.5, float(np.float32(1.0 / 6.0))))

        def gate(g: Any) -> Any:  # `activations.hard_sigmoid1`'s clamp: 0 below 0, 1 above 1, NaN kept
            return select("<", g, zero, zero, select(">", g, one, one, g))

        self.activations: dict[int, Callable[[Any], Any]] = {
            BIAS: lambda v: v,
            BIAS_RELU: lambda v: select("<", v, zero, zero, v),
            BIAS_CLIP: lambda v: (lambda low: select(">", low, hi, hi, low))(select("<", v, lo, lo, v)),
            BIAS_LEAKY_RELU: lambda v: select(">=", v, zero, v, builder.fmul(lo, v)),
            BIAS_HARD_SIGMOID: lambda v: gate(builder.call(fma, [lo, v, hi])),
            BIAS_HARD_SWISH: lambda v: builder.fmul(v, gate(builder.call(fma, [v, sixth, half]))),
        }
        if bits == 32:  # `activations.sigmoid1` and `swish1`
            self.activations[BIAS_SIGMOID] = lambda v: builder.fdiv(one, builder.fadd(one, exp_vector(builder,
                                                                                                    builder.fneg(v))))
            self.activations[BIAS_SWISH] = lambda v: builder.fdiv(v, builder.fadd(one, exp_vector(
                builder, builder.fmul(builder.fneg(lo), v))))

    def spread(self, value: Any) -> Any:
        """``value`` in every lane."""
        return self.builder.shuffle_vector(
            self.builder.insert_element(self._undefined, value, ir.Constant(ir.IntType(32), 0)), self._undefined,
            self._broadcast)

    def cases(self, store: Callable[[Callable[[Any], Any] | None], None]) -> None:
        """Branch on the finish code once: ``store(None)`` for `RAW`, ``store(activation)`` (after
        the bias) for each other code."""
        builder = self.builder
        done = builder.append_basic_block("finished")
        raw = builder.append_basic_block("raw")
        switch = builder.switch(self.code, raw)
        builder.position_at_end(raw)
        store(None)
        builder.branch(done)
        for code, activation in self.activations.items():
            case = builder.append_basic_block(f"finish{code}")
            switch.add_case(ir.Constant(self.code.type, code), case)
            builder.position_at_end(case)
            store(activation)
            builder.branch(done)
        builder.position_at_end(done)


def _store_finished(context: Any, builder: Any, sig: Any, args: Any, sums: list[list[Any]],
                    y_vector: Callable[[int, int], Any], r0: Any) -> None:
    """Store the block's ``sums`` (rows x vectors) through `y_vector(r, v)`, finished as the
    `_Finisher` says with the block's rows of ``bias``: one branch per block, outside the sum's loop."""
    finisher = _Finisher(context, builder, sig, args, sums[0][0].type)

    def store(activation: Callable[[Any], Any] | None) -> None:
        for r, row in enumerate(sums):
            if activation is not None:
                b = finisher.spread(builder.load(builder.gep(finisher.bias.data,
                                                             [builder.add(r0, ir.Constant(r0.type, r))])))
            for v, value in enumerate(row):
                builder.store(value if activation is None else activation(builder.fadd(value, b)), y_vector(r, v),
                              align=4)
    finisher.cases(store)


def _store_column_biased(context: Any, builder: Any, sig: Any, args: Any, sums: list[list[Any]],
                         y_vector: Callable[[int, int], Any], p: Any,
                         write: Callable[[list[list[Any]]], None] | None = None) -> None:
    """`_store_finished` with a bias per column of the block: ``bias[p·W + j]`` (whole vectors of
    ``bias``, which is padded to whole panels). ``write(values)``, when given, stores the finished
    vectors (rows x vectors) itself instead of each through ``y_vector(r, v)``."""
    finisher = _Finisher(context, builder, sig, args, sums[0][0].type)
    size = context.get_abi_sizeof(finisher.vector.element)

    def store(activation: Callable[[Any], Any] | None) -> None:
        values = sums if activation is None else _column_biased(finisher, sums, p, activation)
        if write is not None:
            write(values)
            return
        for r, row in enumerate(values):
            for v, value in enumerate(row):
                builder.store(value, y_vector(r, v), align=size)
    finisher.cases(store)


def _column_biased(finisher: _Finisher, sums: list[list[Any]], p: Any,
                   activation: Callable[[Any], Any]) -> list[list[Any]]:
    """``activation(sums[r][v] + bias[p·W + v·lanes ...])``: each vector of the block's columns
    plus its whole vector of ``bias`` (padded to whole panels), then the activation."""
    builder, vector = finisher.builder, finisher.vector
    lanes, size = vector.count, {ir.FloatType: 4, ir.DoubleType: 8}[type(vector.element)]
    width = len(sums[0]) * lanes
    values: list[list[Any]] = [list(row) for row in sums]
    for v in range(len(sums[0])):
        offset = builder.add(builder.mul(p, ir.Constant(p.type, width)), ir.Constant(p.type, v * lanes))
        at = builder.gep(finisher.bias.data, [offset])
        b = builder.load(builder.bitcast(at, vector.as_pointer()), align=size)
        for row in values:
            row[v] = activation(builder.fadd(row[v], b))
    return values


def _add_relu(builder: Any, v: Any) -> Any:
    """A residual Add's Relu on a vector, as `compiled.one_pass` does it (NaN passes, -0 gives +0)."""
    zero = ir.Constant(v.type, [0.0] * v.type.count)
    return builder.select(builder.fcmp_unordered(">", v, zero), v, zero)


def _store_rows_residual(context: Any, builder: Any, sig: Any, args: Any, sums: list[list[Any]],
                         y_vector: Callable[[int, int], Any], res_vector: Callable[[int, int], Any], r0: Any) -> None:
    """`_store_finished` of a residual block (`_register_block` with ``residual``, rows y's): each
    vector plus its row's bias, plus the residual's vector at the same place, then a Relu where
    ``finish`` is `BIAS_RELU` (`_add_relu`), else none; each an IEEE add of its own."""
    finisher = _Finisher(context, builder, sig, args, sums[0][0].type)

    def store(relu: bool) -> None:
        for r, row in enumerate(sums):
            b = finisher.spread(builder.load(builder.gep(finisher.bias.data, [builder.add(r0, ir.Constant(r0.type, r))])))
            for v, value in enumerate(row):
                total = builder.fadd(builder.fadd(value, b), builder.load(res_vector(r, v), align=4))
                builder.store(_add_relu(builder, total) if relu else total, y_vector(r, v), align=4)

    relu_code = ir.Constant(finisher.code.type, BIAS_RELU)
    with builder.if_else(builder.icmp_unsigned("==", finisher.code, relu_code)) as (then, otherwise):
        with then:
            store(True)
        with otherwise:
            store(False)


def _store_residual(context: Any, builder: Any, sig: Any, args: Any, sums: list[list[Any]], p: Any,
                    write: Callable[..., None]) -> None:
    """A residual block's store (`_register_block` with ``residual``): the sums plus their
    column's bias, then through ``write`` (`transposed_writer` with the residual) plus the
    residual and, where ``finish`` is `BIAS_RELU`, a Relu as the Add's fused one does it
    (`compiled.one_pass`: NaN passes, -0 gives +0); any other finish: no activation. Each an
    IEEE add of its own, no FMA: the bits of the conv, then the Add layer."""
    finisher = _Finisher(context, builder, sig, args, sums[0][0].type)
    values = _column_biased(finisher, sums, p, lambda v: v)
    relu_code = ir.Constant(finisher.code.type, BIAS_RELU)
    with builder.if_else(builder.icmp_unsigned("==", finisher.code, relu_code)) as (then, otherwise):
        with then:
            write(values, lambda v: _add_relu(builder, v))
        with otherwise:
            write(values, None)


_block8, _block4, _block2, _block1 = (_register_block(rows) for rows in (8, 4, 2, 1))
#: The same blocks prefetching two panels ahead, for panels read in place from a map's rows
#: (`pointwise.pointwise_conv`: each panel is a run of 128 bytes in each of C input rows, C read
#: streams the hardware prefetchers do not follow; a panel ahead arrived too late once the input
#: was out of cache). One core, caches flushed: 64 -> 16 at 55x55 229-240 -> 122-129 µs, 128 ->
#: 32 at 27x27 167-172 -> 105-110, 16 -> 64 at 55x55 168-175 -> 143-146; hot the same. (Packed
#: panels, one sequential run each, keep one: two measured no better, at times worse.)
_strided8, _strided4, _strided2, _strided1 = (_register_block(rows, ahead=2) for rows in (8, 4, 2, 1))
#: The same adding a residual map as they store (a ResidualConv's last block of depth).
_strided8_residual, _strided4_residual, _strided2_residual, _strided1_residual = (
    _register_block(rows, ahead=2, residual=True) for rows in (8, 4, 2, 1))
#: The same blocks with a bias per column (`_register_block`).
#: They prefetch nothing: `pointwise.small_map_conv` runs every block of positions on one panel
#: before the next, so the next panel's rows, prefetched on each of them, were needed only after
#: the last (two of each step's twelve loads in vain: one core, 256 -> 64 at 56x56 469 -> 428 µs,
#: 1024 -> 256 at 14x14 469 -> 435, 512 -> 1000 at 13x13 857 -> 722); the last blocks of a panel
#: take their share of them (`_by_column8_to_output`, `ahead_share`).
_by_column8, _by_column4, _by_column2, _by_column1 = (_register_block(rows, column_bias=True, ahead=0)
                                                      for rows in (8, 4, 2, 1))
#: Bytes ahead of each step's values of a that the blocks storing to an output prefetch: a's rows
#: are a map's channels read in place (`pointwise.small_map_conv`), C rows a plane apart, more
#: streams than the hardware prefetchers follow, and in a model's run the map comes from memory.
#: One core / two, after a 64 MB sweep: 64 -> 64 at 56x56 542/346 -> 272/228 µs, 256 -> 64 at
#: 56x56 1151/740 -> 855/508; 128, 512 and 1024 bytes measured no better.
A_AHEAD = 256
#: `_by_column8`... of `WIDE_ROWS` (a last block written over its residual: `pointwise._residual_blocks`).
_by_column14 = _register_block(WIDE_ROWS, column_bias=True, ahead=0, a_ahead=A_AHEAD)
#: `_by_column8` storing its block transposed into a (channels, positions) output, a panel's last
#: blocks prefetching their share of the next panel's rows (``spread``: deep weights come from
#: memory).
_by_column8_to_output = _register_block(8, column_bias=True, to_output=True, ahead=0, a_ahead=A_AHEAD, spread=True)
#: The same with `WIDE_ROWS` positions (AVX-512).
_by_column14_to_output = _register_block(WIDE_ROWS, column_bias=True, to_output=True, ahead=0, a_ahead=A_AHEAD,
                                         spread=True)
#: Both sizes adding a residual map on the way out (``residual``: a ResidualConv's Add fused into
#: its stores).
_by_column8_residual, _by_column14_residual = (
    _register_block(rows, column_bias=True, to_output=True, ahead=0, a_ahead=A_AHEAD, residual=True, spread=True)
    for rows in (8, WIDE_ROWS))
#: A panel's last blocks (at most this many) that share the prefetching of the next panel's
#: weights between them (`ahead_share`).
AHEAD_BLOCKS = 4


@numba.njit(inline="always")
def ahead_share(has_next: bool, block: int, blocks: int, steps: int, row_bytes: int) -> tuple[int, int]:
    """``(ahead_at, ahead_step)`` for block ``block`` of a panel's ``blocks`` (``spread`` blocks,
    `direct_panels`' row blocks): an even share of the next panel's ``steps`` rows of
    ``row_bytes`` for each of the last `AHEAD_BLOCKS` (or 2, or 1) blocks, spread over its steps;
    none for the others or where there is no next panel. Each block prefetched all of the next
    panel two lines a step before: on a 7x7 map a panel is 4 blocks, its 590 KB of 3x3 weights
    take longer to come from memory than one block's sums, and prefetches waiting for memory hold
    the fill buffers the block's own loads need (ResNet-50's 3x3 512 -> 512 at 7x7 on one core,
    weights in memory: 1993 -> 1804 µs)."""
    share = AHEAD_BLOCKS if blocks >= AHEAD_BLOCKS else 2 if blocks >= 2 else 1
    k = block - (blocks - share)
    if not has_next or k < 0:
        return 0, 0
    step = row_bytes // share
    return k * steps * step, step


def loops_by_ahead_step(builder: Any, ahead_step: Any, loop: Callable[[int], None]) -> None:
    """A block's loop, ``loop(lines)``, emitted three times and chosen by ``ahead_step`` (an i64 IR
    value, `ahead_share`'s) as the block runs: prefetching no line of the next panel a step (a
    step of 0), one, or two (a step of more than a line). Only a panel's last blocks take the
    prefetching loops: prefetches on every step of every block were 2 of the 52 instructions a
    tap of `direct_panels`' row blocks (one core, 64 -> 192 at 56x56: 3700 -> 3520 µs without)."""
    line = ir.Constant(ir.IntType(64), 64)
    with builder.if_else(builder.icmp_signed("==", ahead_step, ir.Constant(ir.IntType(64), 0))) as (none, some):
        with none:
            loop(0)
        with some:
            with builder.if_else(builder.icmp_signed(">", ahead_step, line)) as (two, one):
                with two:
                    loop(2)
                with one:
                    loop(1)


#: Blocks with a bias per column reading a's rows in place (`_register_block`).
_rows8, _rows4, _rows2, _rows1 = (_register_block(rows, column_bias=True, rows_in_place=True) for rows in (8, 4, 2, 1))
#: `_rows8` and `_rows4` for packed panels (contiguous rows), a panel's last blocks prefetching
#: their share of the next panel (``spread``), where each block prefetched all of it.
_rows8_spread, _rows4_spread = (_register_block(rows, column_bias=True, rows_in_place=True, ahead=0, spread=True)
                                for rows in (8, 4))
#: ... and of `WIDE_ROWS` rows (AVX-512's 32 registers: 28 sums, 16 loads to 28 multiply-adds a
#: step where 8 rows take 10 to 16), for the panel GEMM's blocks (`gemm._band`).
_rows14_spread = _register_block(WIDE_ROWS, column_bias=True, rows_in_place=True, ahead=0, spread=True)


@kernel
def panel_product(a: np.ndarray, panels: np.ndarray, y: np.ndarray, k0: int, k1: int) -> None:
    """``y[:, :P*W] = a[:, k0:k1] @ b[k0:k1, :P*W]`` for b packed by `pack_panels` (P panels):
    every block of rows of a panel in turn, so the panel streams from memory once and the other
    blocks find it in L2. ``a`` and ``y`` have contiguous rows."""
    m = a.shape[0]
    width = panels.shape[2]
    columns = np.empty((k1 - k0, m), a.dtype)
    for kk in range(k1 - k0):
        for r in range(m):
            columns[kk, r] = a[r, k0 + kk]
    for p in range(panels.shape[0]):
        r = 0
        if BLOCK_ROWS == 8:
            while r + 8 <= m:
                _block8(columns, panels, p, k0, k1, y, r, p * width, RAW, y[0], 0.0, 0.0)
                r += 8
        while r + 4 <= m:
            _block4(columns, panels, p, k0, k1, y, r, p * width, RAW, y[0], 0.0, 0.0)
            r += 4
        if r + 2 <= m:
            _block2(columns, panels, p, k0, k1, y, r, p * width, RAW, y[0], 0.0, 0.0)
            r += 2
        if r < m:
            _block1(columns, panels, p, k0, k1, y, r, p * width, RAW, y[0], 0.0, 0.0)
