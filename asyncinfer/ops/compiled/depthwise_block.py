"""The vector code of the channels-last depthwise loop, written in LLVM IR.

`depthwise.depthwise_channels_last` works on a block of channels in ONNX Runtime's NCHWc
layout: groups of one register vector of channels, each group's zero-padded map contiguous
(Hp, Wp, L). Two pieces of it are written here with explicit vector types, because numba's loops
do them badly:

- `output_row`: runs of up to `BLOCK_OUTPUTS` output pixels by one vector of channels, their sums
  held in registers for the whole window (`_register_block`): per tap one load of the weights'
  vector and one load of input per output. Written as numba loops, each multiply-add loaded and
  stored its accumulator (576 channels on a 7x7 map, 5x5 kernel: 65 µs for 0.7 M multiply-adds).
- `transpose`: an L x L tile from channel planes to channels-last cells and back, in registers
  (log2 L stages of two-vector shuffles; masked loads and stores at the edges). As scalar
  loops, the two transposes took longer than the sums.

Each sum is the one a plain loop makes: the bias, then tap after tap (row by row) with one
multiply-add each, contracted into FMA as every kernel's code is.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import inline
from .panels import VECTOR_BYTES

#: Output pixels of a run held in registers (a vector of accumulators each): with the weights'
#: vector and the input's, 10 of AVX2's 16 registers.
BLOCK_OUTPUTS = 8
#: (kernel width, stride) of the windows whose row a block reads with one load per input (the
#: depthwise convs of MobileNet, EfficientNet, ConvNeXt and their kind); others take a load per
#: tap. (Up to 8 sums, 14 inputs and 7 weights in flight: AVX-512's 32 registers hold them.)
KNOWN_WINDOWS = ((3, 1), (5, 1), (3, 2), (5, 2), (7, 1))

_I32, _I64 = ir.IntType(32), ir.IntType(64)
_BYTE_POINTER = ir.IntType(8).as_pointer()


class _Vectors:
    """IR helpers for vectors of one element type (of the array argument ``array_type``)."""

    def __init__(self, context: Any, builder: Any, array_type: Any) -> None:
        self.builder = builder
        self.element = context.get_value_type(array_type.dtype)
        self.size = context.get_abi_sizeof(self.element)
        self.lanes = VECTOR_BYTES // self.size
        self.type = ir.VectorType(self.element, self.lanes)
        self.zero = ir.Constant(self.type, [0.0] * self.lanes)
        name = f"v{self.lanes}f{8 * self.size}.p0"
        mask_type = ir.VectorType(ir.IntType(1), self.lanes)
        module = builder.module
        self._masked_load = cgutils.get_or_insert_function(
            module, ir.FunctionType(self.type, [self.type.as_pointer(), _I32, mask_type, self.type]),
            f"llvm.masked.load.{name}")
        self._masked_store = cgutils.get_or_insert_function(
            module, ir.FunctionType(ir.VoidType(), [self.type, self.type.as_pointer(), _I32, mask_type]),
            f"llvm.masked.store.{name}")

    def at(self, base: Any, offset: Any) -> Any:
        """``base`` advanced by ``offset`` bytes."""
        return self.builder.gep(self.builder.bitcast(base, _BYTE_POINTER), [offset])

    def element_at(self, base: Any, index: Any) -> Any:
        """``base`` advanced by ``index`` elements."""
        return self.at(base, self.builder.mul(index, ir.Constant(_I64, self.size)))

    def load(self, address: Any) -> Any:
        return self.builder.load(self.builder.bitcast(address, self.type.as_pointer()), align=self.size)

    def store(self, value: Any, address: Any) -> None:
        self.builder.store(value, self.builder.bitcast(address, self.type.as_pointer()), align=self.size)

    def splat(self, value: Any, vector_type: Any = None) -> Any:
        """A vector (of this element type, or ``vector_type``) of ``value`` in every lane."""
        vector_type = self.type if vector_type is None else vector_type
        first = self.builder.insert_element(ir.Constant(vector_type, ir.Undefined), value, ir.Constant(_I32, 0))
        return self.builder.shuffle_vector(first, ir.Constant(vector_type, ir.Undefined),
                                           ir.Constant(ir.VectorType(_I32, self.lanes), [0] * self.lanes))

    def first(self, count: Any) -> Any:
        """The mask of lanes ``< count`` (an int64 taken unsigned: every lane when negative)."""
        lanes = ir.VectorType(_I64, self.lanes)
        return self.builder.icmp_unsigned("<", ir.Constant(lanes, list(range(self.lanes))), self.splat(count, lanes))

    def below(self, limit: Any) -> Any:
        """The mask of lanes ``< limit`` (an int64 taken signed: no lane when negative)."""
        lanes = ir.VectorType(_I32, self.lanes)
        return self.builder.icmp_signed("<", ir.Constant(lanes, list(range(self.lanes))),
                                        self.splat(self.builder.trunc(limit, _I32), lanes))

    def inside(self, first: Any, width: Any) -> Any:
        """The lanes of a vector of columns ``first`` + lane that lie in ``[0, width)``."""
        builder = self.builder
        return builder.and_(builder.not_(self.below(builder.neg(first))), self.below(builder.sub(width, first)))

    def masked_load(self, address: Any, mask: Any) -> Any:
        """The lanes of ``mask`` from ``address``, zero in the others (which are not read)."""
        pointer = self.builder.bitcast(address, self.type.as_pointer())
        return self.builder.call(self._masked_load, [pointer, ir.Constant(_I32, self.size), mask, self.zero])

    def masked_store(self, value: Any, address: Any, mask: Any) -> None:
        pointer = self.builder.bitcast(address, self.type.as_pointer())
        self.builder.call(self._masked_store, [value, pointer, ir.Constant(_I32, self.size), mask])


def _register_block(outputs: int) -> Any:
    """An intrinsic ``block(padded, taps, start, acc, row, ow0, vector, sw, dh, dw)``: for ``r <
    outputs`` and the ``L`` lanes ``v``,

        acc[ow0 + r, v] = start[v]
                          + Σ_i Σ_j taps[i, j, vector·L + v] · padded[row + i·dh, (ow0 + r)·sw + j·dw, v]

    where ``padded`` is one group's (Hp, Wp, L) map, zero outside the image, ``taps`` (kh, kw,
    channels), ``start`` (L,) and ``acc`` (Wo, L), all with unit stride along channels."""

    @intrinsic
    def block(typingctx: Any, padded: Any, taps: Any, start: Any, acc: Any, row: Any, ow0: Any, vector: Any,
              sw: Any, dh: Any, dw: Any) -> Any:
        signature = types.void(padded, taps, start, acc, row, ow0, vector, sw, dh, dw)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            padded_, taps_, start_, acc_ = (context.make_array(t)(context, builder, v)
                                            for t, v in zip(sig.args[:4], args[:4]))
            row_, ow0_, vector_, sw_, dh_, dw_ = (context.cast(builder, v, t, types.int64)
                                                  for v, t in zip(args[4:], sig.args[4:]))
            vec = _Vectors(context, builder, sig.args[0])
            kh, kw = (builder.extract_value(taps_.shape, d) for d in (0, 1))
            taps_row, taps_column = (builder.extract_value(taps_.strides, d) for d in (0, 1))
            padded_row, padded_column = (builder.extract_value(padded_.strides, d) for d in (0, 1))
            acc_row = builder.extract_value(acc_.strides, 0)
            first = vec.load(start_.data)
            sums = [cgutils.alloca_once_value(builder, first) for _ in range(outputs)]
            output_step = builder.mul(sw_, padded_column)  # bytes from one output's input to the next's
            window = vec.at(padded_.data, builder.add(builder.mul(row_, padded_row), builder.mul(ow0_, output_step)))

            def add_tap(weights: Any, value: Any, r: int) -> None:
                product = builder.fmul(weights, value, flags=("contract",))
                builder.store(builder.fadd(builder.load(sums[r]), product, flags=("contract",)), sums[r])

            def window_rows(body: Any) -> None:  # body(the window row's first input, its taps) for each row i
                with cgutils.for_range(builder, kh) as i:
                    taps_i = vec.at(taps_.data, builder.add(builder.mul(i.index, taps_row),
                                                             builder.mul(vector_, ir.Constant(_I64, VECTOR_BYTES))))
                    body(vec.at(window, builder.mul(builder.mul(i.index, dh_), padded_row)), taps_i)

            def any_window(window_row: Any, taps_i: Any) -> None:
                with cgutils.for_range(builder, kw) as j:
                    weights = vec.load(vec.at(taps_i, builder.mul(j.index, taps_column)))
                    tap = vec.at(window_row, builder.mul(builder.mul(j.index, dw_), padded_column))
                    for r in range(outputs):
                        add_tap(weights, vec.load(vec.at(tap, builder.mul(ir.Constant(_I64, r), output_step))), r)

            def known_window(width: int, stride: int) -> Any:
                # a kernel row of `width` taps at unit dilation: the outputs' windows overlap, so
                # each input is loaded once for every tap that reads it (10 loads for 24 taps of
                # 8 outputs at 3 wide, stride 1), each sum still taking its taps in order
                def body(window_row: Any, taps_i: Any) -> None:
                    weights = [vec.load(vec.at(taps_i, builder.mul(ir.Constant(_I64, j), taps_column)))
                               for j in range(width)]
                    inputs = {q: vec.load(vec.at(window_row, builder.mul(ir.Constant(_I64, q), padded_column)))
                              for q in sorted({r * stride + j for r in range(outputs) for j in range(width)})}
                    for j in range(width):
                        for r in range(outputs):
                            add_tap(weights[j], inputs[r * stride + j], r)
                return body

            done = builder.append_basic_block("summed")
            generic = builder.append_basic_block("any_window")
            unit = builder.icmp_signed("==", dw_, ir.Constant(_I64, 1))
            shape = builder.select(unit, builder.add(builder.mul(kw, ir.Constant(_I64, 4)), sw_),
                                   ir.Constant(_I64, -1))  # 4·kw + sw where the dilation is 1
            switch = builder.switch(shape, generic)
            builder.position_at_end(generic)
            window_rows(any_window)
            builder.branch(done)
            for width, stride in KNOWN_WINDOWS:
                case = builder.append_basic_block(f"window{width}s{stride}")
                switch.add_case(ir.Constant(_I64, 4 * width + stride), case)
                builder.position_at_end(case)
                window_rows(known_window(width, stride))
                builder.branch(done)
            builder.position_at_end(done)
            out = vec.at(acc_.data, builder.mul(ow0_, acc_row))
            for r in range(outputs):
                vec.store(builder.load(sums[r]), vec.at(out, builder.mul(ir.Constant(_I64, r), acc_row)))
            return context.get_dummy_value()

        return signature, codegen

    return block


_block8, _block7, _block6, _block5, _block4, _block3, _block2, _block1 = (
    _register_block(outputs) for outputs in range(BLOCK_OUTPUTS, 0, -1))


@inline
def output_row(padded: np.ndarray, taps: np.ndarray, start: np.ndarray, acc: np.ndarray, row: int, vector: int,
               sw: int, dh: int, dw: int) -> None:
    """``acc[ow, :]`` for every output ``ow < acc.shape[0]`` of one group of channels (taps'
    vector ``vector``), from the window rows at ``row`` (`_register_block`): runs of 8 outputs,
    then one of the rest."""
    wo = acc.shape[0]
    ow = 0
    while ow + BLOCK_OUTPUTS <= wo:
        _block8(padded, taps, start, acc, row, ow, vector, sw, dh, dw)
        ow += BLOCK_OUTPUTS
    rest = wo - ow
    if rest == 7:
        _block7(padded, taps, start, acc, row, ow, vector, sw, dh, dw)
    elif rest == 6:
        _block6(padded, taps, start, acc, row, ow, vector, sw, dh, dw)
    elif rest == 5:
        _block5(padded, taps, start, acc, row, ow, vector, sw, dh, dw)
    elif rest == 4:
        _block4(padded, taps, start, acc, row, ow, vector, sw, dh, dw)
    elif rest == 3:
        _block3(padded, taps, start, acc, row, ow, vector, sw, dh, dw)
    elif rest == 2:
        _block2(padded, taps, start, acc, row, ow, vector, sw, dh, dw)
    elif rest == 1:
        _block1(padded, taps, start, acc, row, ow, vector, sw, dh, dw)


@intrinsic
def transpose(typingctx: Any, src: Any, src_offset: Any, src_step: Any, rows: Any, count: Any, dst: Any,
              dst_offset: Any, dst_step: Any, store_lanes: Any) -> Any:
    """``transpose(src, src_offset, src_step, rows, count, dst, dst_offset, dst_step, store_lanes)``
    on the flat elements of two C-contiguous arrays of one dtype, L lanes a vector: reads ``rows``
    (≤ L) runs of ``count`` (≤ L) elements, ``src_step`` apart from ``src_offset`` (the rest of
    an L x L tile is zero); writes the tile's first ``count`` columns as runs of ``store_lanes`` (≤ L)
    elements, ``dst_step`` apart from ``dst_offset``: ``dst[dst_offset + j·dst_step + i] =
    src[src_offset + i·src_step + j]`` (zero for ``i ≥ rows``). Offsets and steps in elements."""
    signature = types.void(src, src_offset, src_step, rows, count, dst, dst_offset, dst_step, store_lanes)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        src_, dst_ = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 5))
        src_offset_, src_step_, rows_, count_ = (context.cast(builder, args[i], sig.args[i], types.int64)
                                                 for i in range(1, 5))
        dst_offset_, dst_step_, store_lanes_ = (context.cast(builder, args[i], sig.args[i], types.int64)
                                                for i in range(6, 9))
        vec = _Vectors(context, builder, sig.args[0])
        lanes = vec.lanes
        load_mask = vec.first(count_)
        tile = []
        for i in range(lanes):  # row i, or zero past the rows there are
            row = cgutils.alloca_once_value(builder, vec.zero)
            with builder.if_then(builder.icmp_signed("<", ir.Constant(_I64, i), rows_)):
                address = vec.element_at(src_.data, builder.add(src_offset_,
                                                                builder.mul(ir.Constant(_I64, i), src_step_)))
                builder.store(vec.masked_load(address, load_mask), row)
            tile.append(builder.load(row))
        span = lanes // 2
        while span:  # swap the off-diagonal span x span blocks of every 2·span x 2·span block
            low = [lane if lane & span == 0 else lanes + lane - span for lane in range(lanes)]
            high = [lane + span if lane & span == 0 else lanes + lane for lane in range(lanes)]
            for i in range(lanes):
                if i & span == 0:
                    a, b = tile[i], tile[i + span]
                    tile[i] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, lanes), low))
                    tile[i + span] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, lanes), high))
            span //= 2
        store_mask = vec.first(store_lanes_)
        for j in range(lanes):
            with builder.if_then(builder.icmp_signed("<", ir.Constant(_I64, j), count_)):
                address = vec.element_at(dst_.data, builder.add(dst_offset_,
                                                                builder.mul(ir.Constant(_I64, j), dst_step_)))
                vec.masked_store(tile[j], address, store_mask)
        return context.get_dummy_value()

    return signature, codegen



def _rows_block(k: int) -> Any:
    """An intrinsic ``strip(x, x0, first, h, width, col0, count, nrows, w, w0, bias, out, out0,
    out_row, stride, narrow)`` summing ``count`` consecutive outputs of each of ``nrows``
    consecutive output rows of one channel (a strip of columns), NCHW, by a ``k`` x ``k`` window
    at ``stride`` (1 or 2, both ways) and unit dilation, a block of output rows at a time in
    registers (`WIDE_BLOCK`, or on maps at most a vector wide ``narrow``, `NARROW_BLOCK`: rows x
    vectors, ``count`` at most that many vectors of L): for ``r < nrows`` and ``c < count``,
    with s the stride,

        out[out0 + r·out_row + c] = bias + Σ_i Σ_j w[w0 + i·k + j]
                                               · x[x0 + (first + s·r + i)·width + col0 + s·c + j]

    where an input row outside ``[0, h)`` or column outside ``[0, width)`` counts as zero: it is not
    read (rows skipped, columns masked), so no padded copy is needed. ``x``, ``w`` and ``out`` are
    flat (offsets, not views: a view per channel costs numba reference counts), ``x0`` the start of
    the channel's input plane (H, W), ``first`` the input row of output row 0's window top, ``w0``
    the start of the channel's taps. The window is unrolled: each input vector is loaded once for
    every output row of a block that reads it (at stride 2, two vectors of input and the even lanes
    of the pair), and each sum takes its taps row by row, one multiply-add each (rows x vectors
    independent sums keep the FMA units busy where one row of a small map would wait on each sum's
    latency); the masks and the weights' vectors are made once a strip."""

    @intrinsic
    def strip(typingctx: Any, x: Any, x0: Any, first: Any, h: Any, width: Any, col0: Any, count: Any, nrows: Any,
              w: Any, w0: Any, bias: Any, out: Any, out0: Any, out_row: Any, stride: Any, narrow: Any) -> Any:
        signature = types.void(x, x0, first, h, width, col0, count, nrows, w, w0, bias, out, out0, out_row, stride,
                               narrow)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            arrays = [context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 8, 11)]
            numbers = [context.cast(builder, args[i], sig.args[i], types.int64)
                       for i in (1, 2, 3, 4, 5, 6, 7, 9, 12, 13)]
            bias_ = context.cast(builder, args[10], sig.args[10], sig.args[0].dtype)
            stride_, narrow_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (14, 15))
            vec = _Vectors(context, builder, sig.args[0])
            done = builder.append_basic_block("strip_done")
            # one body per block shape and stride: 2·narrow + stride - 1 picks it
            switch = builder.switch(builder.add(builder.mul(narrow_, ir.Constant(_I64, 2)),
                                                builder.sub(stride_, ir.Constant(_I64, 1))), done)
            for narrow_case, (rows, vectors) in ((0, WIDE_BLOCK), (1, NARROW_BLOCK)):
                for stride_case in ROW_STRIDES:
                    case = builder.append_basic_block(f"strip{rows}x{vectors}s{stride_case}")
                    switch.add_case(ir.Constant(_I64, 2 * narrow_case + stride_case - 1), case)
                    builder.position_at_end(case)
                    _strip_body(builder, vec, *arrays, *numbers, bias_, rows, vectors, k, stride_case)
                    builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return signature, codegen

    return strip


