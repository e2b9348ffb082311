"""Convs of a few input channels (network stems) summed straight from the input, no im2col.

A network's first conv reads the image: 3 channels, a 3x3 to 7x7 window, stride 2 (ResNet's
7x7/2 3 -> 64, MobileNet's and EfficientNet's 3x3/2 3 -> 16 or 32), or a 4x4/4 patchify
(ConvNeXt). As a GEMM its depth is only ``3·kh·kw`` (27 to 147) and its im2col copies the image
that many times over, strided: on the 2-core VM these layers took 2.8-3.5x ONNX Runtime's time,
most of it in the im2col.

Here a register block (`panels.multiply_add`) holds ``BLOCK_ROWS`` output channels x
two vectors of positions of one output row and sums them over every tap of the window. The input
is first copied into a zero-padded image (`copy_inside`, for `conv_direct.run_direct`), so no tap
reads out of bounds and no block needs a test, with each row stored as its ``stride`` phases (the
columns ``stride·j + f`` of phase ``f`` side by side): a tap's values for a block's positions are
then consecutive, two vector loads, where loading every ``stride``-th value of the row took a
load and a shuffle per vector (16 G multiply-adds/s a core at stride 2, against about 40). The
weights are kept transposed (``columns[t, m]``, tap ``t`` = ``(c, ky, kx)``), so a tap's
weights of a block are one cache line.

Each value is summed from zero along the taps in ``(c, ky, kx)`` order, one multiply-add after
another (FMA where the CPU has it): the same bits for any split of the rows between threads.
"""
from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ...concurrency.spin_team import (ARGS, HELPERS_ASLEEP, KIND, PARTS_DONE, PARTS_RUNNING, address_as_pointer,
                                      post_and_count_asleep, wait_all)
from . import kernel
from .panels import BLOCK_ROWS, VECTOR_BYTES, BlockIR, _store_finished, initial_sums, multiply_add
from .phases import split_pairs_at
from .pointwise import finishing
from .prefetch import prefetch_lines_for_write

#: The kind of spin-team part that is a `direct_conv` range.
PART_KIND = 9
#: Strides the stem kernel takes (`conv_direct.takes_direct`).
STRIDES = (1, 2, 4)
#: Float32 lanes of one vector.
LANES = VECTOR_BYTES // 4

#: Output rows a block of channels goes through before the next block takes them (the band's
#: input, a few channels, is read again for each block, from L1 or L2). Every block of channels
#: at a time along one row wrote each of the M output planes a row apart: 64 store streams at a
#: stem's 64 channels, too many for the prefetchers, so every store missed once the output had
#: left the cache, as in a model's run (SqueezeNet's 3x3/2 3 -> 64, one core: 560 µs hot, 1040
#: with the caches flushed first). Eight rows at a time write each plane a run of eight rows:
#: 575 hot, 710-780 flushed. And each row's outputs are prefetched for writing while the row
#: before is summed (`prefetch_lines_for_write`): a store that misses reads its line first, and
#: in a model's run the output has left the cache. One core, the output out of the cache (the
#: input in it), 3x3/2 on 224x224: 3 -> 16 98 -> 82 µs, 3 -> 32 194 -> 153, 3 -> 64 430 -> 345,
#: 7x7/2 3 -> 64 1250 -> 1045 (the output in the cache: 3-8% slower).
BAND_ROWS = 8

_U = np.uint64  # (unsigned indices: no negative-index wrap test in the copy's loop)


