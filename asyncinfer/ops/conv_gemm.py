"""2-D convolution as tiled GEMM: one cache-sized block of output positions at a time.

Lowered whole, a conv writes its im2col matrix (taps times the input) to memory, BLAS reads it
back, writes the output, and the bias and the fused activation each take one more pass over the
output: four trips through memory around one GEMM. Here the output positions are cut into blocks
of ``width`` columns sized so that the block's columns and its GEMM results stay in L2: each block
is built by the compiled `im2col2d`, multiplied by the weights in BLAS into a scratch block, and
stored through the `Epilogue` (bias and activation) into the output, so the only trip to memory is
the final store. BLAS also runs faster on a block whose B operand stays in cache (ResNet-18's
64->64 3x3 GEMM, one thread: 1.80 ms whole, 1.39 ms in blocks of 512 columns).

Blocks (per image) are the parts shared out between the pool's threads. A small map gives too few
blocks to share (ResNet's 7x7 stage: one block of 49 columns); its weights' rows are then split
in bands instead, over one im2col matrix built up front.

A float32 conv runs the same blocks as one compiled loop (`_compiled`, `compiled.conv_blocks`,
BLAS called from compiled code): no Python between blocks (an LSTM VAD's 1-D convs of 25-250 k
multiply-adds: about 27 -> 12 µs each). From `linalg.TEAM_MIN_MACS` multiply-adds on it is first
offered to the CPU backend's spinning helpers, one share of images, positions or channel bands on
this thread and one on each helper. Pool threads wake in 100-300 µs on a small VM, so convs under
`linalg.SPLIT_MIN_MACS` used to run on one core (all but one of SqueezeNet's); the helpers start
in microseconds (SqueezeNet's 16->64 3x3 at 55x55: 0.79 -> 0.44 ms on 2 cores).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..concurrency import parallel
from .compiled import blas_call
from .compiled.conv_blocks import DIRECT, EXACT, FLAT, conv_blocks, part_arguments
from .compiled.conv_blocks import PART_KIND as CONV_PART
from .compiled.im2col import im2col2d, im2col_flat
from .conv_kernels import run_tasks, scratch
from .epilogue import NO_ACTIVATION, Epilogue
from .linalg import SPLIT_MIN_MACS, TEAM_MIN_MACS, matmul, vector_cuts
from .windows import FlatWindows, flat_windows

# Bytes of one block's im2col columns plus its GEMM results: within the 1-2 MiB L2 of a core.
BLOCK_BYTES = 1 << 20
# Narrowest block (BLAS works on panels of 16-64 columns; narrower blocks lose its efficiency).
MIN_WIDTH = 64
# Fewest weight rows per band when rows are split instead of positions.
MIN_BAND_ROWS = 32
# Which im2col (`exact_im2col_pays`). Flat windows copy one contiguous run per tap and channel,
# but compute garbage columns (a padded map's extra width: 9/7 of the work at 7x7) and, for strided
# convs, first split the input into phases: the exact im2col, one short run per output row, wins
# when the waste passes EXACT_IM2COL_WASTE, for strided kernels of at most
# EXACT_IM2COL_MAX_STRIDED_TAPS taps (3x3/s2, 2x2 and 4x4 "patchify" convs) and for kernels of
# more than EXACT_IM2COL_MIN_TAPS taps (1-D STFT-like filters, where the phases would be many).
EXACT_IM2COL_WASTE = 1.2
EXACT_IM2COL_MAX_STRIDED_TAPS = 16
EXACT_IM2COL_MIN_TAPS = 64


def exact_im2col_pays(win: FlatWindows, positions: int, strides: Sequence[int]) -> bool:
    """Exact im2col over the real output positions rather than flat windows (see above)."""
    return (win.length > EXACT_IM2COL_WASTE * positions or len(win.offsets) > EXACT_IM2COL_MIN_TAPS
            or (max(strides) > 1 and len(win.offsets) <= EXACT_IM2COL_MAX_STRIDED_TAPS))


_NO_GEOMETRY = np.zeros(9, np.int64)  # conv_blocks' geometry and offsets where its mode reads none
_NO_OFFSETS = np.zeros(1, np.int64)


@dataclass(frozen=True)
class _Layout:
    """What `conv2d` derives from the shapes and the window geometry alone, worked out once per
    geometry (`_layout`): 5-10 µs of Python a call, as much as a small conv's arithmetic."""

    pointwise: bool                  # a 1x1 conv at unit stride without pads: one GEMM, no im2col
    exact: tuple[int, ...] | None    # im2col2d's geometry, when the exact im2col pays
    exact_array: np.ndarray          # the same as int64 (conv_blocks' argument), or zeros
    windows: FlatWindows | None      # else the flat windows (and their tap offsets)
    offsets: np.ndarray | None
    span: int                        # columns (virtual positions) per image
    row_width: int                   # columns per output row in that grid
    parallel: bool                   # large enough to split across the pool
    macs: int                        # multiply-adds of the whole conv
    single_blocks: tuple[tuple[int, int, int], ...]  # (image, v0, v1) blocks on one thread


