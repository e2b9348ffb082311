"""1x1 convs as register-blocked GEMMs of their own: ``y = act(W @ x + bias)`` per image and group.

A 1x1 conv of an image is one GEMM, ``(M, C) @ (C, H·W)``. BLAS does it at about 95 GF/s a core
here, then a second pass over the output adds the bias and the activation. ONNX Runtime's convs
run at about 105 a core with both done as the results leave the registers. Two kernels on the
register blocks of `panels` do the same:

`pointwise_conv` (maps of some size): the input's columns in panels of `panel_width` positions.
At unit stride a whole panel is read in place (a strided view: each depth's 32 positions are one
run of the input's row); only a map's last, partial panel is packed (padded with zeros). Packing
every panel cost a copy of the input per run, a third of a squeeze layer's time (SqueezeNet's
64 -> 16 at 55x55 on one core: 85 -> 61 µs, 128 -> 16 168 -> 120, ResNet-50's 512 -> 128 at
28x28 1031 -> 895). Strided 1x1 convs (ResNet's downsampling shortcut) pack the positions they
read, and so do unit-stride convs of many output channels (`PACK_MIN_CHANNELS`: the copy then
pays for itself). The constant
weights are kept transposed (``wt`` = Wᵀ per group, (G, C/G, M/G)), and each block of
``BLOCK_ROWS`` output channels by one panel is summed in vector registers over C, then biased,
activated and stored while it is in L1. Cache blocking: C in blocks of `DEPTH` (a panel's block
is 16 KiB), channels in blocks of `CHANNELS` (their weights' block of C stays in L2), and each
register block of channels goes through a band of `BAND_PANELS` panels before the next (a few
output planes written at a time: store streams the prefetchers follow; the band's panels, 256
KiB at most, are read again from L2 for each block), unless the output stays in cache
(`CACHED_OUTPUT_BYTES`: then each panel goes through every block of channels while it is in L1),
the panels read in place prefetched two ahead (`panels._strided8`). A later block of C adds to the sums the
earlier ones stored (`panels._more8`...), so each value is summed from zero along C one
multiply-add after another, whatever the blocking: the same bits for any split between threads.

`small_map_conv` (deep inputs on small maps, and most 1x1s of the classic CNNs): the other way
round, positions are the blocks' rows, read in place from the input, and the weights are packed
once into panels of output channels (`pack_weights`); each block is stored transposed (in
registers for a whole panel of channels). No position is padded (a 7x7 map is 49 rows): blocks of
14 positions with AVX-512 (`panels.WIDE_ROWS`), else 8; a few positions left over go by smaller
blocks (`SHORT_TAIL`), more by one more block overlapping the one before. An input over `SMALL_MAP_WHOLE_BYTES` goes by in bands of positions through every panel
(`SMALL_MAP_BAND_BYTES`), and each step prefetches its input row a few lines ahead
(`panels.A_AHEAD`): inside a model's run the map comes from memory, in more streams than the
prefetchers follow.

Both kernels can store the channels in a channel shuffle's order instead (``shuffled``: the
``Reshape(N, G, M/G, H, W) → Transpose(0, 2, 1, 3, 4) → Reshape(N, M, H, W)`` that follows each
grouped 1x1 conv of ShuffleNet): group g's channel j is output row ``j·G + g``, so each group's
rows are a strided view of the output (`_group_rows`) and the shuffle costs no copy.

The blocks apply the bias and the activation in registers (`panels.BIAS_RELU`...), each as
`compiled.epilogue`'s loops do it, with the same comparisons, FMAs and exponential: the same bits
as the standalone op.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import (ARGS, HELPERS_ASLEEP, KIND, PARTS_DONE, PARTS_RUNNING, address_as_pointer,
                                      post_and_count_asleep, wait_all)
from . import kernel
from .epilogue import CLIP, HARD_SIGMOID, HARD_SWISH, LEAKY_RELU, NONE, RELU, SIGMOID, SWISH
from .panels import (ADD_TO_Y, BIAS, BIAS_CLIP, BIAS_HARD_SIGMOID, BIAS_HARD_SWISH, BIAS_LEAKY_RELU, BIAS_RELU,
                     BIAS_SIGMOID, BIAS_SWISH, BLOCK_ROWS, RAW, _by_column1, _by_column2, _by_column4, _by_column8,
                     _by_column14,
                     _by_column8_to_output, _by_column14_to_output, _by_column8_residual, _by_column14_residual,
                     _strided1, _strided1_residual, _strided2, ahead_share,
                     _strided2_residual, _strided4, _strided4_residual, _strided8, _strided8_residual, pack_panels,
                     panel_width, WIDE_BLOCKS, WIDE_ROWS)

#: The kinds of spin-team parts that are a `pointwise_conv` range and a `small_map_conv` one.
PART_KIND, SMALL_MAP_PART_KIND = 6, 7

#: Input channels (GEMM depth) per block: a float32 panel block of 128 x 32 is 16 KiB.
DEPTH = 128
#: Output channels per block: their weights for one block of depth, 256 KiB at most.
CHANNELS = 512

#: From this many output channels (of a group, in a part) a unit-stride conv packs its input's
#: panels too, as a strided one does, instead of reading them in place: each is read once for
#: every block of 8 channels, and read in place a panel's rows are a map's plane apart, so that
#: a deep one's share a few cache sets (at 56x56, 12.5 KiB apart). One core: 64 -> 256 at 56x56
#: 558 -> 514 µs, 128 -> 512 at 28x28 550 -> 439; with fewer channels the copy costs more than
#: it saves (64 -> 64 at 56x56 105 against 115).
PACK_MIN_CHANNELS = 128

#: Panels of positions each block of output channels goes through before the next block takes
#: them (their input, at most 16 x `DEPTH` x 32 values, is read again from L2 for each block).
#: Every block of channels for one panel at a time wrote each of the M output planes a panel
#: apart: M store streams, too many for the prefetchers once the output had left the cache, as
#: in a model's run. One core, caches flushed first (hot unchanged): 16 -> 64 at 55x55 224-232
#: -> 132-134 µs, 32 -> 128 at 27x27 155-163 -> 114-115, 64 -> 16 at 55x55 217-232 -> 191-199.
BAND_PANELS = 16
#: ... unless a group's output in the part is at most this many bytes: then each panel goes
#: through every block of channels in turn while it is in L1, its output rows staying in cache
#: (one core, hot: ShuffleNet's grouped 272 -> 272 1x1 at 14x14 60 -> 55.5 µs, 136 -> 136 at
#: 28x28 56-63 -> 54).
CACHED_OUTPUT_BYTES = 512 << 10

#: `small_map_conv`'s positions go by in bands of this many bytes of input (at least 8 positions),
#: each through every panel of channels before the next band: swept whole for each panel, an
#: input larger than L2 came from L3 once a panel.
SMALL_MAP_BAND_BYTES = 256 << 10
#: ... where its positions' input is more than this: one that stays in L2 keeps one sweep a panel
#: (bands then cost more in their panels' weights read again and their output rows' store streams
#: cut short: 64 -> 256 at 56x56 790 -> 925 µs in bands).
SMALL_MAP_WHOLE_BYTES = 1 << 20

_WIDTH = panel_width(np.float32)


@kernel
def _pack(x: np.ndarray, panels: np.ndarray, v0: int, v1: int, in_width: int, out_width: int, sh: int,
          sw: int) -> None:
    """Pack output positions ``v0:v1`` of the 1x1 conv's input ``x`` (C, H·W) into ``panels``
    (at least ceil((v1 - v0) / W) of them, (count, C, W)); position ``v`` reads input row ``v //
    out_width · sh``, column ``v % out_width · sw``. A last partial panel is padded with zeros."""
    width = panels.shape[2]
    count = (v1 - v0 + width - 1) // width
    offsets = np.empty(width, np.int64)
    contiguous = sh == 1 and sw == 1 and in_width == out_width
    for p in range(count):
        s = v0 + p * width
        n = min(width, v1 - s)
        target = panels[p]
        if contiguous:
            for c in range(x.shape[0]):
                row, source = target[c], x[c, s:s + n]
                for j in range(n):
                    row[j] = source[j]
                for j in range(n, width):
                    row[j] = 0.0
            continue
        for j in range(n):
            v = s + j
            oh = v // out_width
            offsets[j] = oh * sh * in_width + (v - oh * out_width) * sw
        for c in range(x.shape[0]):
            row, source = target[c], x[c]
            for j in range(n):
                row[j] = source[offsets[j]]
            for j in range(n, width):
                row[j] = 0.0


#: The register blocks' ``finish`` (`panels.BIAS`...) doing the bias and each `compiled.epilogue`
#: code (at its index).
_FINISHES = np.zeros(max(NONE, RELU, CLIP, LEAKY_RELU, HARD_SIGMOID, HARD_SWISH, SIGMOID, SWISH) + 1, np.int64)
for _code, _finish in {NONE: BIAS, RELU: BIAS_RELU, CLIP: BIAS_CLIP, LEAKY_RELU: BIAS_LEAKY_RELU,
                       HARD_SIGMOID: BIAS_HARD_SIGMOID, HARD_SWISH: BIAS_HARD_SWISH, SIGMOID: BIAS_SIGMOID,
                       SWISH: BIAS_SWISH}.items():
    _FINISHES[_code] = _finish
del _code, _finish


@numba.njit(inline="always")
def finishing(act: int) -> int:
    """The register blocks' ``finish`` doing the bias and epilogue ``act``."""
    return _FINISHES[act]


