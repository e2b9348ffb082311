"""3x3 convolutions by Winograd's minimal filtering: F(4x4, 3x3) needs a quarter of the GEMM's
multiply-adds.

The transforms are in `asyncinfer.ops.compiled.winograd` (its docstring has the algorithm). Here:
which layers take it and with which tile (`winograd_tile`, and `winograd_runs_on` for the operands
of a run), the weights' transform (`transform_weights`, done once per constant weight by the
layer's `Op.derived`) and the convolution itself (`conv2d_winograd`): per part of the map, gather
the input rows into slabs, transform them into ``V`` (α², C, tiles), run the α² GEMMs
``U[ξ] @ V[ξ]`` (in BLAS, or on the panel GEMM: `PANEL_PRODUCTS`), transform the products back
into the output, then add the bias and the fused activation (the `Epilogue`) over the part's rows
while they are in cache.

Parts are bands of tile rows (per image), independent from gather to store: a layer split across
the pool's threads waits for them once. From `linalg.TEAM_MIN_MACS` on, the bands are first
offered to the CPU backend's spinning helpers (`_on_team`, `compiled.winograd_bands`: the same
steps as one compiled loop), which start in microseconds where a pool thread takes 100-300 µs.

Measured on one core of the 2-core VM (AMD EPYC, AVX-512) inside ResNet-50, against the tiled
GEMM conv (`conv_gemm`): 64ch@56x56 2.72 -> about 2.0 ms and 128ch@28x28 2.69 -> 1.75 ms with 4x4
tiles. The GEMMs have one column per tile, and BLAS slows down sharply below a few dozen (and
reads ``U``, (α/3)² times the weights, from memory each run): at 14x14, 4x4 tiles give 20 columns
and no gain (`MIN_TILES`): smaller maps take the direct panel kernel (`conv_direct`). F(2x2,
3x3)'s tiles (56 columns at 14x14, 16/9 times the weights to read) lost to that kernel inside
ResNet-50 and Inception-v2 (256 -> 256 at 14x14 about 1.37 -> 1.13 ms): it is gone. With 16
input channels the transforms cost more than the GEMM saves (SqueezeNet's 16->64 at 55x55:
0.79 -> 1.06 ms); with 32 they gained 10% on the GEMM conv, but the direct panel kernel is 10%
faster again (SqueezeNet's 32 -> 128 at 27x27, in a worker: one core 557 against 628 µs, two
cores 301 against 336; 32 -> 64 at 28x28 on two cores 176 against 199), and from 40 Winograd won
there (40 -> 160 at 28x28: 810 against 898 µs, 48 -> 192 at 27x27 1004 against 1170). On the
Zen 5 VM, whose AVX-512 FMAs are full width (two a cycle, where Zen 4 split each in halves), the
direct panel kernel doubled and Winograd's transforms did not: from 256 input channels
(`MIN_CHANNELS`) against 40, two workers in one process: ResNet-18 0.94x, DenseNet-121 0.93x,
Inception-v2 0.93x, ResNet-50 0.97x (its 64 -> 64 at 56x56: about 500 µs on two cores direct,
790-890 by Winograd). Whether Winograd pays depends on the CPU's FMA width against its memory
and shuffles: a choice made per machine would be the better one.
Results differ from the GEMM's by
rounding: relative error about 5e-6 of the layer's largest output with 4x4 tiles (the transforms
multiply by up to 8, and G's fractions are not exact in binary), against about 1e-6 for the GEMM.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..concurrency import parallel, spin_team
from ..concurrency.spin_team import SpinTeam
from .compiled import blas_call
from .compiled.winograd import gather_slabs, input_transform, non_finite_mark, output_transform
from .compiled.gemm import PANELS_OVER_BLAS, WIDTH
from .compiled.winograd_bands import PART_KIND as BANDS_PART
from .compiled.winograd_bands import finish_bands, panel_products, post_bands, scratch_size
from .conv_kernels import run_tasks, scratch
from .epilogue import Epilogue
from .linalg import SPLIT_MIN_MACS, TEAM_MIN_MACS

# Fewest virtual tiles per image (the GEMMs' columns; one spare tile a tile row) for a tile size.
MIN_TILES = 32
# Fewest input channels (the GEMMs' depth) and output channels.
MIN_CHANNELS = 256
MIN_OUT_CHANNELS = 16
# Fewest values of each GEMM's product (output channels x virtual tiles): below, the direct panel
# kernel is faster inside the models (DenseNet's twelve 128 -> 32 layers at 28x28, 56 tiles: 6.0
# -> 4.9-5.2 ms; its 128 -> 32 at 56x56, 210 tiles, and ResNet-50's 128 -> 128 at 28x28 keep
# Winograd, 3% and 10-20% faster on it).
MIN_PRODUCT = 4096
# A part's transformed input and GEMM products (α² x (C + M) x its tiles, float32) stay within
# this many bytes (its scratch, reused from layer to layer), unless that leaves fewer than
# MIN_PART_TILES tiles for its GEMMs.
PART_BYTES = 8 << 20
MIN_PART_TILES = 64
# The α² products on asyncinfer's panel GEMM (`compiled.gemm`, V's columns padded to whole panels)
# rather than BLAS, where it is the faster (`gemm.PANELS_OVER_BLAS`): on the 2-core Zen 5 VM, one
# core, all 36 products of a band: 64 -> 64 ch x 210 tiles 312 µs against 612 with OpenBLAS's
# Haswell kernels and 272 with its SkylakeX ones; 128 -> 128 x 56 tiles 315 / 635 / 320; 256 ->
# 256 x 20 tiles 640 / 1590 / 681. Its bits do not depend on a band's width.
PANEL_PRODUCTS = PANELS_OVER_BLAS


@dataclass(frozen=True)
class _Algorithm:
    tile: int                     # outputs per tile side (m of F(m x m, 3x3))
    g: np.ndarray                 # G, (m + 2) x 3, float64
    input_transform: Callable[..., None]
    output_transform: Callable[..., None]

    @property
    def window(self) -> int:     # α = m + 2: input rows and columns a tile reads
        return self.tile + 2


_ALGORITHMS = {
    4: _Algorithm(4, np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                               [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]]),
                  input_transform, output_transform),
}
NOT_FINITE = np.empty((0, 0, 0), np.float32)  # `transform_weights` of weights with a NaN or ∞


def _virtual_tiles(out: Sequence[int], tile: int) -> int:
    return -(-int(out[0]) // tile) * (-(-int(out[1]) // tile) + 1)


def winograd_tile(x_shape: Sequence[int], w_shape: Sequence[int], group: int, strides: Sequence[int],
                  dilations: Sequence[int], begin: Sequence[int], end: Sequence[int], out: Sequence[int],
                  dtype: np.dtype) -> int:
    """The tile (4) with which a 2-D conv runs by Winograd, or 0 for none: float32, one group, a
    3x3 kernel at unit stride and dilation with pads of at most 2, at least `MIN_CHANNELS` input
    and `MIN_OUT_CHANNELS` output channels, `MIN_TILES` tiles a map and `MIN_PRODUCT` values in
    each GEMM's product."""
    if dtype != np.float32 or group != 1 or len(w_shape) != 4 or tuple(w_shape[2:]) != (3, 3):
        return 0
    if tuple(strides) != (1, 1) or tuple(dilations) != (1, 1):
        return 0
    if min(*begin, *end) < 0 or max(*begin, *end) > 2:
        return 0
    if w_shape[0] < MIN_OUT_CHANNELS or x_shape[1] < MIN_CHANNELS:
        return 0
    tiles = _virtual_tiles(out, 4)
    return 4 if tiles >= MIN_TILES and tiles * w_shape[0] >= MIN_PRODUCT else 0