@functools.lru_cache(maxsize=512)
def _layout(x_shape: tuple[int, ...], w_shape: tuple[int, ...], group: int, strides: tuple[int, ...],
            dilations: tuple[int, ...], begin: tuple[int, ...], end: tuple[int, ...], out: tuple[int, ...],
            itemsize: int, tuning: tuple) -> _Layout:
    """The layout of one geometry. ``tuning`` (`_tuning`) is part of the key so that a change to
    this module's thresholds (tests, experiments) takes effect at once."""
    n, c, h, wd = x_shape
    m, _, kh, kw = w_shape
    ho, wo = out
    positions = ho * wo
    rows = c * kh * kw
    pointwise = (kh, kw, ho, wo) == (1, 1, h, wd) and strides == (1, 1) and not any(begin) and group == 1
    exact, windows, offsets = None, None, None
    if (kh, kw) == (1, 1) and strides == (1, 1) and not any(begin) and not any(end) and (ho, wo) == (h, wd):
        span, row_width = positions, wo  # a 1x1 conv multiplies the input itself: no im2col
    else:
        win = flat_windows((h, wd), (kh, kw), strides, dilations, begin, end, out)
        if exact_im2col_pays(win, positions, strides):
            exact = (kh, kw, wo, *strides, *dilations, int(begin[0]), int(begin[1]))
            span, row_width = positions, wo
        else:
            windows, offsets = win, np.asarray(win.offsets, dtype=np.int64)
            span, row_width = win.length, win.q[1]
    macs = n * m * rows // group * positions
    width = _block_width(span, rows, m, itemsize, 2 // max(1, n))
    blocks = tuple((i, v0, min(span, v0 + width)) for i in range(n) for v0 in range(0, span, width))
    exact_array = _NO_GEOMETRY if exact is None else np.asarray(exact, np.int64)
    return _Layout(pointwise, exact, exact_array, windows, offsets, span, row_width, macs >= SPLIT_MIN_MACS, macs,
                   blocks)


def _tuning() -> tuple:
    """The module's thresholds that `_layout` reads."""
    return (EXACT_IM2COL_WASTE, EXACT_IM2COL_MAX_STRIDED_TAPS, EXACT_IM2COL_MIN_TAPS, BLOCK_BYTES, MIN_WIDTH,
            SPLIT_MIN_MACS, TEAM_MIN_MACS)


def conv2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, group: int, strides: Sequence[int],
           dilations: Sequence[int], begin: Sequence[int], end: Sequence[int], out: Sequence[int],
           epilogue: Epilogue) -> np.ndarray:
    """``x`` (N, C, H, W) conv ``w`` (M, C/group, kh, kw) → (N, M, Ho, Wo), then ``bias`` and
    ``epilogue``. ``begin``/``end`` are the pads and ``out`` the output size (from
    ``windows.window_geometry``). Float32 or float64 operands; ``epilogue`` other than
    `NO_ACTIVATION` only on float32."""
    n = x.shape[0]
    m, cg, kh, kw = w.shape
    mg = m // group
    ho, wo = (int(o) for o in out)
    layout = _layout(x.shape, w.shape, group, tuple(strides), tuple(dilations), tuple(begin), tuple(end), (ho, wo),
                     x.itemsize, _tuning())
    x = np.ascontiguousarray(x)
    weights = np.ascontiguousarray(w).reshape(group, mg, cg * kh * kw)
    b = bias
    bias = np.zeros(m, x.dtype) if b is None else np.ascontiguousarray(b, dtype=x.dtype)
    if layout.pointwise:
        # a 1x1 conv has no im2col to keep in cache: one GEMM (split by linalg.matmul) straight
        # into the output, then bias and activation in place where there are any
        planes = x.reshape(n, x.shape[1], ho * wo)
        # (a batch of one as a plain 2-D GEMM: NumPy's broadcast matmul is slower than BLAS on it)
        y = matmul(weights[0], planes[0])[None] if n == 1 else matmul(weights, planes)
        if b is not None or epilogue != NO_ACTIVATION:
            epilogue.apply(y.reshape(n * m, ho * wo), bias if n == 1 else np.tile(bias, n))
        return y.reshape(n, m, ho, wo)
    if x.dtype == np.float32:
        y = np.empty((n, m, ho * wo), dtype=x.dtype)
        if _compiled(x, weights, bias, y, wo, layout, epilogue):
            return y.reshape(n, m, ho, wo)
    columns = _columns(x, layout)
    rows = x.shape[1] * kh * kw  # im2col rows, group after group
    k = cg * kh * kw
    span, row_width = layout.span, layout.row_width

    def block_part(i: int, v0: int, v1: int) -> None:
        cols = columns(i, v0, v1, scratch((rows, v1 - v0), x.dtype, "cols"))
        block = scratch((m, v1 - v0), x.dtype, "block")
        for g in range(group):
            np.matmul(weights[g], cols[g * k:(g + 1) * k], out=block[g * mg:(g + 1) * mg])
        epilogue.store(block, bias, y[i], v0, row_width, wo)

    y = np.empty((n, m, ho * wo), dtype=x.dtype)
    threads = parallel.parts_available() if layout.parallel else 1
    if threads == 1:
        for i, v0, v1 in layout.single_blocks:
            block_part(i, v0, v1)
        return y.reshape(n, m, ho, wo)
    width = _block_width(span, rows, m, x.itemsize, threads * 2 // max(1, n))
    blocks = -(-span // width)
    if n * blocks >= 2 * threads or group > 1 or m < 2 * MIN_BAND_ROWS:
        run_tasks([functools.partial(block_part, i, v0, min(span, v0 + width))
                   for i in range(n) for v0 in range(0, span, width)], threads)
        return y.reshape(n, m, ho, wo)
    # few positions (small maps): one im2col per image, bands of output channels in parallel
    edges = np.linspace(0, m, min(2 * threads, m // MIN_BAND_ROWS) + 1).astype(int)
    for i in range(n):
        cols = columns(i, 0, span, np.empty((rows, span), x.dtype))

        def band_part(j: int, i: int = i, cols: np.ndarray = cols) -> None:
            m0, m1 = int(edges[j]), int(edges[j + 1])
            block = scratch((m1 - m0, span), x.dtype, "block")
            np.matmul(weights[0, m0:m1], cols, out=block)
            epilogue.store(block, bias[m0:m1], y[i, m0:m1], 0, row_width, wo)

        run_tasks([functools.partial(band_part, j) for j in range(len(edges) - 1)], threads)
    return y.reshape(n, m, ho, wo)


def _compiled(x: np.ndarray, weights: np.ndarray, bias: np.ndarray, y: np.ndarray, out_width: int, layout: _Layout,
              epilogue: Epilogue) -> bool:
    """The conv into ``y`` (N, M, Ho·Wo; Wo = ``out_width``) on `compiled.conv_blocks`: shared
    with the CPU backend's spinning helpers when they are free and the conv has
    `TEAM_MIN_MACS` multiply-adds (this thread and each helper take a part: images, else
    positions, else, on small maps, bands of output channels over columns built up front), else
    whole on this thread, one compiled call instead of a Python loop over its blocks. False,
    having done nothing, without a compiled sgemm, or when the conv is large enough for the
    pool's threads to split (`run_tasks`) and the team is busy."""
    if not blas_call.available():
        return False
    n, c = x.shape[:2]
    group, mg, k = weights.shape
    m, rows, span = group * mg, group * k, layout.span
    mode, operand, geometry, offsets = _operand(x, layout)
    team = parallel.team(CONV_PART) if layout.macs >= TEAM_MIN_MACS else None
    parts = 1 if team is None else team.helpers + 1
    if parts == 1 or n >= parts:  # (image range, position range, channel range) per part
        cuts = [n * i // parts for i in range(parts + 1)]
        ranges = [(cuts[i], cuts[i + 1], 0, span, 0, m) for i in range(parts)]
    elif span >= parts * MIN_WIDTH:
        cuts = vector_cuts(span, parts)
        ranges = [(0, n, cuts[i], cuts[i + 1], 0, m) for i in range(parts)]
    elif group == 1 and m >= parts * MIN_BAND_ROWS:
        if mode != DIRECT:  # every band reads all columns: build them once
            columns = _columns(x, layout)
            operand = np.empty((n, rows, span, 1), x.dtype)
            for i in range(n):
                columns(i, 0, span, operand[i].reshape(rows, span))
            mode = DIRECT
        cuts = [m * i // parts for i in range(parts + 1)]
        ranges = [(0, n, 0, span, cuts[i], cuts[i + 1]) for i in range(parts)]
    else:
        parts, ranges = 1, [(0, n, 0, span, 0, m)]
    longest = max(v1 - v0 for _, _, v0, v1, _, _ in ranges)
    width = _block_width(longest, rows, m, x.itemsize, 1)
    cols_size, block_size = (rows * width if mode != DIRECT else 1), m * width
    own = scratch((cols_size + block_size,), x.dtype, "conv_blocks")
    fn, ilp64, row_width = blas_call.SGEMM, blas_call.ILP64, layout.row_width

    def run(i0: int, i1: int, v0: int, v1: int, m0: int, m1: int) -> None:
        conv_blocks(operand, mode, geometry, offsets, weights, bias, y, own[:cols_size], own[cols_size:], i0, i1, v0,
                    v1, m0, m1, width, row_width, out_width, epilogue.kind, epilogue.a, epilogue.b, fn, ilp64)

    if parts > 1:
        helpers = team.scratch((parts - 1, cols_size + block_size), x.dtype)
        numbers = epilogue.numbers
        posted = [part_arguments(operand, mode, geometry, offsets, weights, bias, y, helpers[j, :cols_size],
                                 helpers[j, cols_size:], numbers, *ranges[j + 1], width, row_width, out_width,
                                 epilogue.kind, fn, ilp64) for j in range(parts - 1)]
        if team.try_run(posted, lambda: run(*ranges[0])):
            return True
    if layout.parallel and parallel.parts_available() > 1:
        return False  # (the team is busy: the pool's threads split it)
    for part in ranges:  # (alone, or the team busy: every part here)
        run(*part)
    return True


def _operand(x: np.ndarray, layout: _Layout) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """`conv_blocks`' mode, operand, geometry and tap offsets for ``x`` (C-contiguous) in ``layout``."""
    n, c = x.shape[:2]
    if layout.exact is not None:
        return EXACT, x, layout.exact_array, _NO_OFFSETS
    if layout.windows is not None:
        return FLAT, layout.windows.load(x).reshape(n, c, -1, 1), layout.exact_array, layout.offsets
    return DIRECT, x.reshape(n, c, layout.span, 1), layout.exact_array, _NO_OFFSETS


def small_conv(x_shape: tuple[int, ...], w: np.ndarray, bias: np.ndarray | None, group: int,
               strides: tuple[int, ...], dilations: tuple[int, ...], begin: tuple[int, ...], end: tuple[int, ...],
               out: tuple[int, ...], epilogue: Epilogue) -> Callable[[np.ndarray], np.ndarray] | None:
    """`conv2d` prepared once for a float32 conv that runs whole on its calling thread (under
    `TEAM_MIN_MACS` multiply-adds, too small for the pool, not a 1x1 GEMM): ``run(x)`` for inputs
    of ``x_shape`` is one `conv_blocks` call as `_compiled` makes it alone, so the same bits,
    without the 10-15 µs of Python around it (a streaming model's tiny convs: several a call).
    None for any other conv. ``w`` and ``bias`` are float32."""
    if not blas_call.available():
        return None
    layout = _layout(x_shape, w.shape, group, strides, dilations, begin, end, out, 4, _tuning())
    if layout.pointwise or layout.parallel or layout.macs >= TEAM_MIN_MACS:
        return None
    n, m, (ho, wo) = x_shape[0], w.shape[0], out
    weights = np.ascontiguousarray(w).reshape(group, m // group, -1)
    rows = group * weights.shape[2]
    bias = np.zeros(m, np.float32) if bias is None else np.ascontiguousarray(bias)
    width = _block_width(layout.span, rows, m, 4, 1)
    cols_size = rows * width if layout.exact is not None or layout.windows is not None else 1
    block_size = m * width
    fn, ilp64 = blas_call.SGEMM, blas_call.ILP64

    def run(x: np.ndarray) -> np.ndarray:
        mode, operand, geometry, offsets = _operand(np.ascontiguousarray(x), layout)
        y = np.empty((n, m, ho * wo), np.float32)
        own = scratch((cols_size + block_size,), np.float32, "conv_blocks")
        conv_blocks(operand, mode, geometry, offsets, weights, bias, y, own[:cols_size], own[cols_size:], 0, n, 0,
                    layout.span, 0, m, width, layout.row_width, wo, epilogue.kind, epilogue.a, epilogue.b, fn, ilp64)
        return y.reshape(n, m, ho, wo)
    return run


Columns = Callable[[int, int, int, np.ndarray], np.ndarray]


def _columns(x: np.ndarray, layout: _Layout) -> Columns:
    """How to build columns: ``columns(image, v0, v1, scratch) -> (rows, v1 - v0) array`` over
    positions ``v`` of the layout's grid: the output positions themselves (direct and exact), or
    flat windows' virtual ones, whose padding columns the epilogue drops."""
    if layout.exact is not None:
        geometry = layout.exact

        def exact(i: int, v0: int, v1: int, cols: np.ndarray) -> np.ndarray:
            im2col2d(x[i], cols, *geometry, v0, v1)
            return cols
        return exact
    if layout.windows is None:
        flat = x.reshape(x.shape[0], x.shape[1], -1)  # a 1x1 conv multiplies the input itself
        return lambda i, v0, v1, _: flat[i, :, v0:v1]
    buf = layout.windows.load(x).reshape(x.shape[0], x.shape[1], -1)
    offsets = layout.offsets

    def flat_columns(i: int, v0: int, v1: int, cols: np.ndarray) -> np.ndarray:
        im2col_flat(buf[i], offsets, cols, v0, v1)
        return cols
    return flat_columns


def _block_width(span: int, rows: int, m: int, itemsize: int, min_blocks: int) -> int:
    """Columns per block: as many as fit `BLOCK_BYTES` (columns and results), at least
    `MIN_WIDTH`, and, when the map is large enough, few enough to make ``min_blocks`` blocks so
    every thread gets work."""
    width = max(MIN_WIDTH, BLOCK_BYTES // (itemsize * (rows + m)) // 16 * 16)
    if min_blocks > 1 and span >= min_blocks * MIN_WIDTH:
        width = min(width, -(-span // min_blocks))
    return min(width, span)
