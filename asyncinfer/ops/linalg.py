"""Linear algebra ops: MatMul, Gemm and Einsum (all land in BLAS, which releases the GIL)."""
from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from ..concurrency import parallel, spin_team
from .base import Op
from .compiled import blas_call, gemm
from .compiled.few_rows import PART_KIND as FEW_ROWS_PART
from .compiled.few_rows import K_UNROLL, add_parts, few_rows_matmul, finish_parts, post_parts
from .compiled.panels import no_panels, pack_panels
from .elementwise import compute_dtype
from .registry import register


# Below this many multiply-adds a GEMM runs whole. Waking a pool thread costs 50-300 µs on a small
# VM, and models with parallel branches already fill the pool: measured on an idle 2-core machine
# (bench/latency.py), splitting from 4M MACs made squeezenet 15.5 ms and inception_v2 49 ms,
# from 30M 13.4 and 43.7 ms (resnet50 72 ms either way; 83 ms with no splitting at all).
SPLIT_MIN_MACS = 30_000_000
# From this many multiply-adds on (about 20 µs on one core), a float32 GEMM (and a tiled conv) is
# shared with the CPU backend's spinning helpers when they are free (`_on_team`): they start a
# part in microseconds, not the pool thread's 50-300 µs.
TEAM_MIN_MACS = 1_000_000
# A GEMM of a few rows (a decode step's 8 × 768 @ 768 × 2304) is bound by reading B, not by its
# multiply-adds. From this size of B on it runs in `compiled.few_rows` (B read once, where BLAS
# packs it first from two rows on: 3x the time of one row), and from SPLIT_MIN_B_BYTES on it is
# split along K across the spin team's helpers (or the pool). Neither choice depends on the number
# of rows, so a stream's results do not depend on who shares its decode step.
FEW_ROWS = 16
FEW_ROWS_MIN_B_BYTES = 256 << 10
# ... and only when K is at least this many times the rows: B then outweighs the result. A
# convolution's few output channels by a shallow im2col matrix (16 x 27 @ 27 x 50176) keep BLAS,
# which ran it 3.5x faster. A decoder's K (its hidden size, 256 and more) passes for 16 rows.
FEW_ROWS_MIN_DEPTH = 16
# One core reads B at ~29 GB/s out of L3 (2-vCPU Xeon, AVX-512), so from 1 MiB on each of two
# parts is 15 µs or more, which the spin team's helpers start in microseconds. (2 MiB was chosen
# when parts went to pool threads, 50-300 µs to wake.) One row, 2 threads, the whole Gemm run:
# 512 x 1000 hot 92 -> 42-46 µs, after 16 MB of other memory 156 -> 127; 1 MiB of B 117-125 ->
# 106-113 after the 16 MB (docs/benchmarks.md, forty-seventh session).
SPLIT_MIN_B_BYTES = 1 << 20
# Columns of y a few-row GEMM adds into per pass over B: 8192 for one row (768 x 50257 logits),
# 4096 from two rows on (measured 5-15% faster than 1024 for 8 and 16 rows: each row of B is
# then read in longer contiguous runs, and 16 rows of 4096 floats still sit in L2).
FEW_ROWS_TILE_ONE, FEW_ROWS_TILE_MANY = 8192, 4096
# Narrowest column band worth a part of its own (BLAS kernels work on column panels this wide).
COLUMN_BAND_MIN = 64
# A float32 product whose b's columns are whole panels runs on `compiled.gemm` (a's rows and b's
# columns read in place) while a is at most this large: each panel of b reads all of a again,
# from L2. On 2 cores with the team, against BLAS's bands: 128 x 128 @ 128 x 512 83 µs against
# 135, 128 x 512 @ 512 x 128 83 against 102, ConvNeXt's 784 x 768 @ 768 x 192 (a 2.4 MB) 1018
# against 1152, but 3136 x 384 @ 384 x 96 (a 4.8 MB) 1443 against 1251. Larger ones keep BLAS, and
# so do depths over `PANEL_GEMM_MAX_DEPTH`: a block sums over all of K, its panel's strip of b
# (K x 128 bytes) read again for every block of rows (Llama's 128 x 2816 @ 2816 x 1024: 6.7
# against 5.4 ms; its 128 x 1024 @ 1024 x 2816 4.4 against 5.2).
PANEL_GEMM_MAX_A_BYTES = 5 << 19
PANEL_GEMM_MAX_DEPTH = 2048
# With b packed (a model's constant weight, `constant_panels`), each strip is read as one stream
# and a large a goes in bands that stay in L2 (`gemm.A_BAND_BYTES`): one core made 118-132 G
# multiply-adds/s on every product measured, where BLAS's Haswell kernels made 115-127 on two
# (Llama's 128 x 2816 @ 2816 x 1024 3.1 ms, ConvNeXt's 49 x 3072 @ 3072 x 768 1.08, its 3136 x 384
# @ 384 x 96, a 4.8 MB, 0.91 against BLAS's 0.95 on two cores); such products have no bound on a.
PANEL_GEMM_MAX_PACKED_DEPTH = 4096


