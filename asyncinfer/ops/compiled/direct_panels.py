"""Convs summed straight from the input, output channels in vectors: deep convs on small maps.

A 3x3 conv of 128 channels on a 14x14 or 7x7 map (DenseNet's 58 layers of 128 -> 32, Inception's
towers, SqueezeNet's expand layers at 13x13) has too few positions for the other kernels:
Winograd's GEMMs get a few dozen columns each, an im2col GEMM's N is 49 to 196, and
`compiled.direct`'s blocks are vectors of positions along one output row (a 13-wide row fills
13 lanes of 16). ONNX Runtime ran those layers 2-3.5x faster.

Here a register block holds up to 8 output positions of the map (4 without AVX-512:
`BLOCK_POSITIONS`) x `panels.panel_width` output channels (two vectors), summed over every tap
of the window (``C·kh·kw`` of them): per tap, one broadcast of each position's input value, read
in place from a zero-padded copy of the input, and the tap's weights for the panel's channels,
one contiguous row of the packed weights (`pack_joined_taps`). The map's positions (its rows end to
end) are cut into blocks of 8, then 4, 2 and 1 at the end, so no position is computed in vain on
any width; each finished block (bias and activation in registers,
`panels._store_column_biased`) is stored transposed into the NCHW output, a cost only a deep sum
can pay (``C·kh·kw`` ≥ 64). With AVX-512, rows of 14 positions or more at strides 1 and 2 are cut
into row blocks instead, 14 consecutive positions of one row read through one pointer
(`row_blocks_of`): 28 sums in registers where 8 positions' own starts left room for 16, 10-15%
faster on ResNet-18's 3x3 convs of 56x56 to 14x14 maps, one core.

Each panel sums the taps of its own set (an offset table per set, a set and a count per panel):
one set for a conv, one per conv for convs of one input computed side by side into one result
(SqueezeNet's 1x1 and 3x3 expand layers, `ops/joined_conv.py`), whose 1x1's panels then sum C
taps where its 3x3's sum 9·C.

Each value is summed from zero along the taps in ``(c, ky, kx)`` order, one multiply-add after
another (FMA where the CPU has it), as `compiled.direct` sums them: the same bits as that kernel,
and for any split of the work between threads.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from llvmlite import ir
from numba.extending import intrinsic

from ...concurrency.spin_team import (ARGS, HELPERS_ASLEEP, KIND, PARTS_DONE, PARTS_RUNNING, address_as_pointer,
                                      post_and_count_asleep, wait_all)
from . import inline, kernel
from .panels import (A_AHEAD, BLOCK_ROWS, PANEL_VECTORS, VECTOR_BYTES, WIDE_BLOCKS, WIDE_ROWS, BlockIR,
                     _store_column_biased, ahead_share, initial_sums, loops_by_ahead_step, pack_panels, panel_width,
                     transposed_writer)
from .pointwise import finishing

#: The kind of spin-team part that is a `direct_panel_conv` range.
PART_KIND = 13
#: Output channels of one panel (float32).
WIDTH = panel_width(np.float32)
#: Positions of the widest block: 8 x two vectors of sums with AVX-512's 32 vector registers, 4
#: with the 16 of AVX2 (or NEON's 32 of half the width), as `panels.BLOCK_ROWS`.
BLOCK_POSITIONS = BLOCK_ROWS
#: Positions of a row block (`_tap_block`'s ``spacing``, `panels.WIDE_ROWS`), with AVX-512 only
#: (`ROW_BLOCKS`). On ResNet's 3x3 64 -> 64 at 56x56, one core, the sums alone: 186-199 GFLOP/s
#: against 160-178 for the 8-position blocks (`bench/register_blocks.py`).
ROW_POSITIONS = WIDE_ROWS
ROW_BLOCKS = WIDE_BLOCKS


def pack_joined_taps(weights: Sequence[np.ndarray]) -> np.ndarray:
    """The weights of convs of one input side by side, each (M_i, C, kh_i, kw_i), every M_i but
    the last a multiple of `WIDTH` (one conv: ``[w]``), as the panels of one conv of their M_i
    together, (P, T, `WIDTH`) float32, T the most taps of any, zero past the last channel:
    ``panels[p, t, j]`` = tap ``t`` = (c, ky, kx)'s weight of channel ``p·WIDTH + j`` of its conv,
    in the first C·kh_i·kw_i rows of conv i's panels, zeros after (never read:
    `direct_panel_conv` sums a panel's own taps)."""
    widths = [w.shape[0] for w in weights]
    assert all(m % WIDTH == 0 for m in widths[:-1]), "each conv but the last fills whole panels"
    columns = np.zeros((max(int(np.prod(w.shape[1:])) for w in weights), -(-sum(widths) // WIDTH) * WIDTH),
                       np.float32)
    start = 0
    for w, m in zip(weights, widths):
        rows = w.reshape(m, -1).T
        columns[:rows.shape[0], start:start + m] = rows
        start += m
    return pack_panels(columns)


def _tap_block(rows: int, to_output: bool = False, spacing: int = 0, line: int = 0) -> Any:
    """An intrinsic ``block(image, offsets, base, starts, taps, panels, p, y, finish, bias, lo, hi)``:
    ``y[r, j] = Σ_t image.flat[base + starts[r] + offsets[t]] · panels[p, t, j]`` for ``r < rows`` and the
    panel's ``j``, summed over ``t < taps`` in registers, then finished as ``finish`` says with a
    bias per channel, ``bias[p·W + j]`` (`panels._store_column_biased`). ``image`` is read through
    its data pointer (a zero-padded image); each position has its own start, so a block may run
    across output rows.

    ``to_output``: ``y`` is an image's output (M, Ho·Wo) and a last argument ``first`` the block's
    first position: ``y[p·W + j, first + r]`` = those sums, the block transposed in registers and
    stored as vectors of 8 positions per channel (`panels.transposed_writer`).

    ``spacing`` (with ``to_output``): the positions are consecutive on one output row, ``spacing``
    elements apart in the image (the conv's stride), and ``starts`` is one integer, the first's:
    ``image.flat[base + starts + r·spacing + offsets[t]]``. One pointer then reaches every
    position's value (constant displacements), where a start each took a register per position:
    AVX-512's 32 registers hold 14 positions x 2 vectors of sums (`ROW_POSITIONS`).

    ``line`` (with ``spacing``): the block covers ``rows / line`` whole output rows of ``line``
    positions each (a 7x7 map's rows two at a time), ``starts`` an array again, ``starts[k]`` the
    first position's of row ``k``: position ``r`` reads ``image.flat[base + starts[r // line] +
    (r % line)·spacing + offsets[t]]``, a pointer a row.

    Row blocks take two last arguments ``ahead_at`` and ``ahead_step`` (bytes): tap ``t``
    prefetches the next panel's line at ``ahead_at + t·ahead_step`` into L2 (and the line after
    it where the step is more than one), none with a step of 0. A panel's last few blocks each
    take their share of the next panel (`ahead_share`), at a rate the memory keeps up with, so its
    weights come from memory while this panel's are summed and its first block finds them in L2:
    a deep layer's weights are in memory between a model's runs."""
    assert not spacing or to_output
    assert not line or (spacing and rows % line == 0)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        image_arr, offsets_arr, panel_arr, y_arr = (context.make_array(sig.args[i])(context, builder, args[i])
                                                    for i in (0, 1, 5, 7))
        base_, taps_, p_ = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (2, 4, 6))
        code = BlockIR(context, builder, sig.args[0].dtype)
        size, vector, at, const = code.size, code.vector, code.at, code.const
        element, lanes = vector.element, vector.count
        i32 = ir.IntType(32)
        undefined = ir.Constant(vector, ir.Undefined)
        broadcast = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)

        panel_stride, row_stride = (builder.extract_value(panel_arr.strides, i) for i in (0, 1))
        y_stride = builder.extract_value(y_arr.strides, 0)
        panel = at(panel_arr.data, builder.mul(p_, panel_stride))
        if spacing and not line:
            start = context.cast(builder, args[3], sig.args[3], types.int64)
            origins = [at(image_arr.data, builder.mul(builder.add(base_, start), const(size)))]
        else:
            starts_arr = context.make_array(sig.args[3])(context, builder, args[3])
            origins = [at(image_arr.data, builder.mul(builder.add(base_, builder.load(builder.gep(starts_arr.data,
                                                                                                  [const(r)]))),
                                                      const(size))) for r in range(rows // line if line else rows)]
        per_origin = line or rows  # (positions reached from one pointer, with ``spacing``)

        def y_vector(r: int, v: int) -> Any:
            return builder.bitcast(at(y_arr.data, builder.add(builder.mul(const(r), y_stride),
                                                              const(v * VECTOR_BYTES))), vector.as_pointer())
        sums = initial_sums(context, builder, sig, args, None if to_output else y_vector, rows, PANEL_VECTORS, vector)
        if spacing:
            prefetch = builder.module.declare_intrinsic(
                "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [code.byte_ptr, i32, i32, i32]))
            ahead_at, ahead_step = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (13, 14))
            ahead = at(at(panel, panel_stride), ahead_at)

        def tap_loop(lines_ahead: int) -> None:
            """Every tap into the sums, each prefetching ``lines_ahead`` lines of the next panel."""
            with cgutils.for_range(builder, taps_) as loop:
                index = loop.index
                offset = builder.mul(builder.load(builder.gep(offsets_arr.data, [index])), const(size))
                row = at(panel, builder.mul(index, row_stride))
                if lines_ahead:
                    later = at(ahead, builder.mul(index, ahead_step))
                    for line_bytes in range(0, lines_ahead * 64, 64):
                        builder.call(prefetch, [at(later, const(line_bytes)), ir.Constant(i32, 0),
                                                ir.Constant(i32, 2), ir.Constant(i32, 1)])
                columns = [builder.load(builder.bitcast(at(row, const(v * VECTOR_BYTES)), vector.as_pointer()),
                                        align=size) for v in range(PANEL_VECTORS)]
                if spacing:
                    lines = [at(origin, offset) for origin in origins]
                    taps = [at(lines[r // per_origin], const(r % per_origin * spacing * size)) for r in range(rows)]
                    if not line:  # (the row's values further on: the map's rows are many streams, too many to follow)
                        builder.call(prefetch, [at(lines[0], const(A_AHEAD)), ir.Constant(i32, 0),
                                                ir.Constant(i32, 3), ir.Constant(i32, 1)])
                else:
                    taps = [at(origin, offset) for origin in origins]
                for r, tap in enumerate(taps):
                    value = builder.load(builder.bitcast(tap, element.as_pointer()), align=size)
                    spread = builder.shuffle_vector(builder.insert_element(undefined, value, ir.Constant(i32, 0)),
                                                    undefined, broadcast)
                    for v, column in enumerate(columns):
                        # contract, like the kernels' own code: the same FMA (or not) as `compiled.direct`
                        product = builder.fmul(spread, column, flags=("contract",))
                        builder.store(builder.fadd(builder.load(sums[r][v]), product, flags=("contract",)),
                                      sums[r][v])

        if spacing:
            loops_by_ahead_step(builder, ahead_step, tap_loop)
        else:
            tap_loop(0)
        write = (transposed_writer(context, builder, y_arr, context.cast(builder, args[12], sig.args[12], types.int64),
                                   builder.mul(p_, const(PANEL_VECTORS * lanes)), vector) if to_output else None)
        _store_column_biased(context, builder, sig, args, [[builder.load(v) for v in row] for row in sums],
                             y_vector, p_, write)
        return context.get_dummy_value()

    if spacing:
        @intrinsic
        def row_block(typingctx: Any, image: Any, offsets: Any, base: Any, starts: Any, taps: Any, panels: Any,
                      p: Any, y: Any, finish: Any, bias: Any, lo: Any, hi: Any, first: Any, ahead_at: Any,
                      ahead_step: Any) -> Any:
            return (types.void(image, offsets, base, starts, taps, panels, p, y, finish, bias, lo, hi, first,
                               ahead_at, ahead_step), codegen)

        return row_block

    if to_output:
        @intrinsic
        def block_to_output(typingctx: Any, image: Any, offsets: Any, base: Any, starts: Any, taps: Any, panels: Any,
                            p: Any, y: Any, finish: Any, bias: Any, lo: Any, hi: Any, first: Any) -> Any:
            return types.void(image, offsets, base, starts, taps, panels, p, y, finish, bias, lo, hi, first), codegen

        return block_to_output

    @intrinsic
    def block(typingctx: Any, image: Any, offsets: Any, base: Any, starts: Any, taps: Any, panels: Any, p: Any,
              y: Any, finish: Any, bias: Any, lo: Any, hi: Any) -> Any:
        return types.void(image, offsets, base, starts, taps, panels, p, y, finish, bias, lo, hi), codegen

    return block


_block8, _block4, _block2, _block1 = (_tap_block(rows) for rows in (8, 4, 2, 1))
_block8_to_output = _tap_block(8, to_output=True)
#: Row blocks (`_tap_block`'s ``spacing``) of convs of stride 1 and 2 along the rows.
_row_stride1, _row_stride2 = (_tap_block(ROW_POSITIONS, to_output=True, spacing=s) for s in (1, 2))
#: Row blocks of two output rows of 7 (`_tap_block`'s ``line``): 7x7 maps, whose rows end to end
#: took 8-position blocks (a start each) and a last block of 1.
PAIRED_WIDTH = ROW_POSITIONS // 2
_pair_stride1, _pair_stride2 = (_tap_block(ROW_POSITIONS, to_output=True, spacing=s, line=PAIRED_WIDTH)
                                for s in (1, 2))


@inline
def row_blocks_of(out_width: int, column_stride: int) -> int:
    """How many row blocks (`ROW_POSITIONS` wide) `direct_panel_conv` cuts each output row into,
    0 for none (blocks across the rows' ends instead): rows they fit with little waste, a row's last
    block ending at its end, overlapping the one before (the same sums twice, the same bits). 56,
    28 and 14 wide are whole blocks, 27 and 55 waste 1 position in 28 and 56; 7, 13, 20 or 35 wide
    keep the 8-position blocks, which waste none (at 0.88 of a row block's speed)."""
    if not ROW_BLOCKS or column_stride > 2 or out_width < ROW_POSITIONS:
        return 0
    blocks = -(-out_width // ROW_POSITIONS)
    return blocks if 10 * out_width >= 9 * blocks * ROW_POSITIONS else 0


@kernel(contract=False)
def direct_panel_conv(panels: np.ndarray, padded: np.ndarray, tap_sets: np.ndarray, panel_taps: np.ndarray,
                      y: np.ndarray, bias: np.ndarray, block: np.ndarray, u0: int, u1: int, q0: int, q1: int,
                      out_height: int, out_width: int, row_stride: int, column_stride: int, act: int, a: float,
                      b: float) -> None:
    """Units ``u0:u1`` of the band of output rows ``q0:q1`` of the conv of the padded images
    ``padded`` (N, C, Hp, Wp) with the packed weights ``panels`` (P, taps, W) (`pack_joined_taps`):
    unit ``u`` is panel ``u // (q1 - q0)`` at row ``q0 + u % (q1 - q0)``, the rows counted through
    the images (row ``q`` is image ``q // Ho``'s row ``q % Ho``). Panel ``p`` sums its first
    ``panel_taps[p, 1]`` taps, tap ``t`` reading
    ``padded[i].flat[offsets[t] + oy·row_stride·Wp + ox·column_stride]`` with ``offsets =
    tap_sets[panel_taps[p, 0]]`` (one set for a conv; a joined conv's panels each their own
    conv's, `joined_taps`): ``y`` (N, M, Ho·Wo) = act(sums + ``bias``), ``bias`` zero-padded to
    P·W. ``block`` (`BLOCK_POSITIONS`, W) holds a finished block before its transposed store.
    ``act``, ``a``, ``b``: the epilogue (`compiled.epilogue`).

    The rows of one image and panel are cut into row blocks where `row_blocks_of` says, in
    pairs on maps 7 wide (`PAIRED_WIDTH`), else into blocks of `BLOCK_POSITIONS` positions across
    the rows' ends (a 7x7 map is 6 blocks of 8 and one of 1, where blocks of each row alone were
    4, 2 and 1, the last two half as fast a position or less)."""
    width = panels.shape[2]
    row_bytes = width * panels.itemsize
    av, bv = np.float32(a), np.float32(b)
    finish = finishing(act)
    wp = padded.shape[3]
    plane = padded.shape[1] * padded.shape[2] * wp
    flat = padded.reshape(padded.shape[0] * plane)
    m = y.shape[1]
    starts = np.empty(BLOCK_POSITIONS, np.int64)
    row_blocks = row_blocks_of(out_width, column_stride)
    by_rows = row_blocks > 0
    paired = ROW_BLOCKS and out_width == PAIRED_WIDTH and column_stride <= 2
    band = q1 - q0
    u = u0
    while u < u1:
        p, q = u // band, q0 + u % band
        i, oy = q // out_height, q % out_height
        last = min(out_height, oy + min(q1 - q, u1 - u))  # this image's rows of the part, in this panel
        base, out = i * plane, y[i]
        offsets, taps = tap_sets[panel_taps[p, 0]], panel_taps[p, 1]
        channels = min(width, m - p * width)
        # the panel's last blocks prefetch the next panel's weights (its rows end a part, or the image)
        has_next = p + 1 < panels.shape[0]
        if by_rows and channels == width:
            blocks = (last - oy) * row_blocks
            for row in range(oy, last):
                for k in range(row_blocks):
                    column = min(k * ROW_POSITIONS, out_width - ROW_POSITIONS)
                    start = row * row_stride * wp + column * column_stride
                    ahead_at, ahead_step = ahead_share(has_next, (row - oy) * row_blocks + k, blocks, taps, row_bytes)
                    if column_stride == 1:
                        _row_stride1(flat, offsets, base, start, taps, panels, p, out, finish, bias, av, bv,
                                     row * out_width + column, ahead_at, ahead_step)
                    else:
                        _row_stride2(flat, offsets, base, start, taps, panels, p, out, finish, bias, av, bv,
                                     row * out_width + column, ahead_at, ahead_step)
            u += last - oy
            continue
        if paired and channels == width and last - oy >= 2:
            blocks = (last - oy + 1) // 2
            for row in range(oy, last, 2):
                top = min(row, last - 2)  # (a last pair overlapping the one before: the same bits again)
                starts[0], starts[1] = top * row_stride * wp, (top + 1) * row_stride * wp
                ahead_at, ahead_step = ahead_share(has_next, (row - oy) // 2, blocks, taps, row_bytes)
                if column_stride == 1:
                    _pair_stride1(flat, offsets, base, starts, taps, panels, p, out, finish, bias, av, bv,
                                  top * out_width, ahead_at, ahead_step)
                else:
                    _pair_stride2(flat, offsets, base, starts, taps, panels, p, out, finish, bias, av, bv,
                                  top * out_width, ahead_at, ahead_step)
            u += last - oy
            continue
        v, end = oy * out_width, last * out_width
        while v < end:
            rows = end - v
            rows = 8 if BLOCK_POSITIONS == 8 and rows >= 8 else 4 if rows >= 4 else 2 if rows >= 2 else 1
            row, column = v // out_width, v % out_width  # then stepped (a division a position cost 5%)
            for r in range(rows):
                starts[r] = row * row_stride * wp + column * column_stride
                column += 1
                if column == out_width:
                    row, column = row + 1, 0
            if rows == 8 and channels == width:
                _block8_to_output(flat, offsets, base, starts, taps, panels, p, out, finish, bias, av, bv, v)
                v += rows
                continue
            if rows == 8:
                _block8(flat, offsets, base, starts, taps, panels, p, block, finish, bias, av, bv)
            elif rows == 4:
                _block4(flat, offsets, base, starts, taps, panels, p, block, finish, bias, av, bv)
            elif rows == 2:
                _block2(flat, offsets, base, starts, taps, panels, p, block, finish, bias, av, bv)
            else:
                _block1(flat, offsets, base, starts, taps, panels, p, block, finish, bias, av, bv)
            for j in range(channels):
                target = out[p * width + j]
                for r in range(rows):
                    target[v + r] = block[r, j]
            v += rows
        u += last - oy


@kernel
def post_panels(control: np.ndarray, panels: np.ndarray, padded: np.ndarray, tap_sets: np.ndarray,
                panel_taps: np.ndarray, y: np.ndarray, bias: np.ndarray, blocks: np.ndarray, numbers: np.ndarray,
                parts: np.ndarray, out_height: int, out_width: int, row_stride: int, column_stride: int,
                act: int) -> int:
    """Post part ``i + 1`` of ``parts`` (rows ``u0, u1, q0, q1``) to helper ``i`` of a claimed
    team's ``control`` (its finished blocks in ``blocks[i]``), for `direct_panel_part` to run as
    `direct_panel_conv` on these arrays; the epilogue's ``a, b`` in float64 ``numbers``. Returns
    how many of those helpers were asleep (the caller wakes them). One compiled call: building
    each part's integers in Python cost a conv 4-5 µs on two cores."""
    sleeping = 0
    for i in range(parts.shape[0] - 1):
        row = control[i]
        row[KIND] = PART_KIND
        at = ARGS
        row[at], row[at + 1] = panels.shape[0], panels.shape[1]
        for d in range(4):
            row[at + 2 + d] = padded.shape[d]
        row[at + 6], row[at + 7], row[at + 8] = y.shape[1], y.shape[2], tap_sets.shape[0]
        p = at + 9
        row[p], row[p + 1], row[p + 2], row[p + 3] = (panels.ctypes.data, padded.ctypes.data, tap_sets.ctypes.data,
                                                      panel_taps.ctypes.data)
        row[p + 4], row[p + 5], row[p + 6], row[p + 7] = (y.ctypes.data, bias.ctypes.data, blocks[i].ctypes.data,
                                                          numbers.ctypes.data)
        q = p + 8
        row[q], row[q + 1], row[q + 2], row[q + 3] = parts[i + 1, 0], parts[i + 1, 1], parts[i + 1, 2], parts[i + 1, 3]
        row[q + 4], row[q + 5], row[q + 6] = out_height, out_width, row_stride
        row[q + 7], row[q + 8] = column_stride, act
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel(contract=False)
def finish_panels(control: np.ndarray, panels: np.ndarray, padded: np.ndarray, tap_sets: np.ndarray,
                  panel_taps: np.ndarray, y: np.ndarray, bias: np.ndarray, block: np.ndarray, parts: np.ndarray,
                  out_height: int, out_width: int, row_stride: int, column_stride: int, act: int, a: float, b: float,
                  rounds: int) -> bool:
    """Run part 0 of ``parts`` here (``block`` this thread's), then wait for the parts
    `post_panels` posted; False when a helper is not done within ``rounds`` spins (the caller
    then waits the slow way, `SpinTeam.wait`)."""
    direct_panel_conv(panels, padded, tap_sets, panel_taps, y, bias, block, parts[0, 0], parts[0, 1], parts[0, 2],
                      parts[0, 3], out_height, out_width, row_stride, column_stride, act, a, b)
    return wait_all(control, parts.shape[0] - 1, rounds)


@kernel(contract=False)
def post_and_finish_panels(control: np.ndarray, panels: np.ndarray, padded: np.ndarray, tap_sets: np.ndarray,
                           panel_taps: np.ndarray, y: np.ndarray, bias: np.ndarray, blocks: np.ndarray,
                           block: np.ndarray, numbers: np.ndarray, parts: np.ndarray, out_height: int,
                           out_width: int, row_stride: int, column_stride: int, act: int, rounds: int) -> int:
    """`post_panels`, then `finish_panels` unless a helper was asleep: `spin_team.HELPERS_ASLEEP`
    (nothing run here yet), `PARTS_DONE` or `PARTS_RUNNING`."""
    if post_panels(control, panels, padded, tap_sets, panel_taps, y, bias, blocks, numbers, parts, out_height,
                   out_width, row_stride, column_stride, act):
        return HELPERS_ASLEEP
    if finish_panels(control, panels, padded, tap_sets, panel_taps, y, bias, block, parts, out_height, out_width,
                     row_stride, column_stride, act, numbers[0], numbers[1], rounds):
        return PARTS_DONE
    return PARTS_RUNNING


@numba.njit(inline="always")
def direct_panel_part(control: np.ndarray) -> None:
    """Run the `direct_panel_conv` part posted in a spin team's ``control`` row (`post_panels`):
    the helper's side (a `team_parts` runner)."""
    at = ARGS
    count, taps, n, c, hp, wp, m, span, sets = (control[at], control[at + 1], control[at + 2], control[at + 3],
                                                control[at + 4], control[at + 5], control[at + 6], control[at + 7],
                                                control[at + 8])
    p = at + 9
    panels = numba.carray(address_as_pointer(control[p], np.float32), (count, taps, WIDTH))
    padded = numba.carray(address_as_pointer(control[p + 1], np.float32), (n, c, hp, wp))
    tap_sets = numba.carray(address_as_pointer(control[p + 2], np.int64), (sets, taps))
    panel_taps = numba.carray(address_as_pointer(control[p + 3], np.int64), (count, 2))
    y = numba.carray(address_as_pointer(control[p + 4], np.float32), (n, m, span))
    bias = numba.carray(address_as_pointer(control[p + 5], np.float32), (count * WIDTH,))
    block = numba.carray(address_as_pointer(control[p + 6], np.float32), (BLOCK_POSITIONS, WIDTH))
    numbers = numba.carray(address_as_pointer(control[p + 7], np.float64), (2,))
    q = p + 8
    direct_panel_conv(panels, padded, tap_sets, panel_taps, y, bias, block, control[q], control[q + 1],
                      control[q + 2], control[q + 3], control[q + 4], control[q + 5], control[q + 6], control[q + 7],
                      control[q + 8], numbers[0], numbers[1])