def _direct_block(rows: int, vectors: int) -> Any:
    """An intrinsic ``block(columns, image, offsets, start, taps, y_at, r0, y_step, finish, bias, lo, hi)``:
    ``Y[r, j] = Σ_t columns[t, r0 + r] · image.flat[offsets[t] + start + j]`` for ``r < rows`` and
    ``j`` < ``vectors`` vectors of lanes, summed over ``t < taps`` in registers, then finished as
    ``finish`` says with ``bias[r0 + r]`` (`panels.RAW`, `panels.BIAS`...: `panels._store_finished`)
    into ``Y``: float32 rows ``y_step`` bytes apart from the address ``y_at``. ``image`` is read
    through its data pointer (a zero-padded image). The output goes as an address, not an array:
    the caller picks it (the output or a spare block) per block, and an array picked so is a
    reference counted in and out, four atomic operations a block of a 3x3 stem's 27 taps (7% of
    its time)."""

    @intrinsic
    def block(typingctx: Any, columns: Any, image: Any, offsets: Any, start: Any, taps: Any, y_at: Any, r0: Any,
              y_step: Any, finish: Any, bias: Any, lo: Any, hi: Any) -> Any:
        signature = types.void(columns, image, offsets, start, taps, y_at, r0, y_step, finish, bias, lo, hi)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            a_arr, image_arr, offsets_arr = (context.make_array(sig.args[i])(context, builder, args[i])
                                             for i in (0, 1, 2))
            start_, taps_, y_at_, r0_, y_stride = (context.cast(builder, args[i], sig.args[i], types.int64)
                                                   for i in (3, 4, 5, 6, 7))
            code = BlockIR(context, builder, sig.args[0].dtype)
            size, vector, at, const = code.size, code.vector, code.at, code.const

            a_step = builder.extract_value(a_arr.strides, 0)
            a_rows = at(a_arr.data, builder.mul(r0_, const(size)))
            y_block = builder.inttoptr(y_at_, code.byte_ptr)
            origin = at(image_arr.data, builder.mul(start_, const(size)))

            def y_vector(r: int, v: int) -> Any:
                return builder.bitcast(at(y_block, builder.add(builder.mul(const(r), y_stride), const(v * VECTOR_BYTES))),
                                       vector.as_pointer())
            sums = initial_sums(context, builder, sig, args, y_vector, rows, vectors, vector)
            with cgutils.for_range(builder, taps_) as loop:
                offset = builder.load(builder.gep(offsets_arr.data, [loop.index]))
                row = at(origin, builder.mul(offset, const(size)))
                loaded = [builder.load(builder.bitcast(at(row, const(v * VECTOR_BYTES)), vector.as_pointer()),
                                       align=size) for v in range(vectors)]
                multiply_add(builder, sums, at(a_rows, builder.mul(loop.index, a_step)), loaded)
            _store_finished(context, builder, sig, args, [[builder.load(v) for v in row] for row in sums], y_vector, r0_)
            return context.get_dummy_value()

        return signature, codegen

    return block


#: Vectors of positions of a wide block: three with AVX-512's 32 vector registers (8 channels x 3
#: = 24 sums; a 27-tap stem sums so few taps a block that its set-up and stores weigh: one core,
#: 3x3/2 on 224x224, 3 -> 64 338 -> 320 µs, 3 -> 24 123 -> 114, 3 -> 16 86 -> 82), two with 16.
WIDE_VECTORS = 3 if BLOCK_ROWS == 8 else 2
# the blocks of `BLOCK_ROWS` channels x `WIDE_VECTORS` vectors of positions (wide) and one (narrow)
_wide, _narrow = (_direct_block(BLOCK_ROWS, vectors) for vectors in (WIDE_VECTORS, 1))