def transform_weights(w: np.ndarray, tile: int) -> np.ndarray:
    """``U`` (α², M, C) float32: ``G g Gᵀ`` of every (output, input) channel pair of ``w``
    (M, C, 3, 3) for ``tile``, computed in float64 and rounded once; `NOT_FINITE` if ``w`` holds
    a NaN or an infinity (the transform would spread it over the whole filter: such weights keep
    the GEMM)."""
    if not np.isfinite(w).all():
        return NOT_FINITE
    g = _ALGORITHMS[tile].g
    m, c = w.shape[:2]
    u = np.einsum("ai,mcij,bj->abmc", g, w.astype(np.float64), g, optimize=True)
    return np.ascontiguousarray(u.reshape(len(g) ** 2, m, c), dtype=np.float32)


def winograd_runs_on(x: np.ndarray, u: np.ndarray) -> bool:
    """Whether `conv2d_winograd` may run on ``x`` with ``u``: both finite. A NaN or an infinity
    would reach every output of the tiles that read it (and ∞ − ∞ makes NaN where the GEMM gives
    ∞), so such operands take the GEMM, which keeps ONNX's results for them (a pass over ``x``
    costs about 3% of the conv)."""
    return u is not NOT_FINITE and not np.isnan(non_finite_mark(x.reshape(-1)))


