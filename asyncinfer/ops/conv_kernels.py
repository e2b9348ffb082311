"""Depthwise convolution kernels (``group == C``) for `asyncinfer.ops.conv`.

A depthwise conv does a handful of multiply-adds per output and mixes no channels, so it is no
GEMM: lowered to per-channel im2col + GEMV it streams ``taps`` copies of the input through memory,
and one BLAS call per channel costs more than the arithmetic on small maps. Here the channels go
last (NHWC) and ``np.einsum`` sums over the taps of a strided window view: one NumPy call, no
im2col, and its inner loop is a SIMD multiply-add over a contiguous run of channels (at unit width
stride, over a run of ``Wb`` neighbouring output pixels × C channels). See `depthwise_nhwc`.

Measured with bench/conv_shapes.py (kernel alone, one thread, against the NCHW im2col + GEMV
kernel it replaces): 2-3.5× faster on the MobileNetV3 / EfficientNet / ConvNeXt depthwise layers
with 64 channels or more, and on every unit-stride one; with fewer channels and a stride (the
16-channel 3×3/s2 at 112×112) the inner loop is too short and the NCHW kernel stays (1.8× faster
there). Large kernels (batches, big maps) share their images or output rows out between threads
(`run_tasks`, from `PARALLEL_MIN_MACS` multiply-adds on); ``np.einsum`` and BLAS release
the GIL.
"""
from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..concurrency import parallel

# With fewer channels than this per image, the NHWC inner loop (one run of C values per output
# pixel and tap) is too short for its per-loop overhead; unless neighbouring output pixels can be
# fused into it (unit width stride), conv.py keeps the NCHW flat-window kernel.
NHWC_MIN_CHANNELS = 64
# At unit width stride, Wb neighbouring output pixels share one inner loop of Wb*C values (their
# windows are one contiguous run of the padded row), against weights tiled Wb times. Longer loops
# cost less overhead per value, a larger tiled weight array more cache: Wb is the largest divisor
# of Wo with Wb*C <= this (measured best among 512..4096, and against Wb = 1 and Wb = Wo).
ROW_BLOCK_VALUES = 1024
# Images per einsum: as many as keep the padded NHWC copy within this (batch 32 as one block
# streams tens of MB through memory twice; a few images at a time stay in the 2 MB L2).
CHUNK_BYTES = 1 << 20
# From this many multiply-adds on (about 1.5 ms on one core), a kernel's images or output rows are
# shared out between threads (see run_tasks). Below it, waking a helper thread (100-300 µs on the
# 2-core VM measured) costs more than it saves: with a free second core, MobileNetV3's depthwise
# layers at batch 32 (11-38 M) ran 1.4-2x faster on two threads, ConvNeXt's 7x7 on 96ch@56 (15 M)
# 1.2x, and every batch-1 layer under 5 M slower (up to +280 µs).
PARALLEL_MIN_MACS = 10_000_000

_THREAD_SCRATCH = threading.local()


def scratch(shape: tuple[int, ...], dtype: np.dtype, slot: str = "buf") -> np.ndarray:
    """A per-thread reusable buffer (never returned to callers; one per ``slot``).

    Freshly allocated large arrays cost a page fault per 4 KiB page on first touch, which on
    these VMs rivals the copy itself; reusing one buffer per thread keeps the data in warm memory.
    """
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    buf = getattr(_THREAD_SCRATCH, slot, None)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        setattr(_THREAD_SCRATCH, slot, buf)
    return buf[:nbytes].view(dtype).reshape(shape)


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


def use_nhwc(channels: int, width_stride: int) -> bool:
    """Whether `depthwise_nhwc` beats the NCHW flat-window kernel (measured, see module doc)."""
    return channels >= NHWC_MIN_CHANNELS or width_stride == 1