def _strip_body(builder: Any, vec: _Vectors, x_: Any, w_: Any, out_: Any, x0_: Any, first_: Any, h_: Any,
                width_: Any, col0_: Any, count_: Any, nrows_: Any, w0_: Any, out0_: Any, out_row_: Any, bias_: Any,
                rows: int, vectors: int, k: int, stride: int) -> None:
    """(`_rows_block`) The IR of a strip in blocks of ``rows`` x ``vectors`` at ``stride``."""
    lanes = vec.lanes

    def const(value: int) -> Any:
        return ir.Constant(_I64, value)

    # the lanes of each input vector a tap column j loads: vector v of the outputs reads `stride`
    # vectors of input columns from col0 + stride·v·L + j; a 3-wide window at stride 2 loads each
    # input row once, from col0 on, two vectors past the outputs' (`_stride2_halves`)
    once = stride == 2 and k in ONCE_A_ROW
    if once:
        reads = [[vec.inside(builder.add(col0_, const(u * lanes)), width_) for u in range(2 * vectors + 2)]]
    else:
        reads = [[vec.inside(builder.add(col0_, const(stride * v * lanes + u * lanes + j)), width_)
                  for v in range(vectors) for u in range(stride)] for j in range(k)]
    evens = _picks(lanes, list(range(0, 2 * lanes, 2)))
    writes = [vec.below(builder.sub(count_, const(v * lanes))) for v in range(vectors)]
    weights = [vec.splat(builder.load(builder.gep(w_.data, [builder.add(w0_, const(t))])))
               for t in range(k * k)]
    start = vec.splat(bias_)
    sums = [[cgutils.alloca_once_value(builder, start) for _ in range(vectors)] for _ in range(rows)]

    def input_at(index: Any, mask: Any) -> Any:  # the lanes of mask from x[index:]
        return vec.masked_load(vec.element_at(x_.data, index), mask)

    blocks = builder.sdiv(builder.add(nrows_, const(rows - 1)), const(rows))
    with cgutils.for_range(builder, blocks) as b:  # a block of `rows` output rows
        top = builder.mul(b.index, const(rows))
        for row_sums in sums:
            for acc in row_sums:
                builder.store(start, acc)
        for q in range(stride * (rows - 1) + k):  # the block's input rows: row r reads s·r .. s·r + k - 1
            ih = builder.add(builder.add(first_, builder.mul(top, const(stride))), const(q))
            inside = builder.and_(builder.icmp_signed(">=", ih, const(0)), builder.icmp_signed("<", ih, h_))
            with builder.if_then(inside):
                row_at = builder.add(x0_, builder.add(builder.mul(ih, width_), col0_))  # column 0 there
                if once:
                    halves = _stride2_halves(builder, lanes, vectors,
                                             [input_at(builder.add(row_at, const(u * lanes)), mask)
                                              for u, mask in enumerate(reads[0])])
                for j in range(k):
                    if once:
                        values = _stride2_tap(builder, lanes, vectors, halves, j)
                    else:
                        loaded = [input_at(builder.add(row_at, const(u * lanes + j)), reads[j][u])
                                  for u in range(stride * vectors)]
                        values = loaded if stride == 1 else [
                            builder.shuffle_vector(loaded[2 * v], loaded[2 * v + 1], evens) for v in range(vectors)]
                    for r in range(max(0, -(-(q - k + 1) // stride)), min(rows, q // stride + 1)):
                        weight = weights[(q - stride * r) * k + j]
                        for v in range(vectors):
                            product = builder.fmul(weight, values[v], flags=("contract",))
                            builder.store(builder.fadd(builder.load(sums[r][v]), product, flags=("contract",)),
                                          sums[r][v])
        for r in range(rows):
            with builder.if_then(builder.icmp_signed("<", builder.add(top, const(r)), nrows_)):
                row_out = builder.add(out0_, builder.mul(builder.add(top, const(r)), out_row_))
                for v in range(vectors):
                    vec.masked_store(builder.load(sums[r][v]),
                                     vec.element_at(out_.data, builder.add(row_out, const(v * lanes))), writes[v])


def _picks(lanes: int, values: list[int]) -> Any:
    """A shuffle's lane picks."""
    return ir.Constant(ir.VectorType(_I32, lanes), values)


def _stride2_halves(builder: Any, lanes: int, vectors: int, loaded: list) -> list[list]:
    """(`_strip_body` at stride 2) The even and the odd lanes of each pair of ``loaded``: the
    row's ``2·vectors + 2`` vectors from the strip's first column, zero outside the image. Each
    row is loaded once for all its taps (`_stride2_tap`), where loading each tap's vectors at its
    own offset and keeping their even lanes took two loads a tap an output vector."""
    return [[builder.shuffle_vector(loaded[2 * v], loaded[2 * v + 1], _picks(lanes, list(range(parity, 2 * lanes, 2))))
             for v in range(vectors + 1)] for parity in (0, 1)]


def _stride2_tap(builder: Any, lanes: int, vectors: int, halves: list[list], j: int) -> list:
    """The ``vectors`` vectors of inputs that tap column ``j`` reads at stride 2 (columns ``2·c +
    j``, c the output's column in the strip) from `_stride2_halves`: ``j`` of 2t and 2t + 1 are
    the even and odd lanes shifted t lanes along, the next pair's first lanes after them. The
    lanes and their zeros are those the tap's own loads gave: the same multiply-adds, the same
    bits."""
    half, shift = halves[j % 2], j // 2
    if shift == 0:
        return half[:vectors]
    return [builder.shuffle_vector(half[v], half[v + 1], _picks(lanes, list(range(shift, shift + lanes))))
            for v in range(vectors)]


#: Windows whose rows a strip at stride 2 loads once for all their taps (`_stride2_halves`):
#: 3 wide. One core, 2-vCPU Zen 4 VM: 16 channels 112x112 -> 56x56 46 -> 36 µs, 72 at 56x56 ->
#: 28x28 50 -> 42; a 5-wide window's shifts outnumbered the loads they saved (96 at 28x28 ->
#: 14x14 37 -> 43-45), so wider windows load each tap's vectors.
ONCE_A_ROW = (3,)

#: (rows, vectors) of the register blocks of `rows_block`: 4 rows x 2 vectors of columns, or
#: on maps at most a vector wide, 8 rows x 1.
WIDE_BLOCK, NARROW_BLOCK = (4, 2), (8, 1)
#: The square windows `rows_block` unrolls (MobileNet's, EfficientNet's, ConvNeXt's), and its strides.
ROW_WINDOWS = (3, 5, 7)
ROW_STRIDES = (1, 2)
_strip3, _strip5, _strip7 = (_rows_block(k) for k in ROW_WINDOWS)


@inline
def rows_block(x: np.ndarray, x0: int, first: int, h: int, width: int, col0: int, count: int, nrows: int,
               w: np.ndarray, w0: int, k: int, stride: int, bias: float, out: np.ndarray, out0: int, out_row: int,
               narrow: bool) -> None:
    """`_rows_block`'s strip for a ``k`` x ``k`` window (one of `ROW_WINDOWS`) at ``stride`` (one
    of `ROW_STRIDES`): ``narrow`` on maps at most a vector wide (`NARROW_BLOCK`: 8 rows of one
    vector at a time), else `WIDE_BLOCK` (4 rows of two vectors)."""
    if k == 3:
        _strip3(x, x0, first, h, width, col0, count, nrows, w, w0, bias, out, out0, out_row, stride, narrow)
    elif k == 5:
        _strip5(x, x0, first, h, width, col0, count, nrows, w, w0, bias, out, out0, out_row, stride, narrow)
    else:
        _strip7(x, x0, first, h, width, col0, count, nrows, w, w0, bias, out, out0, out_row, stride, narrow)