def matmul(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None = None,
           panels: np.ndarray | None = None) -> np.ndarray:
    """``np.matmul(a, b)``, split across the pool's idle threads when it is large (BLAS runs one
    thread per call inside asyncinfer: see ``concurrency/parallel.py``), or from
    `TEAM_MIN_MACS` on (float32, one product) across the spin team's helpers. Each part writes a
    contiguous block of the result (a batch entry, or a band of rows), so BLAS runs on every part.
    ``bias``: a row of the result's width and dtype, added to the product (``y += bias``).
    ``panels``: ``b`` packed by `compiled.panels.pack_panels` (see `constant_panels`)."""
    if a.ndim > 2 and b.ndim == 2 and a.dtype == b.dtype and a.shape[-1] == b.shape[0]:
        # (..., M, K) @ (K, N) is one (…·M, K) @ (K, N) GEMM; NumPy would loop over small ones
        return matmul(a.reshape(-1, a.shape[-1]), b, bias, panels).reshape(*a.shape[:-1], b.shape[-1])
    if _takes_few_rows(a, b):
        return _few_rows(a, b, None if bias is None else np.ascontiguousarray(bias, a.dtype),
                         no_panels(a.dtype) if panels is None else panels)
    if a.ndim == 2 and b.ndim == 2 and a.shape[0] == 1 and b.T.flags.c_contiguous and not b.flags.c_contiguous:
        # One row by a transposed matrix (a Linear layer's weight (N, K) as Gemm's transB=1 gives
        # it), whose rows are not contiguous for the spin team's bands: taken the other way round,
        # weight @ row (N x K @ K x 1), the weight's rows read in place. MobileNetV3's classifier
        # products on 2 cores: 111/127 -> 87/105 µs.
        return _plus(matmul(b.T, np.ascontiguousarray(a).reshape(-1, 1)).reshape(1, -1), bias)
    if _takes_panel_gemm(a, b, bias, panels):
        return _panel_gemm(a[None], b[None], bias, panels)[0]
    if bias is None and (batch := _panel_batch(a, b)) is not None:
        return _panel_gemm(*batch, None).reshape(*a.shape[:-1], b.shape[-1])
    parts = parallel.parts_available()
    if parts < 2 or a.ndim < 2 or b.ndim < 2 or a.dtype != b.dtype or a.dtype.kind not in "fc":
        return _plus(np.matmul(a, b), bias)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    count = math.prod(batch)
    if b.shape[-2] != k:
        return _plus(np.matmul(a, b), bias)
    macs = count * m * k * n
    if macs < min(TEAM_MIN_MACS, SPLIT_MIN_MACS):
        return _plus(np.matmul(a, b), bias)
    y = np.empty((*batch, m, n), dtype=a.dtype)
    if (macs >= TEAM_MIN_MACS and count == 1 and a.dtype == np.float32
            and _on_team(a.reshape(m, k), b.reshape(k, n), y.reshape(m, n), bias)):
        return y
    if macs < SPLIT_MIN_MACS:
        return _plus(np.matmul(a, b), bias)
    if count >= parts:  # whole batch entries per part
        a3 = np.broadcast_to(a, (*batch, m, k)).reshape(count, m, k)
        b3 = np.broadcast_to(b, (*batch, k, n)).reshape(count, k, n)
        y3 = y.reshape(count, m, n)
        bounds = np.linspace(0, count, parts + 1).astype(int)
        parallel.run_parts(parts, lambda i: np.matmul(a3[bounds[i]:bounds[i + 1]], b3[bounds[i]:bounds[i + 1]],
                                                      out=y3[bounds[i]:bounds[i + 1]]))
        return _plus(y, bias)
    # one batch entry (or a few): bands of rows or of columns, whichever keeps each part's
    # private operand the smaller one. BLAS packs the whole other operand in every part: with rows
    # split, each part packs all of B; a conv's B (im2col, K x positions) is far larger than its
    # weights, and splitting its columns instead measured 1.2-1.7x faster on ResNet's layers.
    a3 = np.broadcast_to(a, (*batch, m, k)).reshape(count, m, k)
    b3 = np.broadcast_to(b, (*batch, k, n)).reshape(count, k, n)
    y3 = y.reshape(count, m, n)
    by_rows = m >= parts and (m >= n or n < parts * COLUMN_BAND_MIN)
    bounds = np.linspace(0, m if by_rows else n, parts + 1).astype(int)

    def band(i: int) -> None:
        lo, hi = bounds[i], bounds[i + 1]
        for j in range(count):
            if by_rows:
                np.matmul(a3[j, lo:hi], b3[j], out=y3[j, lo:hi])
            else:
                np.matmul(a3[j], b3[j, :, lo:hi], out=y3[j, :, lo:hi])

    parallel.run_parts(parts, band)
    return _plus(y, bias)