@numba.njit(inline="always")
def _group_rows(y: np.ndarray, i: int, g: int, groups: int, mg: int, shuffled: bool) -> np.ndarray:
    """Image ``i``'s output rows of group ``g`` (``mg`` channels) in ``y`` (N, M, Ho·Wo, float32):
    rows ``g·mg …`` in order, or with ``shuffled`` rows ``g, g + groups, …`` (a channel shuffle of
    ``groups``)."""
    plane = y.shape[2]
    if shuffled:
        return np.lib.stride_tricks.as_strided(y[i, g:], shape=(mg, plane), strides=(groups * plane * 4, 4))
    return np.lib.stride_tricks.as_strided(y[i, g * mg:], shape=(mg, plane), strides=(plane * 4, 4))


@numba.njit(inline="always")
def _channel_blocks(cols: np.ndarray, panels: np.ndarray, p: int, k0: int, k1: int, y: np.ndarray, c0: int,
                    m0: int, m1: int, last: bool, bias: np.ndarray, act: int, av: float, bv: float,
                    res: np.ndarray, adding: bool) -> None:
    """Channels ``m0:m1`` of panel ``p`` over depth ``k0:k1`` (``cols`` = wt[k0:k1]), into ``y``'s
    columns ``c0:c0 + W``, adding to what earlier blocks of depth stored; ``last``: the last block
    of depth, so finish each block of channels in registers, with ``adding`` plus the residual
    ``res`` (y's rows) before the activation (`NONE` or `RELU`)."""
    finish = finishing(act) if last else RAW
    if k0 > 0:
        finish |= ADD_TO_Y
    residual = adding and last
    r = m0
    while r < m1:
        rows = m1 - r
        rows = BLOCK_ROWS if rows >= BLOCK_ROWS else 4 if rows >= 4 else 2 if rows >= 2 else 1
        if rows == 8:
            if residual:
                _strided8_residual(cols, panels, p, k0, k1, y, r, c0, finish, bias, av, bv, res)
            else:
                _strided8(cols, panels, p, k0, k1, y, r, c0, finish, bias, av, bv)
        elif rows == 4:
            if residual:
                _strided4_residual(cols, panels, p, k0, k1, y, r, c0, finish, bias, av, bv, res)
            else:
                _strided4(cols, panels, p, k0, k1, y, r, c0, finish, bias, av, bv)
        elif rows == 2:
            if residual:
                _strided2_residual(cols, panels, p, k0, k1, y, r, c0, finish, bias, av, bv, res)
            else:
                _strided2(cols, panels, p, k0, k1, y, r, c0, finish, bias, av, bv)
        elif residual:
            _strided1_residual(cols, panels, p, k0, k1, y, r, c0, finish, bias, av, bv, res)
        else:
            _strided1(cols, panels, p, k0, k1, y, r, c0, finish, bias, av, bv)
        r += rows