def conv2d_winograd(x: np.ndarray, u: np.ndarray, bias: np.ndarray | None, begin: Sequence[int],
                    out: Sequence[int], epilogue: Epilogue) -> np.ndarray:
    """``x`` (N, C, H, W) float32, C-contiguous, conv the 3x3 weights whose `transform_weights` is
    ``u`` (the tile is read from its shape), with pads ``begin`` (top, left) and output size
    ``out``, then ``bias`` and ``epilogue`` → (N, M, Ho, Wo). Operands for which
    `winograd_runs_on` holds."""
    algorithm = _ALGORITHMS[4 if u.shape[0] == 36 else 2]
    n, c = x.shape[:2]
    m = u.shape[1]
    ho, wo = (int(v) for v in out)
    top, left = (int(v) for v in begin)
    bias = np.zeros(m, np.float32) if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
    tile_rows, tw = -(-ho // algorithm.tile), -(-wo // algorithm.tile)
    y = np.empty((n, m, ho, wo), np.float32)
    macs = n * m * c * 9 * ho * wo
    threads = parallel.parts_available() if macs >= SPLIT_MIN_MACS else 1
    team = parallel.team(BANDS_PART) if macs >= TEAM_MIN_MACS and blas_call.available() else None
    # bands of tile rows: about one part per thread, each image cut into the same number of bands,
    # and more where a part's V and products would outgrow PART_BYTES (a VGG-sized map)
    row_tiles = tw + 1
    window = algorithm.window
    tiles_per_part = max(MIN_PART_TILES, PART_BYTES // (window * window * (c + m) * 4))
    sharers = threads if team is None else team.helpers + 1
    bands = max(1, min(tile_rows, max(-(-sharers // n), -(-tile_rows * row_tiles // tiles_per_part))))
    edges = [round(tile_rows * i / bands) for i in range(bands + 1)]
    if team is not None and _on_team(team, algorithm, x, u, bias, y, top, left, tw, edges, epilogue):
        return y
    parts = [functools.partial(_part, algorithm, x[i], u, bias, y[i], top, left, tw, edges[j], edges[j + 1],
                               epilogue)
             for i in range(n) for j in range(bands) if edges[j + 1] > edges[j]]
    run_tasks(parts, threads)
    return y


def _on_team(team: SpinTeam, algorithm: _Algorithm, x: np.ndarray, u: np.ndarray, bias: np.ndarray, y: np.ndarray,
             top: int, left: int, tw: int, edges: list[int], epilogue: Epilogue) -> bool:
    """The bands (each image cut at tile rows ``edges``) on `compiled.winograd_bands`, shared
    between this thread and the team's helpers, about the same number of tiles each, posted, run
    and waited for in compiled code; False, having done nothing, when there are fewer bands than
    sharers or the team is busy."""
    parts = team.helpers + 1
    bands, cuts, rows = _shared_bands(x.shape[0], tuple(edges), parts)
    if len(bands) < parts:
        return False
    control = team.claim()
    if control is None:
        return False
    try:
        size = scratch_size(algorithm.window, x.shape[1], u.shape[1], rows * (tw + 1), tw)
        own = scratch((size,), np.float32, "winograd_team")
        helpers = team.scratch((parts - 1, size), np.float32)
        fn, ilp64, panels = blas_call.SGEMM, blas_call.ILP64, PANEL_PRODUCTS
        if post_bands(control, x, u, bias, y, bands, cuts, top, left, tw, helpers, epilogue.kind, epilogue.numbers,
                      fn, ilp64, panels):
            team.wake()
        if not finish_bands(control, x, u, bias, y, bands, cuts, top, left, tw, own, epilogue.kind, epilogue.a,
                            epilogue.b, fn, ilp64, panels, spin_team.WAIT_ROUNDS):
            team.wait_posted(parts - 1)
    finally:
        team.release()
    return True


@functools.lru_cache(maxsize=256)
def _shared_bands(images: int, edges: tuple[int, ...], parts: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The bands of `_on_team` (rows: image, first and end tile row; int64), the cuts giving
    ``parts`` sharers about as many bands each, and the tallest band's tile rows: worked out once
    per geometry (a layer sees the same one run after run)."""
    bands = np.array([(i, edges[j], edges[j + 1]) for i in range(images) for j in range(len(edges) - 1)
                      if edges[j + 1] > edges[j]], np.int64).reshape(-1, 3)
    cuts = np.array([len(bands) * i // parts for i in range(parts + 1)], np.int64)
    rows = int((bands[:, 2] - bands[:, 1]).max()) if len(bands) else 0
    return bands, cuts, rows


def _part(algorithm: _Algorithm, x: np.ndarray, u: np.ndarray, bias: np.ndarray, y: np.ndarray, top: int,
          left: int, tw: int, ti0: int, ti1: int, epilogue: Epilogue) -> None:
    """Tile rows ``[ti0, ti1)`` of one image: ``x`` (C, H, W) → ``y`` (M, Ho, Wo)."""
    c = x.shape[0]
    m = u.shape[1]
    step, window = algorithm.tile, algorithm.window
    tiles = (ti1 - ti0) * (tw + 1)
    slabs = scratch((c, window, step * tiles + 8), np.float32, "winograd_slabs")
    gather_slabs(x, slabs, step, top, left, step * (tw + 1), ti0, ti1 - ti0)
    v = scratch((window * window, c, tiles), np.float32, "winograd_v")
    algorithm.input_transform(slabs, v, scratch((window, window, tiles), np.float32, "winograd_e"))
    products = scratch((window * window, m, tiles), np.float32, "winograd_m")
    if PANEL_PRODUCTS:
        panel_products(u, v, products, scratch((c, WIDTH), np.float32, "winograd_tail_b"),
                       scratch((m, WIDTH), np.float32, "winograd_tail_y"))
    else:
        np.matmul(u, v, out=products)
    oh0, oh1 = step * ti0, min(y.shape[1], step * ti1)
    algorithm.output_transform(products, y, tw, oh0, scratch((step, window, tw), np.float32, "winograd_t"))
    epilogue.apply(y[:, oh0:oh1].reshape(m, -1), bias)