@numba.njit(inline="always")
def _channel_block(columns: np.ndarray, image: np.ndarray, offsets: np.ndarray, start: int, wide: bool,
                   y_at: int, y_step: int, m: int, r: int, bias: np.ndarray, finish: int, av: Any, bv: Any,
                   spare: np.ndarray) -> None:
    """Channels ``r:r + BLOCK_ROWS`` of the ``m`` (those there are) for one block of positions
    (`WIDE_VECTORS` vectors wide or one), finished into the rows ``y_step`` bytes apart from address
    ``y_at`` (the block's first channel and position); a block past channel ``m`` through
    ``spare`` (`BLOCK_ROWS`, `WIDE_VECTORS` vectors), then copied. ``columns`` and ``bias`` are
    padded to whole blocks."""
    whole = r + BLOCK_ROWS <= m
    at, step = (y_at, y_step) if whole else (np.int64(spare.ctypes.data), np.int64(spare.strides[0]))
    taps = offsets.shape[0]
    if wide:
        _wide(columns, image, offsets, start, taps, at, r, step, finish, bias, av, bv)
    else:
        _narrow(columns, image, offsets, start, taps, at, r, step, finish, bias, av, bv)
    if not whole:
        width = (WIDE_VECTORS if wide else 1) * LANES
        target = address_as_pointer(y_at, np.float32)
        for k in range(m - r):
            source, row = spare[k], k * (y_step // 4)
            for j in range(width):
                target[row + j] = source[j]


@kernel(contract=False)
def direct_conv(columns: np.ndarray, padded: np.ndarray, offsets: np.ndarray, y: np.ndarray, bias: np.ndarray,
                tail: np.ndarray, spare: np.ndarray, q0: int, q1: int, out_height: int, out_width: int, stride: int,
                act: int, a: float, b: float) -> None:
    """Output rows ``q0:q1`` (counted through the images: row ``q`` is image ``q // Ho``'s row
    ``q % Ho``) of the conv of the padded images ``padded`` (N, C, Hp, Wp), each row as its
    ``stride`` phases (`copy_inside`), with the weights ``columns`` (taps, M), ``columns[t, m]`` =
    tap ``t``'s weight of channel ``m``, tap ``t`` reading ``padded[i, c].flat[offsets[t] +
    oy·stride·Wp + ox]`` (its phase's value for output column ``ox``): ``y`` (N, M, Ho·Wo) =
    act(sums + ``bias``); ``columns`` and ``bias`` are padded with zeros to whole blocks of
    `BLOCK_ROWS` channels. ``tail`` (M padded so, LANES) takes a row's last positions short of a
    vector before their copy out, ``spare`` (`BLOCK_ROWS`, `WIDE_VECTORS`·LANES) the last channels short of a
    block. ``act``, ``a``, ``b``: the epilogue (`compiled.epilogue`).

    The rows go in bands of `BAND_ROWS`, and each block of channels through a whole band before
    the next block (see `BAND_ROWS`). A row's last positions short of a vector are summed a whole
    vector wide straight into ``y``, the rest of that vector landing on the next row's first
    positions, which this thread writes afterwards; only where that next row is not this range's
    (or too short) do they go through ``tail`` (one core, SqueezeNet's 111-wide stem: 311 -> 248 µs,
    the copy of 15 x 8 values a block of channels cost that much)."""
    av, bv = np.float32(a), np.float32(b)
    finish = finishing(act)
    wp = padded.shape[3]
    plane = padded.shape[1] * padded.shape[2] * wp
    flat = padded.reshape(padded.shape[0] * plane)
    m, span = y.shape[1], y.shape[2]
    y_origin, y_step = np.int64(y.ctypes.data), np.int64(y.strides[1])
    tail_origin, tail_step = np.int64(tail.ctypes.data), np.int64(tail.strides[0])
    for band in range(q0, q1, BAND_ROWS):
        for r in range(0, m, BLOCK_ROWS):
            for q in range(band, min(band + BAND_ROWS, q1)):
                i, oy = q // out_height, q % out_height
                image, out = flat[i * plane:(i + 1) * plane], y[i]
                # the outputs this block of channels writes next: the band's next row, or after
                # its last row the next block's first
                nq, nr = (q + 1, r) if q + 1 < min(band + BAND_ROWS, q1) else (band, r + BLOCK_ROWS)
                if nr < m:
                    ni, noy = nq // out_height, nq % out_height
                    for k in range(nr, min(nr + BLOCK_ROWS, m)):
                        prefetch_lines_for_write(y, (ni * m + k) * span + noy * out_width, out_width)
                row = oy * stride * wp
                c0 = oy * out_width
                # the byte address of this block of channels' first value of the row
                at = y_origin + ((i * m + r) * span + c0) * 4
                ox = 0
                while ox + WIDE_VECTORS * LANES <= out_width:
                    _channel_block(columns, image, offsets, row + ox, True, at + ox * 4, y_step, m, r, bias, finish,
                                   av, bv, spare)
                    ox += WIDE_VECTORS * LANES
                while ox + LANES <= out_width:  # (up to WIDE_VECTORS - 1 of them)
                    _channel_block(columns, image, offsets, row + ox, False, at + ox * 4, y_step, m, r, bias, finish,
                                   av, bv, spare)
                    ox += LANES
                if ox < out_width and q + 1 < q1 and oy + 1 < out_height and ox + LANES <= 2 * out_width:
                    # the last few positions and the next row's first: this thread writes that row later
                    _channel_block(columns, image, offsets, row + ox, False, at + ox * 4, y_step, m, r, bias, finish,
                                   av, bv, spare)
                elif ox < out_width:  # the last few positions: a vector's worth into the tail, then copied
                    _channel_block(columns, image, offsets, row + ox, False, tail_origin + r * tail_step, tail_step,
                                   tail.shape[0], r, bias, finish, av, bv, spare)
                    for k in range(r, min(r + BLOCK_ROWS, m)):
                        target, source = out[k], tail[k]
                        for j in range(out_width - ox):
                            target[c0 + ox + j] = source[j]


@kernel
def copy_inside(x: np.ndarray, padded: np.ndarray, top: int, left: int, phases: int) -> None:
    """``padded[:, :, top:top + H, left:left + W] = x`` (N, C, H, W), leaving the border alone,
    each padded row stored as its ``phases`` phases: padded column ``phases·j + f`` at ``f·Wq +
    j`` (``Wq`` = the row's width / ``phases``; one phase: the row as it is). A compiled loop: as
    fast as NumPy's copy on long rows and 10-20x faster on a small map's (NumPy pays its per-row
    set-up on every 7- or 14-wide row: 104 µs for 192 channels of 14x14). Two phases (the stems
    of stride 2) go a vector of pairs at a time (`phases.split_pairs_at`): SqueezeNet's,
    MobileNetV3's 224x224 RGB image, 43 -> 15 µs."""
    n, c, h, w = x.shape
    hp, wp = padded.shape[2], padded.shape[3]
    wq = wp // phases
    source, target = x.reshape(x.size), padded.reshape(padded.size)
    at = 0
    for plane in range(n * c):
        to = (plane * hp + top) * wp
        for _ in range(h):
            if phases == 1:
                for j in range(w):
                    target[_U(to + left + j)] = source[_U(at + j)]
            elif phases == 2:
                # input column 2j goes to phase left % 2, 2j + 1 to the other, both at j from their start
                split_pairs_at(source, at, w, target, to + (left % 2) * wq + left // 2,
                               to + ((left + 1) % 2) * wq + (left + 1) // 2)
            else:
                for f in range(phases):
                    first = (f - left) % phases  # the first input column of phase f
                    base = to + f * wq + (left + first) // phases
                    for j in range((w - first + phases - 1) // phases):
                        target[_U(base + j)] = source[_U(at + first + j * phases)]
            at += w
            to += wp


@kernel
def post_direct(control: np.ndarray, columns: np.ndarray, padded: np.ndarray, offsets: np.ndarray, y: np.ndarray,
                bias: np.ndarray, buffers: np.ndarray, numbers: np.ndarray, parts: np.ndarray, out_height: int,
                out_width: int, stride: int, act: int) -> int:
    """Post part ``i + 1`` of ``parts`` (rows of output rows ``q0, q1``) to helper ``i`` of a
    claimed team's ``control``, its ``tail`` and ``spare`` (`direct_conv`'s) at the start of
    ``buffers[i]``, for `direct_part` to run as `direct_conv` on these arrays; the epilogue's
    ``a, b`` in float64 ``numbers``. Returns how many of those helpers were asleep (the caller
    wakes them). One compiled call, as the other convs post theirs: with each part's integers
    built in Python and posted through `SpinTeam.try_run`, ShuffleNet's stem took 65.7 µs on two
    cores, 58.5 this way."""
    taps, mp = columns.shape
    sleeping = 0
    for i in range(parts.shape[0] - 1):
        row = control[i]
        row[KIND] = PART_KIND
        at = ARGS
        row[at], row[at + 1] = taps, mp
        for d in range(4):
            row[at + 2 + d] = padded.shape[d]
        row[at + 6], row[at + 7] = y.shape[1], y.shape[2]
        p = at + 8
        tail = buffers[i].ctypes.data
        row[p], row[p + 1] = columns.ctypes.data, padded.ctypes.data
        row[p + 2], row[p + 3] = offsets.ctypes.data, y.ctypes.data
        row[p + 4], row[p + 5], row[p + 6] = bias.ctypes.data, tail, tail + mp * LANES * 4
        row[p + 7] = numbers.ctypes.data
        q = p + 8
        row[q], row[q + 1], row[q + 2], row[q + 3] = parts[i + 1, 0], parts[i + 1, 1], out_height, out_width
        row[q + 4], row[q + 5] = stride, act
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel(contract=False)
def finish_direct(control: np.ndarray, columns: np.ndarray, padded: np.ndarray, offsets: np.ndarray, y: np.ndarray,
                  bias: np.ndarray, tail: np.ndarray, spare: np.ndarray, parts: np.ndarray, out_height: int,
                  out_width: int, stride: int, act: int, a: float, b: float, rounds: int) -> bool:
    """Run part 0 of ``parts`` here (``tail``, ``spare`` this thread's), then wait for the parts
    `post_direct` posted; False when a helper is not done within ``rounds`` spins (the caller
    then waits the slow way, `SpinTeam.wait`)."""
    direct_conv(columns, padded, offsets, y, bias, tail, spare, parts[0, 0], parts[0, 1], out_height, out_width,
                stride, act, a, b)
    return wait_all(control, parts.shape[0] - 1, rounds)


@kernel(contract=False)
def post_and_finish_direct(control: np.ndarray, columns: np.ndarray, padded: np.ndarray, offsets: np.ndarray,
                           y: np.ndarray, bias: np.ndarray, buffers: np.ndarray, tail: np.ndarray, spare: np.ndarray,
                           numbers: np.ndarray, parts: np.ndarray, out_height: int, out_width: int, stride: int,
                           act: int, rounds: int) -> int:
    """`post_direct`, then `finish_direct` unless a helper was asleep: `spin_team.HELPERS_ASLEEP`
    (nothing run here yet), `PARTS_DONE` or `PARTS_RUNNING`."""
    if post_direct(control, columns, padded, offsets, y, bias, buffers, numbers, parts, out_height, out_width, stride,
                   act):
        return HELPERS_ASLEEP
    if finish_direct(control, columns, padded, offsets, y, bias, tail, spare, parts, out_height, out_width, stride,
                     act, numbers[0], numbers[1], rounds):
        return PARTS_DONE
    return PARTS_RUNNING


@numba.njit(inline="always")
def direct_part(control: np.ndarray) -> None:
    """Run the `direct_conv` part posted in a spin team's ``control`` row (`post_direct`): the
    helper's side (a `team_parts` runner)."""
    at = ARGS
    taps, mp, n, c, hp, wp, m, span = (control[at], control[at + 1], control[at + 2], control[at + 3],
                                       control[at + 4], control[at + 5], control[at + 6], control[at + 7])
    p = at + 8
    columns = numba.carray(address_as_pointer(control[p], np.float32), (taps, mp))
    padded = numba.carray(address_as_pointer(control[p + 1], np.float32), (n, c, hp, wp))
    offsets = numba.carray(address_as_pointer(control[p + 2], np.int64), (taps,))
    y = numba.carray(address_as_pointer(control[p + 3], np.float32), (n, m, span))
    bias = numba.carray(address_as_pointer(control[p + 4], np.float32), (mp,))
    tail = numba.carray(address_as_pointer(control[p + 5], np.float32), (mp, LANES))
    spare = numba.carray(address_as_pointer(control[p + 6], np.float32), (BLOCK_ROWS, WIDE_VECTORS * LANES))
    numbers = numba.carray(address_as_pointer(control[p + 7], np.float64), (2,))
    q = p + 8
    direct_conv(columns, padded, offsets, y, bias, tail, spare, control[q], control[q + 1], control[q + 2],
                control[q + 3], control[q + 4], control[q + 5], numbers[0], numbers[1])