def _plus(y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``y += bias`` (a row of y's width) where there is one; ``y``. Float32 rows take the
    compiled loop (the same additions, so the same bits)."""
    if bias is None:
        return y
    if (y.dtype == bias.dtype == np.float32 and y.ndim == 2 and bias.shape == (y.shape[1],)
            and y.flags.c_contiguous and bias.flags.c_contiguous):
        blas_call.add_bias(y, bias)
    else:
        y += bias
    return y


def _on_team(a: np.ndarray, b: np.ndarray, y: np.ndarray, bias: np.ndarray | None = None) -> bool:
    """``y = a @ b`` (2-D float32), then ``y += bias`` if given, in bands, this thread and the CPU
    backend's spinning helpers taking one each (rows or columns as `matmul` splits them; each
    adds the bias to its band while it is in cache); False, having done nothing, when there is
    no free team or no compiled sgemm (`compiled.blas_call`)."""
    team = parallel.team(blas_call.PART_KIND)
    if team is None or not blas_call.available() or not (blas_rows(a) and blas_rows(b)):
        return False
    m, k = a.shape
    n = b.shape[1]
    parts = team.helpers + 1
    by_rows = m >= parts and (m >= n or n < parts * COLUMN_BAND_MIN)
    if not by_rows and n < parts * 16:
        return False
    if bias is not None:
        bias = np.ascontiguousarray(bias, np.float32).reshape(n)
    cuts = [m * i // parts for i in range(parts + 1)] if by_rows else vector_cuts(n, parts)
    a_at, b_at, y_at, bias_at = spin_team.addresses(a, b, y, bias)[:4]
    lda, ldb, ldy = a.strides[0] // 4, b.strides[0] // 4, y.strides[0] // 4
    if by_rows:  # band i: rows lo:hi of a and y
        posted = [blas_call.gemm_arguments(hi - lo, n, k, a_at + lo * a.strides[0], lda, b_at, ldb,
                                           y_at + lo * y.strides[0], ldy, bias_at) for lo, hi in zip(cuts[1:], cuts[2:])]
        own = (a[:cuts[1]], b, y[:cuts[1]], bias)
    else:  # columns lo:hi of b, y and the bias
        posted = [blas_call.gemm_arguments(m, hi - lo, k, a_at, lda, b_at + lo * 4, ldb, y_at + lo * 4, ldy,
                                           bias_at and bias_at + lo * 4) for lo, hi in zip(cuts[1:], cuts[2:])]
        own = (a, b[:, :cuts[1]], y[:, :cuts[1]], None if bias is None else bias[:cuts[1]])
    if bias is None:
        return team.try_run(posted, lambda: blas_call.gemm(*own[:3], blas_call.SGEMM, blas_call.ILP64))
    return team.try_run(posted, lambda: blas_call.gemm_bias(*own, blas_call.SGEMM, blas_call.ILP64))


def _takes_panel_gemm(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None,
                      packed: np.ndarray | None = None) -> bool:
    """Whether `matmul` runs ``a @ b (+ bias)`` on `compiled.gemm`: 2-D float32, b's columns whole
    panels, a's rows contiguous and apart (not a broadcast row); b ``packed`` (`constant_panels`)
    and K at most `PANEL_GEMM_MAX_PACKED_DEPTH`, or b's rows contiguous, K at most
    `PANEL_GEMM_MAX_DEPTH` and a at most `PANEL_GEMM_MAX_A_BYTES`."""
    if not (a.ndim == 2 and b.ndim == 2 and a.dtype == b.dtype == np.float32 and a.shape[1] == b.shape[0]
            and blas_rows(a) and (bias is None or (bias.dtype == np.float32 and bias.size == b.shape[1]))):
        return False
    if _packed_fits(packed, *b.shape):
        return a.shape[0] > 0 and 0 < a.shape[1] <= PANEL_GEMM_MAX_PACKED_DEPTH
    return (blas_rows(b) and _panel_shapes(*a.shape, b.shape[1])
            and a.shape[0] * a.strides[0] <= PANEL_GEMM_MAX_A_BYTES)


def _panel_shapes(m: int, k: int, n: int) -> bool:
    """Whether an (M, K) @ (K, N) product's sizes suit `compiled.gemm` with b read in place (see
    `_takes_panel_gemm`)."""
    return (m > 0 and 0 < k <= PANEL_GEMM_MAX_DEPTH and n > 0 and n % gemm.WIDTH == 0
            and m * k * 4 <= PANEL_GEMM_MAX_A_BYTES)


def _packed_fits(packed: np.ndarray | None, k: int, n: int) -> bool:
    """Whether ``packed`` holds the whole panels of a (K, N) float32 b (`pack_panels`), all of them."""
    return (packed is not None and packed.dtype == np.float32 and n % gemm.WIDTH == 0
            and packed.shape == (n // gemm.WIDTH, k, gemm.WIDTH))


def _panel_batch(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """A batch of products (..., M, K) @ (..., K, N) of the same leading shape that
    `compiled.gemm` takes entry by entry (attention's heads), as (E, M, K) and (E, K, N) with
    contiguous rows (a copy of an operand whose rows are not: the keys transposed); else None."""
    if (a.ndim < 3 or b.ndim != a.ndim or a.shape[:-2] != b.shape[:-2] or a.dtype != np.float32
            or b.dtype != np.float32 or a.shape[-1] != b.shape[-2] or not _panel_shapes(*a.shape[-2:], b.shape[-1])):
        return None
    count = math.prod(a.shape[:-2])
    a3, b3 = a.reshape(count, *a.shape[-2:]), b.reshape(count, *b.shape[-2:])
    return (a3 if blas_rows(a3[0]) else np.ascontiguousarray(a3),
            b3 if blas_rows(b3[0]) else np.ascontiguousarray(b3))


def _panel_gemm(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None,
                packed: np.ndarray | None = None) -> np.ndarray:
    """``a @ b (+ bias)`` for a batch, (E, M, K) @ (E, K, N), on `compiled.gemm`; shared with the
    spin team's free helpers from `TEAM_MIN_MACS` on: whole entries each where there are enough,
    else ranges of panels. ``packed``: the one b's panels (`constant_panels`), else read in place."""
    count, m, k = a.shape
    n = b.shape[2]
    packed = packed if count == 1 and _packed_fits(packed, k, n) else gemm.NO_PACKED
    y = np.empty((count, m, n), np.float32)
    biased = bias is not None
    row = np.ascontiguousarray(bias, np.float32).reshape(n) if biased else y[0, 0]  # (unread without a bias)
    panels = n // gemm.WIDTH
    team = parallel.team(gemm.PART_KIND) if count * m * k * n >= TEAM_MIN_MACS else None
    parts = None if team is None else _gemm_parts(count, panels, team.helpers + 1)
    control = None if parts is None or len(parts) < 2 else team.claim()  # type: ignore[union-attr]
    if control is None:  # alone, too small to share, or the team busy (every core is)
        gemm.panel_gemm_batch(a, b, packed, y, row, 0, count, 0, panels, biased)
        return y
    try:  # posted, run and waited for in compiled code
        if gemm.post_gemm(control, a, b, packed, y, row, parts, biased):
            team.wake()  # type: ignore[union-attr]
        if not gemm.finish_gemm(control, a, b, packed, y, row, parts, biased, spin_team.WAIT_ROUNDS):
            team.wait_posted(len(parts) - 1)  # type: ignore[union-attr, arg-type]
    finally:
        team.release()  # type: ignore[union-attr]
    return y


@functools.lru_cache(maxsize=256)
def _gemm_parts(count: int, panels: int, threads: int) -> np.ndarray:
    """`_panel_gemm`'s parts for ``threads`` sharers, rows ``(e0, e1, p0, p1)``: whole entries
    each where there are enough, else ranges of panels (one row: nothing to share). Kept per
    shape and shared: never written."""
    if count >= threads:
        cuts = [count * i // threads for i in range(threads + 1)]
        rows = [(lo, hi, 0, panels) for lo, hi in zip(cuts, cuts[1:])]
    else:
        threads = min(threads, panels)
        cuts = [panels * i // threads for i in range(threads + 1)]
        rows = [(0, count, lo, hi) for lo, hi in zip(cuts, cuts[1:])]
    return np.array(rows, np.int64).reshape(-1, 4)


def vector_cuts(n: int, parts: int) -> list[int]:
    """Bounds of ``parts`` bands of ``n`` columns, each but the last starting on a whole vector
    of 16 float32 values (a band's stores then stay aligned with the others')."""
    return [min(n, -(-n * i // parts) // 16 * 16) for i in range(parts)] + [n]


def blas_rows(x: np.ndarray) -> bool:
    """Whether BLAS reads the 2-D float32 ``x`` in place: contiguous rows, a row stride of at least a row."""
    return x.strides[1] == 4 and x.strides[0] % 4 == 0 and x.strides[0] >= 4 * x.shape[1]


def _takes_few_rows(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `matmul` runs ``a @ b`` (2-D) in `compiled.few_rows`."""
    return (a.ndim == 2 and b.ndim == 2 and a.shape[0] <= FEW_ROWS and a.dtype == b.dtype
            and a.dtype in (np.float32, np.float64) and a.shape[1] == b.shape[0]
            and b.nbytes >= FEW_ROWS_MIN_B_BYTES and a.shape[1] >= FEW_ROWS_MIN_DEPTH * a.shape[0]
            and b.flags.c_contiguous)


class _Packing(threading.local):
    allowed = False


_packing = _Packing()


@contextmanager
def packing_weights() -> Iterator[None]:
    """Inside, on this thread, few-row GEMMs of two rows or more pack their constant weights in
    column panels (`constant_panels`): the generation engine's batched decode steps, which then
    run at the speed of reading the weights. Elsewhere panels are used where they exist but never
    made, so a model run otherwise (one stream's prompts and steps, a batch of requests) keeps a
    single copy of its weights."""
    before, _packing.allowed = _packing.allowed, True
    try:
        yield
    finally:
        _packing.allowed = before


def constant_panels(op: Op, a: np.ndarray, b: np.ndarray, index: int, given: np.ndarray | None = None
                    ) -> np.ndarray | None:
    """``b`` packed in column panels for `matmul` (`compiled.panels.pack_panels`), kept by ``op``,
    when ``b`` is the model's constant at input ``index`` (``given``: that input as the op got it,
    where ``b`` is made from it: transposed, widened) and ``a @ b`` runs

    - the few-row kernel on two rows or more: packed only inside `packing_weights` (elsewhere
      used where it exists but never made, so a model run otherwise, one stream's prompts and
      steps, a batch of requests, keeps a single copy of its weights);
    - the panel GEMM (`compiled.gemm`): packed at its first run. Read in place, b's panels take
      128 bytes a row of b for each step of depth, a row apart: a wide b's rows (Llama's 2816
      columns, 11 KiB) fall into a few cache sets, and one core made 58-97 G multiply-adds/s on
      its products against 118-129 packed (128 x 1024 @ 1024 x 2816: 5.3 -> 2.9 ms);

    else None. Never with ``ASYNCINFER_PACKED_WEIGHTS=0`` (memory before speed: the same bits,
    the kernels reading b in place). The packed copy stands in for the model's own: where that
    is mapped from the model's file, its pages go back to the page cache (`Op.derived_constant`),
    as ONNX Runtime frees a prepacked initializer."""
    if b.ndim != 2 or a.ndim == 0 or a.shape[-1] != b.shape[0]:
        return None
    rows = math.prod(a.shape[:-1])
    if 2 <= rows <= FEW_ROWS:
        if not _takes_few_rows(a.reshape(rows, a.shape[-1]), b):
            return None  # (most products, one row or many, leave before the reshape: every GEMM asks)
        create = _packing.allowed
    elif (rows > FEW_ROWS and a.dtype == b.dtype == np.float32 and 0 < b.shape[0] <= PANEL_GEMM_MAX_PACKED_DEPTH
          and b.shape[1] > 0 and b.shape[1] % gemm.WIDTH == 0):
        create = True
    else:
        return None
    source = b if given is None else given
    form = op.derived_constant("panels", index, source, lambda: pack_panels(b), create=False)
    # (the setting read only before a form is made: once per weight, not for every product, where
    # reading the environment took about a microsecond of a 128 x 128 @ 128 x 128's 38 µs layer)
    if form is not None or not create or os.environ.get("ASYNCINFER_PACKED_WEIGHTS", "").strip() == "0":
        return form
    return op.derived_constant("panels", index, source, lambda: pack_panels(b))


def _few_rows(a: np.ndarray, b: np.ndarray, bias: np.ndarray | None, panels: np.ndarray) -> np.ndarray:
    """``a @ b (+ bias)`` for a few-row ``a`` and a large C-ordered ``b`` (`compiled.few_rows`);
    split along K across the pool's idle threads when ``b`` is large enough to pay for waking
    them (measured faster than bands of columns: a part's rows of b are one contiguous block).
    ``bias``: a row of the result's width, of its dtype, added last. ``panels``: b packed (or
    `compiled.panels.no_panels`)."""
    m, k = a.shape
    n = b.shape[1]
    a = np.ascontiguousarray(a)
    y = np.empty((m, n), dtype=a.dtype)
    tile = FEW_ROWS_TILE_ONE if m == 1 else FEW_ROWS_TILE_MANY
    parts = parallel.parts_available()
    if parts < 2 or b.nbytes < SPLIT_MIN_B_BYTES or k < parts * K_UNROLL:
        few_rows_matmul(a, b, y, 0, k, tile, panels)
        if bias is not None:
            y += bias
        return y
    # blocks of K_UNROLL rows; the parts' sums are added in order, so the result does not depend
    # on which thread ran which part (nor, for a row, on the other rows)
    bounds = _k_bounds(k, parts)
    bias = _NO_BIAS if bias is None else bias  # (the compiled kernels take an empty row for none)
    team = parallel.team(FEW_ROWS_PART)
    control = None if team is None else team.claim()
    if control is not None:  # the helpers spin: post, run part 0 and wait in compiled code
        try:
            scratch = team.scratch((parts - 1, m, n), a.dtype)  # type: ignore[union-attr]
            if post_parts(control, a, b, scratch, bounds, tile, panels):
                team.wake()  # type: ignore[union-attr]
            if not finish_parts(control, a, b, y, scratch, bias, bounds, tile, panels, spin_team.WAIT_ROUNDS):
                team.wait_posted(parts - 1)  # type: ignore[union-attr]
                add_parts(y, scratch, parts - 1, bias)
        finally:
            team.release()  # type: ignore[union-attr]
        return y
    partial = np.empty((parts - 1, m, n), a.dtype)
    if team is None:
        parallel.run_parts(parts, lambda i: few_rows_matmul(a, b, partial[i - 1] if i else y, bounds[i],
                                                            bounds[i + 1], tile, panels))
    else:  # another lane has the team, so every core is busy already: the same parts, in turn here
        for i in range(parts):
            few_rows_matmul(a, b, partial[i - 1] if i else y, bounds[i], bounds[i + 1], tile, panels)
    add_parts(y, partial, parts - 1, bias)
    return y


_NO_BIAS = np.empty(0, np.float32)


@functools.lru_cache(maxsize=256)
def _k_bounds(k: int, parts: int) -> np.ndarray:
    """Where a K of ``k`` rows splits into ``parts`` blocks of whole K_UNROLL rows (kept per
    size, shared: never written)."""
    return np.array([round(k * i / parts / K_UNROLL) * K_UNROLL for i in range(parts)] + [k], np.int64)


@register("MatMul", versions=(1, 9, 13))
class MatMul(Op):
    multithreaded = True  # a GEMM: split across the pool when large

    def run(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        work, out = gemm_dtypes(a, b)
        if work == a.dtype == b.dtype:
            return matmul(a, b, panels=constant_panels(self, a, b, 1))
        return matmul(a.astype(work, copy=False), b.astype(work, copy=False)).astype(out, copy=False)


class LastRowMatMul(MatMul):
    """``MatMul(A, B)`` of A's last row along its second-to-last axis only (``A[..., -1:, :] @ B``),
    for a caller that reads nothing else: the generation engine's logits (a prompt of 16 tokens
    would otherwise multiply all 16 rows by the whole vocabulary). Never made by a model file."""

    def run(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return super().run(a[..., -1:, :] if a.ndim >= 2 else a, b)


def gemm_dtypes(*operands: np.ndarray | None) -> tuple[np.dtype, np.dtype]:
    """``(dtype to multiply in, dtype of the result)`` of a GEMM-like op (MatMul, Gemm, Conv…).

    Narrow floats (float16, bfloat16, float8) are multiplied in float32, which BLAS runs and which
    accumulates exactly as ORT does, and the result is rounded back to the model's type. Constant
    weights of such ops may already be float32 (widened once at load, see
    ``loader.optimize.widen_narrow_weights``): the result then takes the narrow operand's type.
    """
    dtypes = {a.dtype for a in operands if a is not None}
    out = next(iter(dtypes)) if len(dtypes) == 1 else min(dtypes, key=lambda d: d.itemsize)
    return compute_dtype(out), out


@register("Gemm", versions=(1, 6, 7, 9, 11, 13))
class Gemm(Op):
    """``alpha * A' @ B' + beta * C`` with optional transposes and a broadcast (optional) C."""
    multithreaded = True  # a GEMM: split across the pool when large

    def check(self) -> None:
        self.trans_a, self.trans_b = bool(int(self.attr("transA"))), bool(int(self.attr("transB")))
        self.alpha, self.beta = float(self.attr("alpha")), float(self.attr("beta"))

    def run(self, a: np.ndarray, b: np.ndarray, c: np.ndarray | None = None) -> np.ndarray:
        given = b
        if self.trans_a:
            a = a.T
        if self.trans_b:
            b = b.T
        alpha, beta = self.alpha, self.beta
        work, out_dtype = gemm_dtypes(a, b, c)
        a, b = a.astype(work, copy=False), b.astype(work, copy=False)
        panels = constant_panels(self, a, b, 1, given)
        if (alpha == 1.0 and beta == 1.0 and c is not None and c.dtype == work and a.ndim == 2
                and c.shape[-1:] == b.shape[-1:] and c.size == b.shape[-1]):
            # the usual bias row: added by the GEMM kernel as it ends (the few-row one, in its pass)
            return matmul(a, b, c.reshape(-1), panels).astype(out_dtype, copy=False)
        y = matmul(a, b, panels=panels)
        dt = y.dtype.type
        if alpha != 1.0:
            y *= dt(alpha)
        if c is not None and beta != 0.0:
            c = c.astype(work, copy=False)
            if beta == 1.0:
                y += c
            else:
                y += dt(beta) * c
        return y.astype(out_dtype, copy=False)


@register("Einsum", versions=(12, 28))
class Einsum(Op):
    """``np.einsum`` with path optimisation; the implicit form is made explicit with ONNX's ordering."""
    multithreaded = True  # GEMM in BLAS: already uses every core

    def check(self) -> None:
        eq = str(self.attr("equation")).replace(" ", "")
        lhs = eq.split("->")[0]
        if eq.count("->") > 1 or not all(ch.isalpha() or ch in ",." for ch in lhs.replace("...", "")):
            self.unsupported(f"equation {eq!r}")
        self.equation = _explicit(eq)

    def run(self, *inputs: np.ndarray) -> np.ndarray:
        dtype = np.result_type(*inputs)
        if dtype.kind == "V" or dtype.name == "bfloat16":  # NumPy cannot einsum ml_dtypes types
            out = np.einsum(self.equation, *[x.astype(np.float32) for x in inputs], optimize=True)
            return np.asarray(out).astype(dtype)
        return np.asarray(np.einsum(self.equation, *inputs, optimize=True)).astype(dtype, copy=False)


def _explicit(eq: str) -> str:
    """``eq`` with an explicit output: letters used exactly once, sorted by ASCII, after any ellipsis."""
    if "->" in eq:
        return eq
    letters = eq.replace("...", "").replace(",", "")
    once = sorted(ch for ch in set(letters) if letters.count(ch) == 1)
    return eq + "->" + ("..." if "..." in eq else "") + "".join(once)