@numba.njit(inline="always")
def _add_run(source: np.ndarray, res: np.ndarray, row: np.ndarray, s: int, count: int, relu: bool) -> None:
    """``row[s + j] = source[j] + res[s + j]`` for ``j < count``, then a Relu as `compiled.one_pass`'s
    where ``relu`` (NaN passes, -0 gives +0)."""
    zero = np.float32(0.0)
    for j in range(count):
        v = source[j] + res[s + j]
        row[s + j] = v if not relu or (v > zero) | (v != v) else zero


@kernel(contract=False)
def pointwise_conv(wt: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray, panels: np.ndarray,
                   tail: np.ndarray, residual: np.ndarray, i0: int, i1: int, v0: int, v1: int, m0: int, m1: int,
                   in_width: int, out_width: int, sh: int, sw: int, act: int, a: float, b: float,
                   shuffled: bool) -> None:
    """Output positions ``v0:v1`` of channels ``m0:m1`` of images ``i0:i1`` of a 1x1 conv of G
    groups: ``y[i, m, v] = act(wt[g, :, m - g·Mg] @ x[i, g·Cg:(g + 1)·Cg, src(v)] + bias[m])``
    with ``g = m // Mg``, float32. ``wt`` is each group's weights transposed (G, Cg, Mg),
    C-contiguous; ``x`` (N, C, H·W) and ``y`` (N, M, Ho·Wo) have contiguous rows; strides ``sh``,
    ``sw`` and the input and output widths say which input position each output one reads (see
    `_pack`). ``panels`` holds at least ceil((v1 - v0) / W) panels (count, Cg, W): the packed
    positions of a strided conv, or at unit stride only the last partial panel (whole ones are
    read in place); ``tail`` (M, W) takes the partial panel's results before their copy out.
    ``act``, ``a``, ``b``: the epilogue (`compiled.epilogue`); ``shuffled``: channel ``m`` stored
    as row ``(m % Mg)·G + m // Mg`` (`_group_rows`). A ``residual`` of y's shape (none: no
    images) is added as `small_map_conv` adds it."""
    groups, c, mg = wt.shape
    adding = residual.shape[0] > 0
    tail_act = NONE if adding else act  # (the partial panel's residual and activation: in its copy out)
    width = panels.shape[2]
    count = (v1 - v0 + width - 1) // width
    s = v0 + (count - 1) * width
    partial = count > 0 and s + width > v1
    whole = count - 1 if partial else count
    unit = sh == 1 and sw == 1 and in_width == out_width
    av, bv = np.float32(a), np.float32(b)
    for i in range(i0, i1):
        for g in range(groups):
            lo, hi = max(m0, g * mg) - g * mg, min(m1, (g + 1) * mg) - g * mg  # the group's channels, in it
            if lo >= hi:
                continue
            in_place = unit and hi - lo < PACK_MIN_CHANNELS
            source = x[i, g * c:(g + 1) * c]
            if in_place:  # whole panels are the input's own columns; only a partial one is packed
                columns = np.lib.stride_tricks.as_strided(source[:, v0:], shape=(whole, c, width),
                                                          strides=(width * 4, source.shape[1] * 4, 4))
                if partial:
                    _pack(source, panels, s, v1, in_width, out_width, sh, sw)
            else:  # (the packed panels as the same kind of view: one compiled block for both)
                columns = np.lib.stride_tricks.as_strided(panels, shape=(whole, c, width),
                                                          strides=(c * width * 4, width * 4, 4))
                _pack(source, panels, v0, v1, in_width, out_width, sh, sw)
            last = 0 if in_place else count - 1  # the partial panel's place in ``panels``
            out, rest, weights = _group_rows(y, i, g, groups, mg, shuffled), tail[g * mg:(g + 1) * mg], wt[g]
            extra = _group_rows(residual, i, g, groups, mg, shuffled) if adding else out
            group_bias = bias[g * mg:(g + 1) * mg]
            # a panel at a time through every block of channels where their output stays in cache
            bands = 1 if 4 * (hi - lo) * (v1 - v0) <= CACHED_OUTPUT_BYTES else BAND_PANELS
            for b0 in range(lo, hi, CHANNELS):
                b1 = min(hi, b0 + CHANNELS)
                for k0 in range(0, c, DEPTH):
                    k1 = min(c, k0 + DEPTH)
                    cols = weights[k0:k1]
                    for band in range(0, whole, bands):
                        for r in range(b0, b1, BLOCK_ROWS):
                            for p in range(band, min(band + bands, whole)):
                                _channel_blocks(cols, columns, p, k0, k1, out, v0 + p * width, r,
                                                min(b1, r + BLOCK_ROWS), k1 == c, group_bias, act, av, bv, extra,
                                                adding)
                    if partial:  # (through the tail)
                        _channel_blocks(cols, panels, last, k0, k1, rest, 0, b0, b1, k1 == c, group_bias, tail_act,
                                        av, bv, extra, False)
            if partial:
                for r in range(lo, hi):
                    row, source = out[r], rest[r]
                    if adding:
                        _add_run(source, extra[r], row, s, v1 - s, act == RELU)
                        continue
                    for j in range(v1 - s):
                        row[s + j] = source[j]