def depthwise_nhwc(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, strides: Sequence[int],
                   dilations: Sequence[int], begin: Sequence[int], out: Sequence[int]) -> np.ndarray:
    """2-D depthwise conv: ``x`` (N, C, H, W), ``w`` (C*mult, 1, kh, kw) → (N, C*mult, Ho, Wo).

    ``begin`` are the top/left pads and ``out`` the output size (from ``window_geometry``); the
    bottom/right padding is whatever the last window needs. Output channel ``c*mult + j`` reads
    input channel ``c``, as ONNX defines groups.
    """
    n, c, h, wd = x.shape
    mult = w.shape[0] // c
    kh, kw = w.shape[2:]
    (sh, sw), (dh, dw), (ho, wo) = strides, dilations, out
    hp = max(begin[0] + h, (ho - 1) * sh + (kh - 1) * dh + 1)
    wp = max(begin[1] + wd, (wo - 1) * sw + (kw - 1) * dw + 1)
    wb = row_block(c, wo) if mult == 1 and sw == 1 else 1
    taps = _tap_weights(w, c, mult, wb)
    bias = None if bias is None else bias.reshape(-1, 1, 1)
    result = np.empty((n, c * mult, ho, wo), dtype=np.result_type(x.dtype, w.dtype))
    threads = threads_for(n * c * mult * ho * wo * kh * kw)

    def images(i0: int, i1: int) -> None:
        xp = _padded_nhwc(x[i0:i1], begin, hp, wp)
        _to_nchw(_window_sum(xp, taps, strides, dilations, (ho, wo), wb), bias, result[i0:i1])

    if n > 1 or threads == 1:
        # a few images at a time: the padded copy and the einsum's output stay in cache
        step = max(1, CHUNK_BYTES // (hp * wp * c * x.itemsize))
        if threads > 1:
            step = min(step, -(-n // (2 * threads)))
        run_tasks([functools.partial(images, i, min(n, i + step)) for i in range(0, n, step)], threads)
        return result
    # one image, several threads: pad it once, share bands of output rows out
    xp = _padded_nhwc(x, begin, hp, wp)

    def rows(r0: int, r1: int) -> None:
        y = _window_sum(xp[:, r0 * sh:], taps, strides, dilations, (r1 - r0, wo), wb)
        _to_nchw(y, bias, result[:, :, r0:r1])

    bands = np.linspace(0, ho, min(ho, 2 * threads) + 1).astype(int)
    run_tasks([functools.partial(rows, r0, r1) for r0, r1 in zip(bands[:-1], bands[1:])], threads)
    return result


def _to_nchw(y: np.ndarray, bias: np.ndarray | None, dst: np.ndarray) -> None:
    """Write the NHWC einsum result ``y`` into ``dst`` (N, M, Ho, Wo), adding ``bias`` (M, 1, 1)
    on the way: the bias add doubles as the copy back to NCHW."""
    n, m, ho, wo = dst.shape
    y = y.reshape(n, ho, wo, m).transpose(0, 3, 1, 2)
    if bias is None:
        np.copyto(dst, y)
    else:
        np.add(y, bias, out=dst)


def _tap_weights(w: np.ndarray, c: int, mult: int, wb: int) -> np.ndarray:
    """The kernel as ``(kh, kw, C, mult)``, contiguous (the einsum's inner loop runs over C), or
    with ``wb`` > 1 as ``(kh, kw, wb*C)``: each tap's C weights repeated for Wb output pixels."""
    kh, kw = w.shape[2:]
    taps = np.ascontiguousarray(w.reshape(c, mult, kh, kw).transpose(2, 3, 0, 1))
    if wb == 1:
        return taps
    tiled = np.empty((kh, kw, wb, c), dtype=w.dtype)
    tiled[...] = taps[:, :, None, :, 0]
    return tiled.reshape(kh, kw, wb * c)


def _window_sum(xp: np.ndarray, taps: np.ndarray, strides: Sequence[int], dilations: Sequence[int],
                out: Sequence[int], wb: int) -> np.ndarray:
    """Sum over the kernel taps of the strided window views of ``xp`` (N, hp, wp, C), NHWC out."""
    n, c = xp.shape[0], xp.shape[3]
    kh, kw = taps.shape[:2]
    (sh, sw), (dh, dw), (ho, wo) = strides, dilations, out
    sn, sy, sx, sc = xp.strides
    if wb > 1:  # (unit width stride)
        # Wb neighbouring outputs (Wb, C) read one contiguous run of Wb*C values of a padded row
        view = as_strided(xp, (n, ho, wo // wb, kh, kw, wb * c), (sn, sh * sy, wb * sx, dh * sy, dw * sx, sc),
                          writeable=False)
        return np.einsum("nhbijq,ijq->nhbq", view, taps)
    view = as_strided(xp, (n, ho, wo, kh, kw, c), (sn, sh * sy, sw * sx, dh * sy, dw * sx, sc), writeable=False)
    if taps.shape[3] == 1:
        return np.einsum("nhwijc,ijc->nhwc", view, taps[..., 0])
    return np.einsum("nhwijc,ijcm->nhwcm", view, taps)


def row_block(channels: int, width: int) -> int:
    """Output pixels per inner loop at unit width stride (see `ROW_BLOCK_VALUES`)."""
    return max(d for d in range(1, width + 1) if width % d == 0 and d * channels <= max(ROW_BLOCK_VALUES, channels))


def _padded_nhwc(x: np.ndarray, begin: Sequence[int], hp: int, wp: int) -> np.ndarray:
    """``x`` (N, C, H, W) as a zero-padded NHWC scratch buffer (N, hp, wp, C), ``x`` at ``begin``
    (``hp``/``wp`` >= pad + size). Only the border is zeroed: the interior is written once, by the
    transposing copy."""
    n, c, h, wd = x.shape
    top, left = begin
    xp = scratch((n, hp, wp, c), x.dtype, "nhwc")
    xp[:, :top] = 0
    xp[:, top + h:] = 0
    xp[:, top:top + h, :left] = 0
    xp[:, top:top + h, left + wd:] = 0
    xp[:, top:top + h, left:left + wd] = x.transpose(0, 2, 3, 1)
    return xp
