"""Depthwise convolution (``group == C``) for `asyncinfer.ops.conv`: dispatch and threading.

A depthwise conv does a handful of multiply-adds per output and mixes no channels, so it is no
GEMM: lowered to per-channel im2col + GEMV it streams ``taps`` copies of the input through memory,
and as whole-array NumPy passes it streams the map once per tap. 2-D ones run on the compiled
loops of `asyncinfer.ops.compiled.depthwise`, which read the input once and keep each output row
(or pixel) in L1 while every tap adds into it; this module picks one of its loops (`flat_pays`,
`stride2_rows_pay`, `channels_last_pays`) and shares large layers out between the pool's threads.

Measured with bench/conv_shapes.py (kernel alone, one thread, against the NumPy channels-last
einsum it replaced): about 2-5x faster on the MobileNetV3 / EfficientNet / ConvNeXt depthwise
layers. Large kernels (batches, big maps) share their images or channel blocks out between
threads (`run_tasks`, from `PARALLEL_MIN_MACS` multiply-adds on); the compiled loops release the
GIL. From `TEAM_MIN_MACS` on, a float32 layer is first offered to the CPU backend's spinning
helpers (`_on_team`, `compiled.depthwise_parts`), which start a part in microseconds.
"""
from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence

import numpy as np
from ..concurrency import parallel
from .compiled.depthwise import depthwise_channels_last, depthwise_flat, depthwise_rows, depthwise_rows_stride2
from .compiled.depthwise_parts import (CHANNELS_LAST, FLAT, ROWS, ROWS2, depthwise_range, range_arguments,
                                       scratch_floats)

# From this many multiply-adds on (about 1.5 ms on one core), a kernel's images or output rows are
# shared out between threads (see run_tasks). Below it, waking a helper thread (100-300 µs on the
# 2-core VM measured) costs more than it saves: with a free second core, MobileNetV3's depthwise
# layers at batch 32 (11-38 M) ran 1.4-2x faster on two threads, ConvNeXt's 7x7 on 96ch@56 (15 M)
# 1.2x, and every batch-1 layer under 5 M slower (up to +280 µs).
PARALLEL_MIN_MACS = 10_000_000
# From this many multiply-adds on (about 15 µs on one core: a depthwise conv does few multiply-adds
# per value it moves), a float32 layer is shared with the CPU backend's spinning helpers when they
# are free (`_on_team`), which start a part in microseconds. Measured on 2 cores, one layer alone:
# ShuffleNet's 272ch@14 3x3 81 -> 55 µs, MobileNetV3's 16ch@112 3x3/2 87 -> 57 and 72ch@56 3x3/2
# 152 -> 93, EfficientNet's 144ch@56 3x3 306 -> 193.
TEAM_MIN_MACS = 100_000
# Channels per block of the channels-last loop: a multiple of the SIMD width (16 float32 lanes on
# AVX-512), with the block's channels-last copy of the image within CHUNK_BYTES (stays in L2).
CHANNEL_ALIGN = 16
CHUNK_BYTES = 1 << 20

_THREAD_SCRATCH = threading.local()


def scratch(shape: tuple[int, ...], dtype: np.dtype, slot: str = "buf") -> np.ndarray:
    """A per-thread reusable buffer (never returned to callers; one per ``slot``).

    Freshly allocated large arrays cost a page fault per 4 KiB page on first touch, which on
    these VMs rivals the copy itself; reusing one buffer per thread keeps the data in warm memory.
    """
    last = getattr(_THREAD_SCRATCH, slot, None)  # (buffer, shape, dtype, the view last handed out)
    if last is not None and last[1] == shape and last[2] == dtype:  # the same layer again: no new view
        return last[3]
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    buf = None if last is None else last[0]
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
    view = buf[:nbytes].view(dtype).reshape(shape)
    setattr(_THREAD_SCRATCH, slot, (buf, shape, dtype, view))
    return view


def threads_for(macs: int) -> int:
    """Parts to split a depthwise kernel of ``macs`` multiply-adds into: as many as the CPU pool
    running it offers (see ``concurrency/parallel.py``) from `PARALLEL_MIN_MACS` on, else one."""
    return parallel.parts_available() if macs >= PARALLEL_MIN_MACS else 1


def run_tasks(tasks: Sequence[Callable[[], None]], threads: int) -> None:
    """Run ``tasks`` (independent, GIL-releasing), split across the pool's idle threads when
    ``threads > 1``: each thread takes the next task until none is left (more tasks than
    threads, so a helper the OS schedules late leaves its share to the others)."""
    if threads <= 1 or len(tasks) <= 1:
        for task in tasks:
            task()
        return
    parallel.run_parts(len(tasks), lambda i: tasks[i]())