@numba.njit(inline="always")
def _pointwise_arrays(buffer: np.ndarray, count: int, c: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """A part's ``panels`` (count, Cg, W) and ``tail`` (M, W) of `pointwise_conv`, at the start of ``buffer``."""
    size = count * c * _WIDTH
    return buffer[:size].reshape((count, c, _WIDTH)), buffer[size:size + m * _WIDTH].reshape((m, _WIDTH))


def pointwise_buffer_size(count: int, c: int, m: int) -> int:
    """Float32 values of one part's buffer for `pointwise_parts` (its ``panels`` and ``tail``)."""
    return count * c * _WIDTH + m * _WIDTH


@kernel(contract=False)
def pointwise_parts(wt: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray, buffer: np.ndarray,
                    residual: np.ndarray, parts: np.ndarray, first: int, count: int, in_width: int, out_width: int,
                    sh: int, sw: int, act: int, a: float, b: float, shuffled: bool) -> None:
    """`pointwise_conv` of each part from row ``first`` of ``parts`` (i0, i1, v0, v1, m0, m1) in
    turn, each part's panels and tail in ``buffer`` (`pointwise_buffer_size` values, at least
    ``count`` panels)."""
    panels, tail = _pointwise_arrays(buffer, count, wt.shape[1], y.shape[1])
    for k in range(first, parts.shape[0]):
        pointwise_conv(wt, x, y, bias, panels, tail, residual, parts[k, 0], parts[k, 1], parts[k, 2], parts[k, 3],
                       parts[k, 4], parts[k, 5], in_width, out_width, sh, sw, act, a, b, shuffled)


#: Where in a spin team's control row the posts put the residual's address (after `_post_range`'s
#: values) and its count of images (0: none).
_RESIDUAL_AT = ARGS + 27


@numba.njit(inline="always")
def _post_range(row: np.ndarray, part: np.ndarray, in_width: int, out_width: int, sh: int, sw: int, act: int,
                shuffled: bool) -> int:
    """The tail both kinds of 1x1 part share, from ``ARGS + 15`` of ``row``: the part's range (six
    integers), the geometry, the epilogue's code and whether the channels are stored shuffled;
    then post it (1: its helper was asleep)."""
    at = ARGS + 15
    for j in range(6):
        row[at + j] = part[j]
    row[at + 6], row[at + 7], row[at + 8], row[at + 9], row[at + 10] = in_width, out_width, sh, sw, act
    row[at + 11] = 1 if shuffled else 0
    return post_and_count_asleep(row)


@kernel
def post_pointwise(control: np.ndarray, wt: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray,
                   buffers: np.ndarray, residual: np.ndarray, numbers: np.ndarray, parts: np.ndarray, count: int,
                   in_width: int, out_width: int, sh: int, sw: int, act: int, shuffled: bool) -> int:
    """Post part ``i + 1`` of ``parts`` to helper ``i`` of a claimed team's ``control`` (its buffer
    ``buffers[i]``, as `pointwise_parts`'), for `pointwise_part` to run; the epilogue's ``a, b``
    in float64 ``numbers``. Returns how many of those helpers were asleep (the caller wakes
    them). Posting here, in one call, costs a few microseconds of Python less per layer than
    arguments built in Python (a 1x1 conv of MobileNet takes 20-60 µs)."""
    groups, c, mg = wt.shape
    sleeping = 0
    for i in range(parts.shape[0] - 1):
        row = control[i]
        row[KIND] = PART_KIND
        at = ARGS
        row[at], row[at + 1], row[at + 2], row[at + 3] = groups, c, mg, x.shape[0]
        row[at + 4], row[at + 5], row[at + 6], row[at + 7] = x.shape[1], x.shape[2], y.shape[2], count
        panels = buffers[i].ctypes.data
        row[at + 8], row[at + 9], row[at + 10], row[at + 11] = wt.ctypes.data, x.ctypes.data, y.ctypes.data, bias.ctypes.data
        row[at + 12], row[at + 13] = panels, panels + count * c * _WIDTH * 4
        row[at + 14] = numbers.ctypes.data
        row[_RESIDUAL_AT], row[_RESIDUAL_AT + 1] = residual.ctypes.data, residual.shape[0]
        sleeping += _post_range(row, parts[i + 1], in_width, out_width, sh, sw, act, shuffled)
    return sleeping


@kernel(contract=False)
def finish_pointwise(control: np.ndarray, wt: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray,
                     buffer: np.ndarray, residual: np.ndarray, parts: np.ndarray, count: int, in_width: int,
                     out_width: int, sh: int, sw: int, act: int, a: float, b: float, shuffled: bool,
                     rounds: int) -> bool:
    """Run part 0 of ``parts`` here (``buffer`` as `pointwise_parts`'), then wait for the parts
    `post_pointwise` posted; False when a helper is not done within ``rounds`` spins (the caller
    then waits the slow way, `SpinTeam.wait`)."""
    pointwise_parts(wt, x, y, bias, buffer, residual, parts[:1], 0, count, in_width, out_width, sh, sw, act, a, b,
                    shuffled)
    return wait_all(control, parts.shape[0] - 1, rounds)


@kernel(contract=False)
def post_and_finish_pointwise(control: np.ndarray, wt: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray,
                              buffers: np.ndarray, buffer: np.ndarray, residual: np.ndarray, numbers: np.ndarray,
                              parts: np.ndarray, count: int, in_width: int, out_width: int, sh: int, sw: int, act: int,
                              shuffled: bool, rounds: int) -> int:
    """`post_pointwise`, then `finish_pointwise` (``buffer`` this thread's) unless a helper was
    asleep: `spin_team.HELPERS_ASLEEP` (nothing run here yet), `PARTS_DONE` or `PARTS_RUNNING`."""
    if post_pointwise(control, wt, x, y, bias, buffers, residual, numbers, parts, count, in_width, out_width, sh, sw,
                      act, shuffled):
        return HELPERS_ASLEEP
    if finish_pointwise(control, wt, x, y, bias, buffer, residual, parts, count, in_width, out_width, sh, sw, act,
                        numbers[0], numbers[1], shuffled, rounds):
        return PARTS_DONE
    return PARTS_RUNNING


@numba.njit(inline="always")
def pointwise_part(control: np.ndarray) -> None:
    """Run the `pointwise_conv` part posted in a spin team's ``control`` row (`post_pointwise`):
    the helper's side (a `team_parts` runner)."""
    at = ARGS
    groups, c, mg, n, xc, xs, ys, count = (control[at], control[at + 1], control[at + 2], control[at + 3],
                                           control[at + 4], control[at + 5], control[at + 6], control[at + 7])
    m = groups * mg
    p = at + 8
    wt = numba.carray(address_as_pointer(control[p], np.float32), (groups, c, mg))
    x = numba.carray(address_as_pointer(control[p + 1], np.float32), (n, xc, xs))
    y = numba.carray(address_as_pointer(control[p + 2], np.float32), (n, m, ys))
    bias = numba.carray(address_as_pointer(control[p + 3], np.float32), (m,))
    panels = numba.carray(address_as_pointer(control[p + 4], np.float32), (count, c, _WIDTH))
    tail = numba.carray(address_as_pointer(control[p + 5], np.float32), (m, _WIDTH))
    numbers = numba.carray(address_as_pointer(control[p + 6], np.float64), (2,))
    residual = numba.carray(address_as_pointer(control[_RESIDUAL_AT], np.float32),
                            (control[_RESIDUAL_AT + 1], m, ys))
    q = p + 7
    pointwise_conv(wt, x, y, bias, panels, tail, residual, control[q], control[q + 1], control[q + 2], control[q + 3],
                   control[q + 4], control[q + 5], control[q + 6], control[q + 7], control[q + 8], control[q + 9],
                   control[q + 10], numbers[0], numbers[1], control[q + 11] != 0)


def pack_weights(wt: np.ndarray) -> np.ndarray:
    """Each group's transposed weights ``wt`` (G, Cg, Mg) in panels of its output channels, (G, P,
    Cg, W), zero past Mg: the constant operand of `small_map_conv` (`panels.pack_panels` of each
    group's weights padded to whole panels)."""
    groups, c, mg = wt.shape
    padded = np.zeros((c, -(-mg // _WIDTH) * _WIDTH), np.float32)
    packed = []
    for g in range(groups):
        padded[:, :mg] = wt[g]
        packed.append(pack_panels(padded))
    return np.stack(packed)


@numba.njit(inline="always")
def _gather(x: np.ndarray, columns: np.ndarray, in_width: int, out_width: int, sh: int, sw: int, r0: int,
            r1: int) -> None:
    """``columns[c, v]`` = the input position output position ``v`` of a strided 1x1 conv reads,
    for the output rows of positions ``r0:r1`` (a part's: threads splitting the positions each
    gathered the whole map before). (Row by row: a division per position cost more than the
    conv's multiply-adds on few output channels, ResNet-50's 256 -> 128 1x1/2 at 56x56 on one
    core 593 µs against 261 on the gathered input.)"""
    for c in range(x.shape[0]):
        source, target = x[c], columns[c]
        for oh in range(r0 // out_width, (r1 - 1) // out_width + 1):
            row = source[oh * sh * in_width:]
            at = oh * out_width
            for ow in range(out_width):
                target[at + ow] = row[ow * sw]


@kernel(contract=False)
def _store_block(block: np.ndarray, y: np.ndarray, r0: int, rows: int, c0: int) -> None:
    """Store the first ``rows`` rows of a finished ``block`` (positions x a panel of channels)
    transposed, ``y[c0 + j, r0 + r] = block[r, j]``, for the channels y has."""
    channels = min(block.shape[1], y.shape[0] - c0)
    for j in range(channels):
        row = y[c0 + j]
        for r in range(rows):
            row[r0 + r] = block[r, j]


@kernel(contract=False)
def _store_block_residual(block: np.ndarray, y: np.ndarray, res: np.ndarray, r0: int, rows: int, c0: int,
                          relu: bool, skip: int) -> None:
    """`_store_block` of a block finished with its bias only, plus the residual ``res`` (y's
    shape) and, with ``relu``, a Relu as `one_pass` does it (NaN passes, -0 gives +0); its first
    ``skip`` rows left out (stored already)."""
    channels = min(block.shape[1], y.shape[0] - c0)
    zero = np.float32(0.0)
    for j in range(channels):
        row, extra = y[c0 + j], res[c0 + j]
        for r in range(skip, rows):
            v = block[r, j] + extra[r0 + r]
            row[r0 + r] = v if not relu or (v > zero) | (v != v) else zero


@kernel(contract=False)
def _last_block_over_residual(source: np.ndarray, weights: np.ndarray, p: int, c: int, out: np.ndarray, s: int,
                              rows: int, stored: int, c0: int, plain: int, bias: np.ndarray, av: float, bv: float,
                              relu: bool) -> None:
    """`_residual_blocks`' last block over its residual (``out``): positions ``s:s + rows``
    (`WIDE_ROWS` or 8) summed with their bias (``plain``) into a block of their own, those from
    ``stored`` on then stored plus the residual read in their place, and the Relu where ``relu``.
    (A function of its own: inlined into `small_map_conv`, it slowed the other blocks, SqueezeNet
    1.04-1.07x.)"""
    block = np.empty((rows, weights.shape[2]), np.float32)
    if rows == WIDE_ROWS:
        _by_column14(source[:, s:], weights, p, 0, c, block, 0, 0, plain, bias, av, bv)
    else:
        _by_column8(source[:, s:], weights, p, 0, c, block, 0, 0, plain, bias, av, bv)
    _store_block_residual(block, out, out, s, rows, c0, relu, stored - s)


@numba.njit(inline="always")
def _residual_blocks(source: np.ndarray, weights: np.ndarray, p: int, c: int, out: np.ndarray, b0: int, b1: int,
                     c0: int, finish: int, bias: np.ndarray, av: float, bv: float, extra: np.ndarray,
                     over_residual: bool, plain: int, relu: bool, has_next: bool) -> int:
    """Positions ``b0:end`` (at least 8) of panel ``p`` stored into ``out`` plus the residual
    ``extra``, in blocks of `WIDE_ROWS` (AVX-512, where there are as many) or 8 positions, the last
    few prefetching the next panel's weights where ``has_next`` (`panels.ahead_share`); returns
    ``end``, where the blocks stopped (`_whole_blocks_end`: a few positions short of ``b1`` are
    left to smaller blocks, else the last block ends at ``b1``, overlapping the one before: the
    same sums again, the same bits). (Its own loop: the blocks without a residual, in the same
    loop, ran 3-30% slower in ResNet-50's 1x1 convs.) ``over_residual`` (``out`` is ``extra``
    itself): a last block overlapping the one before would add the residual twice to the
    positions they share: it goes by `_last_block_over_residual` instead (its bias, ``plain``,
    then the residual and the Relu where ``relu``)."""
    rows = WIDE_ROWS if WIDE_BLOCKS and b1 - b0 >= WIDE_ROWS else 8
    end = _whole_blocks_end(b0, b1, rows)
    blocks = -(-(end - b0) // rows)
    # (a last block out of line prefetches nothing: the blocks before it share the next panel)
    sharing = blocks - 1 if over_residual and (end - b0) % rows else blocks
    row_bytes = weights.shape[2] * weights.itemsize
    for r in range(b0, end, rows):
        s = min(r, end - rows)
        ahead_at, ahead_step = ahead_share(has_next, (r - b0) // rows, sharing, c, row_bytes)
        if over_residual and s < r:
            _last_block_over_residual(source, weights, p, c, out, s, rows, r, c0, plain, bias, av, bv, relu)
        elif rows == WIDE_ROWS:
            _by_column14_residual(source, weights, p, 0, c, out, s, c0, finish, bias, av, bv, extra, ahead_at,
                                  ahead_step)
        else:
            _by_column8_residual(source, weights, p, 0, c, out, s, c0, finish, bias, av, bv, extra, ahead_at,
                                 ahead_step)
    return end


#: Positions past a band's last whole block of `WIDE_ROWS` that go by smaller blocks (2 and 1
#: rows); more go by one more wide block overlapping the one before, computing again the
#: positions they share. One core, 512 -> 1000 at 13x13 (SqueezeNet's classifier: 169 positions,
#: 12 blocks and one position) 1223-1325 -> 1149-1156 µs. At 7x7 (3 blocks and 7) blocks of 4, 2
#: and 1 measured the same alone (370-384 against 371-372 µs) and slower in ResNet-50's run on two
#: cores (its 2048 -> 512 at 7x7 470 -> 545 µs): the wide blocks share the prefetching of the
#: next panel's weights (`panels.ahead_share`), and three blocks did it less evenly than four.
SHORT_TAIL = 3


@numba.njit(inline="always")
def _whole_blocks_end(b0: int, b1: int, rows: int) -> int:
    """Where blocks of ``rows`` positions from ``b0`` stop, the positions to ``b1`` past it left to
    smaller blocks: a tail of at most `SHORT_TAIL` positions is left, a longer one is ``b1`` (the
    last block overlapping the one before)."""
    tail = (b1 - b0) % rows
    return b1 - tail if tail <= SHORT_TAIL else b1


@kernel(contract=False)
def small_map_conv(panels: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray, columns: np.ndarray,
                   residual: np.ndarray, i0: int, i1: int, q0: int, q1: int, r0: int, r1: int, in_width: int,
                   out_width: int, sh: int, sw: int, act: int, a: float, b: float, shuffled: bool) -> None:
    """Panels ``q0:q1`` of output channels (counted through the groups: panel ``q`` is group ``q //
    P``'s panel ``q % P``) at output positions ``r0:r1`` of images ``i0:i1`` of a 1x1 conv on a
    small map, float32: the
    positions are the register blocks' rows, read in place from the input, and the weights the
    packed panels (`pack_weights`, (G, P, Cg, W)), so no position is computed in vain; each block
    is finished and stored transposed into ``y`` (N, M, Ho·Wo), in registers for a whole panel of
    channels, else through a small buffer; the positions go by in bands (the module docstring). ``bias`` is
    (G, P·W), zero past each group's channels; ``columns`` (Cg, Ho·Wo) takes a strided conv's
    gathered input; ``shuffled`` as `pointwise_conv`'s.

    A ``residual`` of y's shape (none: no images) is added to the conv's result on the way out,
    before the activation, which is then none (``act`` `NONE`) or a Relu (`RELU`) as the Add's
    fused ones (`compiled.one_pass`): a ResidualConv layer in one pass over its output. ``y``
    may be the ``residual`` itself (the same data): each position is then read and stored
    once (`_residual_blocks`)."""
    groups, count, c, width = panels.shape
    mg = y.shape[1] // groups
    strided = sh != 1 or sw != 1 or in_width != out_width
    av, bv = np.float32(a), np.float32(b)
    adding = residual.shape[0] > 0
    over_residual = adding and residual.ctypes.data == y.ctypes.data  # (`run_pointwise`'s ``over_residual``)
    finish = finishing(act)
    plain = finishing(NONE) if adding else finish  # (a residual's blocks through the scratch: bias only)
    block = np.empty((8, width), np.float32)
    row_bytes = width * panels.itemsize
    step = WIDE_ROWS if WIDE_BLOCKS else 8
    band = (r1 - r0 if 4 * c * (r1 - r0) <= SMALL_MAP_WHOLE_BYTES
            else max(step, SMALL_MAP_BAND_BYTES // (4 * c) // step * step))
    for i in range(i0, i1):
        for g in range(q0 // count, (q1 - 1) // count + 1):
            p0, p1 = max(q0, g * count) - g * count, min(q1, (g + 1) * count) - g * count
            source = x[i, g * c:(g + 1) * c]
            if strided:
                _gather(source, columns, in_width, out_width, sh, sw, r0, r1)
                source = columns
            out, group_bias, weights = _group_rows(y, i, g, groups, mg, shuffled), bias[g], panels[g]
            extra = _group_rows(residual, i, g, groups, mg, shuffled) if adding else out
            for b0 in range(r0, r1, band):
                b1 = min(r1, b0 + band)
                for p in range(p0, p1):
                    full = (p + 1) * width <= mg  # a whole panel of channels: its blocks stored as they finish
                    has_next = p + 1 < p1  # (the last blocks bring the next panel's weights meanwhile)
                    r = b0
                    if full and adding and b1 - b0 >= 8:  # plus the residual, as the blocks below
                        r = _residual_blocks(source, weights, p, c, out, b0, b1, p * width, finish, group_bias, av,
                                             bv, extra, over_residual, plain, act == RELU, has_next)
                    elif full and WIDE_BLOCKS and b1 - b0 >= WIDE_ROWS:
                        # wide blocks to `_whole_blocks_end` (the last overlapping the one before
                        # where it is the band's end: the same sums again, the same bits)
                        r = _whole_blocks_end(b0, b1, WIDE_ROWS)
                        blocks = -(-(r - b0) // WIDE_ROWS)
                        for k in range(b0, r, WIDE_ROWS):
                            s = min(k, r - WIDE_ROWS)
                            ahead_at, ahead_step = ahead_share(has_next, (k - b0) // WIDE_ROWS, blocks, c, row_bytes)
                            _by_column14_to_output(source, weights, p, 0, c, out, s, p * width, finish, group_bias,
                                                   av, bv, ahead_at, ahead_step)
                    while r < b1:  # (a few positions past the wide blocks, or all of a narrow band)
                        rows = b1 - r
                        if rows >= 8 and full and not adding:
                            ahead_at, ahead_step = ahead_share(has_next, (r - b0) // 8, (b1 - b0) // 8, c, row_bytes)
                            _by_column8_to_output(source, weights, p, 0, c, out, r, p * width, finish, group_bias,
                                                  av, bv, ahead_at, ahead_step)
                            r += 8
                            continue
                        if rows >= 8:
                            rows = 8
                            _by_column8(source[:, r:], weights, p, 0, c, block, 0, 0, plain, group_bias, av, bv)
                        elif rows >= 4:
                            rows = 4
                            _by_column4(source[:, r:], weights, p, 0, c, block, 0, 0, plain, group_bias, av, bv)
                        elif rows >= 2:
                            rows = 2
                            _by_column2(source[:, r:], weights, p, 0, c, block, 0, 0, plain, group_bias, av, bv)
                        else:
                            _by_column1(source[:, r:], weights, p, 0, c, block, 0, 0, plain, group_bias, av, bv)
                        if adding:
                            _store_block_residual(block, out, extra, r, rows, p * width, act == RELU, 0)
                        else:
                            _store_block(block, out, r, rows, p * width)
                        r += rows


@kernel(contract=False)
def small_map_parts(panels: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray, columns: np.ndarray,
                    residual: np.ndarray, parts: np.ndarray, first: int, in_width: int, out_width: int, sh: int,
                    sw: int, act: int, a: float, b: float, shuffled: bool) -> None:
    """`small_map_conv` of each part from row ``first`` of ``parts`` (i0, i1, q0, q1, r0, r1) in turn."""
    for k in range(first, parts.shape[0]):
        small_map_conv(panels, x, y, bias, columns, residual, parts[k, 0], parts[k, 1], parts[k, 2], parts[k, 3],
                       parts[k, 4], parts[k, 5], in_width, out_width, sh, sw, act, a, b, shuffled)


@kernel
def post_small_map(control: np.ndarray, panels: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray,
                   columns: np.ndarray, residual: np.ndarray, numbers: np.ndarray, parts: np.ndarray, in_width: int,
                   out_width: int, sh: int, sw: int, act: int, shuffled: bool) -> int:
    """`post_pointwise` for `small_map_conv`: part ``i + 1`` of ``parts`` to helper ``i``, with
    ``columns[i]`` for its strided input, for `small_map_part` to run."""
    groups, count, c = panels.shape[:3]
    sleeping = 0
    for i in range(parts.shape[0] - 1):
        row = control[i]
        row[KIND] = SMALL_MAP_PART_KIND
        at = ARGS
        row[at], row[at + 1], row[at + 2], row[at + 3] = groups, count, c, x.shape[0]
        row[at + 4], row[at + 5], row[at + 6], row[at + 7] = x.shape[1], x.shape[2], y.shape[1], y.shape[2]
        row[at + 8] = columns.shape[2]
        row[at + 9], row[at + 10], row[at + 11] = panels.ctypes.data, x.ctypes.data, y.ctypes.data
        row[at + 12], row[at + 13], row[at + 14] = bias.ctypes.data, columns[i].ctypes.data, numbers.ctypes.data
        row[_RESIDUAL_AT], row[_RESIDUAL_AT + 1] = residual.ctypes.data, residual.shape[0]
        sleeping += _post_range(row, parts[i + 1], in_width, out_width, sh, sw, act, shuffled)
    return sleeping


@kernel(contract=False)
def finish_small_map(control: np.ndarray, panels: np.ndarray, x: np.ndarray, y: np.ndarray, bias: np.ndarray,
                     columns: np.ndarray, residual: np.ndarray, parts: np.ndarray, in_width: int, out_width: int,
                     sh: int, sw: int, act: int, a: float, b: float, shuffled: bool, rounds: int) -> bool:
    """`finish_pointwise` for `small_map_conv` (``columns`` this thread's)."""
    small_map_parts(panels, x, y, bias, columns, residual, parts[:1], 0, in_width, out_width, sh, sw, act, a, b,
                    shuffled)
    return wait_all(control, parts.shape[0] - 1, rounds)


@kernel(contract=False)
def post_and_finish_small_map(control: np.ndarray, panels: np.ndarray, x: np.ndarray, y: np.ndarray,
                              bias: np.ndarray, columns: np.ndarray, own: np.ndarray, residual: np.ndarray,
                              numbers: np.ndarray, parts: np.ndarray, in_width: int, out_width: int, sh: int, sw: int,
                              act: int, shuffled: bool, rounds: int) -> int:
    """`post_and_finish_pointwise` for `small_map_conv` (``own`` this thread's columns)."""
    if post_small_map(control, panels, x, y, bias, columns, residual, numbers, parts, in_width, out_width, sh, sw,
                      act, shuffled):
        return HELPERS_ASLEEP
    if finish_small_map(control, panels, x, y, bias, own, residual, parts, in_width, out_width, sh, sw, act,
                        numbers[0], numbers[1], shuffled, rounds):
        return PARTS_DONE
    return PARTS_RUNNING


@numba.njit(inline="always")
def small_map_part(control: np.ndarray) -> None:
    """Run the `small_map_conv` part posted in a spin team's ``control`` row (`post_small_map`)."""
    at = ARGS
    groups, count, c, n, xc, xs, m, ys, span = (control[at], control[at + 1], control[at + 2], control[at + 3],
                                                control[at + 4], control[at + 5], control[at + 6], control[at + 7],
                                                control[at + 8])
    p = at + 9
    panels = numba.carray(address_as_pointer(control[p], np.float32), (groups, count, c, _WIDTH))
    x = numba.carray(address_as_pointer(control[p + 1], np.float32), (n, xc, xs))
    y = numba.carray(address_as_pointer(control[p + 2], np.float32), (n, m, ys))
    bias = numba.carray(address_as_pointer(control[p + 3], np.float32), (groups, count * _WIDTH))
    columns = numba.carray(address_as_pointer(control[p + 4], np.float32), (c, span))
    numbers = numba.carray(address_as_pointer(control[p + 5], np.float64), (2,))
    residual = numba.carray(address_as_pointer(control[_RESIDUAL_AT], np.float32),
                            (control[_RESIDUAL_AT + 1], m, ys))
    q = p + 6
    small_map_conv(panels, x, y, bias, columns, residual, control[q], control[q + 1], control[q + 2], control[q + 3],
                   control[q + 4], control[q + 5], control[q + 6], control[q + 7], control[q + 8], control[q + 9],
                   control[q + 10], numbers[0], numbers[1], control[q + 11] != 0)