def stride2_rows_pay(width_stride: int, width_dilation: int, out_width: int, kernel_width: int) -> bool:
    """Whether `depthwise_rows_stride2` is the loop for a layer: stride 2 across, kernels of at most
    3 columns, outputs of 24 columns or more (measured per layer shape, one thread, against the
    channels-last loop: SSDlite's 64ch@160 3x3/2 1.72 -> 0.80 ms, EfficientNet's 96ch@112 1.10 ->
    0.66, MobileNetV3's 16ch@112 0.19 -> 0.12 and 72ch@56 0.19 -> 0.14, 16 to 240 channels at 56
    1.3-1.45x, 144ch@48 1.3x; at 20 columns and fewer, or with 5x5 kernels, it loses)."""
    return width_stride == 2 and width_dilation == 1 and out_width >= 24 and kernel_width <= 3


def flat_pays(height_stride: int, width_stride: int, out_height: int, out_width: int, reach_height: int,
              reach_width: int) -> bool:
    """Whether `depthwise_flat` is the loop for a layer: unit strides, outputs of 12 columns or
    more. Measured per layer shape on one core (AMD EPYC, AVX-512; bench/conv_shapes.py's
    depthwise rows), against the loop the other rules chose: 1.1-3.6x faster at unit stride from
    14x14 maps up (ConvNeXt's 7x7 on 96ch@56 2.69 -> 0.75 ms, EfficientNet's 5x5 on 240ch@28 0.66
    -> 0.28, MobileNetV3's 3x3 on 88ch@28 at batch 32 9.8 -> 2.0), 0.8x on 7x7 maps (channels
    last keeps those). Its strided form (phases per channel) lost to the stride-2 row loop and
    channels last, so strided layers keep them. ``reach_*`` is the window's extent less one
    (``(k − 1)·dilation``): a padded plane is at most 4x the output only while the window is no
    larger than the map (a model's huge dilation would otherwise size a huge plane)."""
    return (height_stride == 1 and width_stride == 1 and out_width >= 12 and reach_height <= out_height
            and reach_width <= out_width)


def channels_last_pays(multiplier: int, width_stride: int, out_width: int, kernel_width: int) -> bool:
    """Whether `depthwise_channels_last` beats `depthwise_rows` (measured per layer shape, one
    thread): the row loop wins only on wide maps at unit stride with small kernels (EfficientNet's
    3x3 on 32ch@112 and 144ch@56: 1.3-2x); with strides or maps of 28 columns or fewer the
    channels-last loop is 1.4-5x faster (ConvNeXt's 7x7: 1.4x). Channel multipliers above one take
    the row loop (it maps output to input channels; the channels-last one does not)."""
    return multiplier == 1 and (width_stride > 1 or out_width < 56 or kernel_width > 5)


def depthwise2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, strides: Sequence[int],
                dilations: Sequence[int], begin: Sequence[int], out: Sequence[int]) -> np.ndarray:
    """2-D depthwise conv: ``x`` (N, C, H, W), ``w`` (C*mult, 1, kh, kw) → (N, C*mult, Ho, Wo).

    ``begin`` are the top/left pads and ``out`` the output size (from ``window_geometry``); the
    bottom/right pads need no value (windows past the image read nothing). Output channel
    ``c*mult + j`` reads input channel ``c``, as ONNX defines groups. Float32 or float64 operands.
    """
    n, c, h, wd = x.shape
    m, _, kh, kw = w.shape
    mult = m // c
    ho, wo = out
    x = np.ascontiguousarray(x)
    bias = np.zeros(m, x.dtype) if bias is None else np.ascontiguousarray(bias, dtype=x.dtype)
    result = np.empty((n, m, ho, wo), dtype=x.dtype)
    geometry = (int(strides[0]), int(strides[1]), int(dilations[0]), int(dilations[1]), int(begin[0]), int(begin[1]))
    sh, sw, dh, dw, top, left = geometry
    macs = n * m * ho * wo * kh * kw
    threads = threads_for(macs)
    if flat_pays(sh, sw, ho, wo, (kh - 1) * dh, (kw - 1) * dw):
        loop = FLAT
    elif stride2_rows_pay(sw, dw, wo, kw):
        loop = ROWS2
    elif not channels_last_pays(mult, sw, wo, kw):
        loop = ROWS
    else:
        loop = CHANNELS_LAST
    if loop != CHANNELS_LAST:
        taps = np.ascontiguousarray(w.reshape(m, kh, kw), dtype=x.dtype)
        if macs >= TEAM_MIN_MACS and _on_team(loop, x, taps, bias, result, geometry, mult, CHANNEL_ALIGN):
            return result
    if loop == FLAT:
        row_width = wo + (kw - 1) * dw
        positions = -(-ho * row_width // 16) * 16  # virtual positions, whole SIMD vectors
        plane = positions + (kh - 1) * dh * row_width + (kw - 1) * dw

        def flat(i0: int, i1: int, m0: int, m1: int) -> None:
            depthwise_flat(x[i0:i1], taps, bias, result[i0:i1], m0, m1, dh, dw, top, left, mult,
                           scratch((plane,), x.dtype, "plane"), scratch((positions,), x.dtype, "acc"))

        run_tasks([functools.partial(flat, *part) for part in _blocks(m, threads, n)], threads)
        return result
    if loop == ROWS2:
        def rows2(i0: int, i1: int, m0: int, m1: int) -> None:
            phases = scratch((2, h, (wd + 1) // 2), x.dtype, "phases")
            depthwise_rows_stride2(x[i0:i1], taps, bias, result[i0:i1], m0, m1, sh, dh, top, left, mult, phases)

        run_tasks([functools.partial(rows2, *part) for part in _blocks(m, threads, n)], threads)
        return result
    if loop == ROWS:
        def rows(i0: int, i1: int, m0: int, m1: int) -> None:
            depthwise_rows(x[i0:i1], taps, bias, result[i0:i1], m0, m1, *geometry, mult)

        run_tasks([functools.partial(rows, *part) for part in _blocks(m, threads, n)], threads)
        return result
    taps = np.ascontiguousarray(w.reshape(c, kh, kw).transpose(1, 2, 0), dtype=x.dtype)
    # channel blocks: SIMD-width multiples, small enough that a block's channels-last copy of
    # the image stays in L2
    block = max(CHANNEL_ALIGN, min(c, CHUNK_BYTES // (h * wd * x.itemsize)) // CHANNEL_ALIGN * CHANNEL_ALIGN)
    if macs >= TEAM_MIN_MACS and _on_team(loop, x, taps, bias, result, geometry, mult, block):
        return result
    if 1 < threads and n < 2 * threads:  # too few images to share out: smaller channel blocks too
        block = min(block, -(-c // (2 * threads * n)) // CHANNEL_ALIGN * CHANNEL_ALIGN or CHANNEL_ALIGN)

    def channels(i: int, c0: int, c1: int) -> None:
        buf = scratch((h, wd, c1 - c0), x.dtype, "nhwc")
        acc = scratch((wo, c1 - c0), x.dtype, "acc")
        depthwise_channels_last(x[i], taps, bias, result[i], buf, acc, c0, c1, *geometry)

    run_tasks([functools.partial(channels, i, c0, min(c, c0 + block))
               for i in range(n) for c0 in range(0, c, block)], threads)
    return result


def _on_team(loop: int, x: np.ndarray, taps: np.ndarray, bias: np.ndarray, result: np.ndarray,
             geometry: tuple[int, ...], mult: int, block: int) -> bool:
    """The conv on ``loop`` (`compiled.depthwise_parts`), this thread and the CPU backend's
    spinning helpers taking a part each (images, else bands of channels, whole blocks of
    ``block`` where the loop works channels last); False, having done nothing, when there is no
    free team, the operands are not float32 or there are too few channels to share."""
    team = parallel.team()
    if team is None or x.dtype != np.float32:
        return False
    n, _, h, wd = x.shape
    m, ho, wo = result.shape[1:]
    parts = team.helpers + 1
    if n >= parts:
        cuts = [n * i // parts for i in range(parts + 1)]
        ranges = [(cuts[i], cuts[i + 1], 0, m) for i in range(parts)]
    else:
        if loop == CHANNELS_LAST:  # blocks of whole SIMD vectors, at least one a part
            block = min(block, max(CHANNEL_ALIGN, -(-m // parts) // CHANNEL_ALIGN * CHANNEL_ALIGN))
        step = block if loop == CHANNELS_LAST else 1
        if m < parts * step:
            return False
        cuts = [min(m, m * i // parts // step * step) for i in range(parts)] + [m]
        ranges = [(0, n, cuts[i], cuts[i + 1]) for i in range(parts)]
    kh, kw = (taps.shape[1], taps.shape[2]) if loop != CHANNELS_LAST else taps.shape[:2]
    size = scratch_floats(loop, h, wd, ho, wo, kh, kw, geometry[2], geometry[3], block)
    own = scratch((size,), np.float32, "team_depthwise")
    helpers = team.scratch((parts - 1, size), np.float32)
    posted = [range_arguments(loop, x, taps, bias, result, *ranges[j], geometry, mult, block, helpers[j - 1])
              for j in range(1, parts)]
    return team.try_run(posted, lambda: depthwise_range(loop, x, taps, bias, result, *ranges[0], *geometry, mult,
                                                        block, own))


def _blocks(channels: int, threads: int, images: int) -> list[tuple[int, int, int, int]]:
    """(image range, channel range) parts for `depthwise_rows`: all at once on one thread, else
    about two parts per thread (images first, then channel bands)."""
    if threads <= 1:
        return [(0, images, 0, channels)]
    if images >= 2 * threads:
        step = -(-images // (2 * threads))
        return [(i, min(images, i + step), 0, channels) for i in range(0, images, step)]
    bands = np.linspace(0, channels, min(channels, 2 * threads) + 1).astype(int)
    return [(i, i + 1, int(m0), int(m1)) for i in range(images) for m0, m1 in zip(bands[:-1], bands[1:])]
