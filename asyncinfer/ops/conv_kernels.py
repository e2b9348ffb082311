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
from dataclasses import dataclass, field

import numpy as np

from ..concurrency import parallel, spin_team
from ..concurrency.aligned import aligned_bytes
from .compiled.depthwise import (depthwise_channels_last, depthwise_flat, depthwise_rows, depthwise_rows_stride2,
                                 vector_groups, window_extent)
from .compiled.depthwise_block import KNOWN_WINDOWS
from .compiled.depthwise_parts import PART_KIND as DEPTHWISE_PART
from .compiled.depthwise_parts import (CHANNELS_LAST, FLAT, ROWS, ROWS2, finish_depthwise,
                                       post_and_finish_depthwise, scratch_floats)
from .compiled.panels import VECTOR_BYTES
from .epilogue import NO_ACTIVATION, Epilogue

# The kernels' inline helpers as plain Python for this module's Python: a compiled helper called
# from Python is compiled for that call in every process, uncached (0.45 s of a first run)
window_extent, vector_groups = window_extent.py_func, vector_groups.py_func

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


#: Views a thread keeps of one slot's buffer (`scratch`): one per shape the layers of a model ask
#: for, past which the slot starts again (a model of many shapes makes new views, as before).
SCRATCH_VIEWS = 64


def scratch(shape: tuple[int, ...], dtype: np.dtype, slot: str = "buf") -> np.ndarray:
    """A per-thread reusable buffer (never returned to callers; one per ``slot``).

    Freshly allocated large arrays cost a page fault per 4 KiB page on first touch, which on
    these VMs rivals the copy itself; reusing one buffer per thread keeps the data in warm memory.
    The buffer starts on a cache line (`concurrency.aligned`).

    The view of each shape asked for is kept with the buffer: consecutive layers of a model ask
    for different shapes, and making a view took three NumPy calls, 8-14 µs of a SqueezeNet 1x1
    conv's layer in a run (Python's objects cold after the kernel before), against one
    dictionary lookup.
    """
    held = getattr(_THREAD_SCRATCH, slot, None)  # (buffer, {(shape, dtype): view of it})
    if held is not None:
        view = held[1].get((shape, dtype))
        if view is not None:
            return view
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if held is None or held[0].nbytes < nbytes or len(held[1]) >= SCRATCH_VIEWS:
        buf = held[0] if held is not None and held[0].nbytes >= nbytes else aligned_bytes(max(nbytes, 1 << 20))
        held = (buf, {})
        setattr(_THREAD_SCRATCH, slot, held)
    view = held[0][:nbytes].view(dtype).reshape(shape)
    held[1][(shape, dtype)] = view
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
    3 columns, outputs of 64 columns or more. Measured per layer shape, one thread, against the
    channels-last loop (register blocks): SSDlite's 64ch@160 3x3/2 (80 columns) 0.66 vs 0.73 ms;
    at 56 columns and fewer the channels-last loop wins, 1.4-1.9x (EfficientNet's 96ch@112 0.54
    -> 0.39 ms, 144ch@56 0.30 -> 0.16; MobileNetV3's 16ch@112 and 72ch@56 1.4-1.5x)."""
    return width_stride == 2 and width_dilation == 1 and out_width >= 64 and kernel_width <= 3


#: The fewest output columns for which `registers_pay`: at stride 1, and at stride 2.
REGISTERS_COLUMNS, REGISTERS_STRIDE2_COLUMNS = 20, 14


def registers_pay(kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int],
                  out_width: int) -> bool:
    """Whether a layer takes `depthwise_flat`'s sums in registers straight from NCHW (no padded
    copy, no transposes: `depthwise_block.rows_block`): 3x3 windows at strides of 1 or 2 (the same
    both ways) and unit dilation, outputs of 20 columns or more. Measured per layer shape on one
    core (AMD EPYC, AVX-512) against the channels-last loop, whose two transposes cost more than
    its sums there: at stride 1, MobileNetV3's 88ch@28 52 -> 29 µs, ShuffleNet's 58ch@28 39 -> 20,
    EfficientNet's 144ch@56 229 -> 132 and 32ch@112 195 -> 118; at stride 2, MobileNetV3's 72ch@56
    70 -> 46 and 16ch@112 56 -> 46, EfficientNet's 96ch@112 309 -> 230, SSDlite's 64ch@160 603 ->
    353 (the stride-2 row loop: 602) and 120ch@40 62 -> 55. At 14 columns the channels-last loop is
    even or faster at stride 1 (480ch@14 59 against 58), at 7 twice as fast; 5x5 and 7x7 windows
    measured even at stride 1 and slower at stride 2, and keep it. At stride 2 the flat loop loads
    each input row once for its three taps (`depthwise_block.ONCE_A_ROW`), and wins from 14
    columns (`REGISTERS_STRIDE2_COLUMNS`; 2-vCPU Zen 4, one core: 240ch@28 55 -> 47 µs, 120ch@28
    33 -> 26; at 12 columns even, at 10 the channels-last loop 35 against 40)."""
    least = REGISTERS_STRIDE2_COLUMNS if strides[0] == 2 else REGISTERS_COLUMNS
    return (kernel == (3, 3) and strides[0] == strides[1] and strides[0] in (1, 2) and dilations == (1, 1)
            and out_width >= least)


def known_window_pays(multiplier: int, kernel_width: int, width_stride: int, width_dilation: int) -> bool:
    """Whether a layer takes the channels-last loop whatever its map: kernel rows of 3 or 5 taps
    at stride 1 or 2, or of 7 at stride 1 (`depthwise_block.KNOWN_WINDOWS`), whose register
    blocks load each input once for all its taps. Measured per layer shape on one core (AMD EPYC,
    AVX-512) against the flat loop: EfficientNet's 3x3 on 144ch@56 0.28 -> 0.23 ms and 32ch@112
    0.26 -> 0.19, its 5x5 on 240ch@28 0.28 -> 0.15, MobileNetV3's 3x3 on 96ch@28 67 -> 49 µs,
    ConvNeXt's 7x7 on 96ch@56 0.64 -> 0.38 and 192ch@28 0.40 -> 0.19. Wide stride-2 maps keep
    the stride-2 row loop (`stride2_rows_pay`: SSDlite's 64ch@160 3x3/2, even on one core, took
    0.75 against 0.84 ms on the spinning team), other windows the rules below."""
    return multiplier == 1 and width_dilation == 1 and (kernel_width, width_stride) in KNOWN_WINDOWS


def flat_pays(height_stride: int, width_stride: int, out_height: int, out_width: int, reach_height: int,
              reach_width: int) -> bool:
    """Whether `depthwise_flat` is the loop for a layer: unit strides, outputs of 20 columns or
    more. Measured per layer shape on one core (AMD EPYC, AVX-512), against the channels-last
    loop (register blocks): at 28 columns and more flat wins, 1.15-1.4x (MobileNetV3's 3x3 on
    88ch@28, EfficientNet's on 144ch@56 and 32ch@112, ConvNeXt's 7x7 on 96ch@56); at 14 columns
    channels last does, 1.2-1.5x (ShuffleNet's 3x3 on 272ch@14, MobileNetV3's 5x5 on 240ch@14),
    and at 7 both are even. Strided layers keep the other loops. ``reach_*`` is the window's
    extent less one (``(k − 1)·dilation``): a padded plane is at most 4x the output only while the
    window is no larger than the map (a model's huge dilation would otherwise size a huge plane)."""
    return (height_stride == 1 and width_stride == 1 and out_width >= 20 and reach_height <= out_height
            and reach_width <= out_width)


def channels_last_pays(multiplier: int, width_stride: int, out_width: int, kernel_width: int) -> bool:
    """Whether `depthwise_channels_last` beats `depthwise_rows` (measured per layer shape, one
    thread): the row loop wins only on wide maps at unit stride with small kernels (EfficientNet's
    3x3 on 32ch@112 and 144ch@56: 1.3-2x); with strides or maps of 28 columns or fewer the
    channels-last loop is 1.4-5x faster (ConvNeXt's 7x7: 1.4x). Channel multipliers above one take
    the row loop (it maps output to input channels; the channels-last one does not)."""
    return multiplier == 1 and (width_stride > 1 or out_width < 56 or kernel_width > 5)


#: How `depthwise2d` keeps a form of the weights between runs: ``keep(name, work_out)`` returns
#: what ``work_out()`` returned the first time for ``name`` (`Op.derived` on the weights' input).
KeepWeights = Callable[[str, Callable[[], np.ndarray]], np.ndarray]


def keep_nothing(name: str, work_out: Callable[[], np.ndarray]) -> np.ndarray:
    """The `KeepWeights` of weights that are no constant: worked out for this run alone."""
    return work_out()


def depthwise_taps(w: np.ndarray, loop: int, dtype: np.dtype) -> np.ndarray:
    """The weights (M, 1, kh, kw) as ``loop`` reads them: (M, kh, kw), or for `CHANNELS_LAST`
    (kh, kw, C) with C rounded up to whole blocks, zero past it (the register blocks read whole
    vectors of channels)."""
    m, _, kh, kw = w.shape
    if loop != CHANNELS_LAST:
        return np.ascontiguousarray(w.reshape(m, kh, kw), dtype=dtype)
    taps = np.zeros((kh, kw, -(-m // CHANNEL_ALIGN) * CHANNEL_ALIGN), dtype)
    taps[:, :, :m] = w.reshape(m, kh, kw).transpose(1, 2, 0)
    return taps


@dataclass(frozen=True)
class DepthwisePlan:
    """What `depthwise2d` works out from the operands' shapes, weights and bias before it runs
    (`depthwise_plan`): the loop, the weights and bias as it reads them, the geometry. Kept by a
    Conv that runs the same case again (`Conv._shortcut`), which then starts at `run_depthwise`."""

    x_shape: tuple[int, ...]          # (N, C, H, W)
    out: tuple[int, int]              # (Ho, Wo)
    kernel: tuple[int, int]           # (kh, kw)
    loop: int                         # FLAT, ROWS2, ROWS or CHANNELS_LAST (`compiled.depthwise_parts`)
    taps: np.ndarray                  # the weights as ``loop`` reads them (`_taps`)
    bias: np.ndarray                  # (M,), the operands' dtype
    geometry: tuple[int, ...]         # sh, sw, dh, dw, top, left
    multiplier: int
    block: int                        # channels a block (channels last), else CHANNEL_ALIGN
    # per count of spinning helpers, the layer's `TeamLayout` on them (worked out at its first run)
    team_layouts: dict[int, "TeamLayout | None"] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class TeamLayout:
    """How a `DepthwisePlan` runs on this thread and its spinning helpers (`_on_team`): the parts
    (`_team_parts`), the channel block to run them with, each sharer's scratch (float32 values)
    and the geometry as the compiled posting reads it."""

    parts: np.ndarray
    block: int
    scratch: int
    spans: np.ndarray


def depthwise_plan(x_shape: tuple[int, ...], dtype: np.dtype, w: np.ndarray, bias: np.ndarray | None,
                   strides: Sequence[int], dilations: Sequence[int], begin: Sequence[int], out: Sequence[int],
                   keep: KeepWeights = keep_nothing) -> DepthwisePlan:
    """The `DepthwisePlan` of a 2-D depthwise conv of an ``x_shape`` input of ``dtype`` (float32
    or float64) by ``w`` (C*mult, 1, kh, kw), as `depthwise2d` takes them; ``keep`` keeps the
    weights' form for the loop between runs (a model's constant weights)."""
    n, c, h, wd = x_shape
    m, _, kh, kw = w.shape
    ho, wo = (int(o) for o in out)
    geometry = (int(strides[0]), int(strides[1]), int(dilations[0]), int(dilations[1]), int(begin[0]), int(begin[1]))
    sh, sw, dh, dw = geometry[:4]
    if registers_pay((kh, kw), (sh, sw), (dh, dw), wo) and np.isfinite(w).all():
        loop = FLAT  # (an infinite tap times the padding is NaN: the padded copies compute it)
    elif stride2_rows_pay(sw, dw, wo, kw):
        loop = ROWS2
    elif known_window_pays(m // c, kw, sw, dw):
        loop = CHANNELS_LAST
    elif flat_pays(sh, sw, ho, wo, (kh - 1) * dh, (kw - 1) * dw):
        loop = FLAT
    elif not channels_last_pays(m // c, sw, wo, kw):
        loop = ROWS
    else:
        loop = CHANNELS_LAST
    taps = keep(f"depthwise-taps-{loop}", lambda: depthwise_taps(w, loop, dtype))
    bias = np.zeros(m, dtype) if bias is None else np.ascontiguousarray(bias, dtype=dtype)
    block = CHANNEL_ALIGN
    if loop == CHANNELS_LAST:
        # channel blocks: SIMD-width multiples, small enough that a block's padded channels-last
        # copy of the image stays in L2
        area = window_extent(ho, kh, sh, dh) * window_extent(wo, kw, sw, dw)
        block = max(CHANNEL_ALIGN, min(c, CHUNK_BYTES // (area * np.dtype(dtype).itemsize)) // CHANNEL_ALIGN
                    * CHANNEL_ALIGN)
    return DepthwisePlan(tuple(x_shape), (ho, wo), (kh, kw), loop, taps, bias, geometry, m // c, block)


def depthwise2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, strides: Sequence[int],
                dilations: Sequence[int], begin: Sequence[int], out: Sequence[int],
                keep: KeepWeights = keep_nothing, epilogue: Epilogue = NO_ACTIVATION) -> np.ndarray:
    """2-D depthwise conv: ``x`` (N, C, H, W), ``w`` (C*mult, 1, kh, kw) → (N, C*mult, Ho, Wo).

    ``begin`` are the top/left pads and ``out`` the output size (from ``window_geometry``); the
    bottom/right pads need no value (windows past the image read nothing). Output channel
    ``c*mult + j`` reads input channel ``c``, as ONNX defines groups. Float32 or float64 operands.
    ``keep`` keeps the weights' form for the loop between runs (a model's constant weights);
    ``epilogue``: the activation after the bias (float32 only).
    """
    return run_depthwise(depthwise_plan(x.shape, x.dtype, w, bias, strides, dilations, begin, out, keep), x, epilogue)


def run_depthwise(plan: DepthwisePlan, x: np.ndarray, epilogue: Epilogue = NO_ACTIVATION) -> np.ndarray:
    """The conv of ``plan`` on ``x`` (of the plan's shape and dtype), then ``epilogue``'s
    activation: on the CPU backend's spinning helpers when they are free and it has
    `TEAM_MIN_MACS` multiply-adds (each activating its part of the output), else on the pool's
    threads (`run_tasks`) from `PARALLEL_MIN_MACS`, else here. The channels-last loop activates
    its sums while they are in cache; the others' outputs are activated after them."""
    n, c, h, wd = plan.x_shape
    m = plan.bias.shape[0]
    ho, wo = plan.out
    kh, kw = plan.kernel
    loop, taps, bias, geometry, mult = plan.loop, plan.taps, plan.bias, plan.geometry, plan.multiplier
    sh, sw, dh, dw, top, left = geometry
    x = np.ascontiguousarray(x)
    result = np.empty((n, m, ho, wo), dtype=x.dtype)
    macs = n * m * ho * wo * kh * kw
    if macs >= TEAM_MIN_MACS and _on_team(plan, x, result, epilogue):
        return result
    threads = threads_for(macs)
    if loop == FLAT:
        row_width = wo + (kw - 1) * dw
        positions = -(-ho * row_width // 16) * 16  # virtual positions, whole SIMD vectors
        plane = positions + (kh - 1) * dh * row_width + (kw - 1) * dw

        def flat(i0: int, i1: int, m0: int, m1: int) -> None:
            depthwise_flat(x[i0:i1], taps, bias, result[i0:i1], m0, m1, sh, sw, dh, dw, top, left, mult,
                           scratch((plane,), x.dtype, "plane"), scratch((positions,), x.dtype, "acc"))

        run_tasks([functools.partial(flat, *part) for part in _blocks(m, threads, n)], threads)
        return epilogue.apply_inplace(result)
    if loop == ROWS2:
        def rows2(i0: int, i1: int, m0: int, m1: int) -> None:
            phases = scratch((2, h, (wd + 1) // 2), x.dtype, "phases")
            depthwise_rows_stride2(x[i0:i1], taps, bias, result[i0:i1], m0, m1, sh, dh, top, left, mult, phases)

        run_tasks([functools.partial(rows2, *part) for part in _blocks(m, threads, n)], threads)
        return epilogue.apply_inplace(result)
    if loop == ROWS:
        def rows(i0: int, i1: int, m0: int, m1: int) -> None:
            depthwise_rows(x[i0:i1], taps, bias, result[i0:i1], m0, m1, *geometry, mult)

        run_tasks([functools.partial(rows, *part) for part in _blocks(m, threads, n)], threads)
        return epilogue.apply_inplace(result)
    block = plan.block
    if 1 < threads and n < 2 * threads:  # too few images to share out: smaller channel blocks too
        block = min(block, -(-c // (2 * threads * n)) // CHANNEL_ALIGN * CHANNEL_ALIGN or CHANNEL_ALIGN)
    hp, wp = window_extent(ho, kh, sh, dh), window_extent(wo, kw, sw, dw)
    lanes = VECTOR_BYTES // x.itemsize

    def channels(i: int, c0: int, c1: int) -> None:
        groups = vector_groups(c1 - c0, x.itemsize)
        padded = scratch((groups, hp, wp, lanes), x.dtype, "nhwc")
        acc = scratch((groups, ho * wo + 1, lanes), x.dtype, "acc")
        depthwise_channels_last(x[i], taps, bias, result[i], padded, acc, c0, c1, *geometry, epilogue.kind,
                                epilogue.a, epilogue.b, 0, -1)

    run_tasks([functools.partial(channels, i, c0, min(c, c0 + block))
               for i in range(n) for c0 in range(0, c, block)], threads)
    return result


def _on_team(plan: DepthwisePlan, x: np.ndarray, result: np.ndarray, epilogue: Epilogue) -> bool:
    """The conv of ``plan`` on its loop (`compiled.depthwise_parts`), this thread and the CPU
    backend's spinning helpers taking a part each (`_team_layout`), posted, run and waited for in
    compiled code; False, having done nothing, when there is no free team, the operands are not
    float32 or there are too few channels (and rows) to share."""
    team = parallel.team(DEPTHWISE_PART)
    if team is None or x.dtype != np.float32:
        return False
    layouts = plan.team_layouts
    if team.helpers not in layouts:  # (two lanes running the plan at once both work it out: the same)
        layouts[team.helpers] = _team_layout(plan, team.helpers + 1)
    layout = layouts[team.helpers]
    if layout is None:
        return False
    control = team.claim()
    if control is None:
        return False
    parts = layout.parts
    try:
        own = scratch((layout.scratch,), np.float32, "team_depthwise")
        helpers = team.scratch((len(parts) - 1, layout.scratch), np.float32)
        arguments = (control, plan.loop, x, plan.taps, plan.bias, result, parts, layout.spans, plan.multiplier,
                     layout.block)
        status = post_and_finish_depthwise(*arguments, helpers, own, epilogue.kind, epilogue.numbers,
                                           spin_team.WAIT_ROUNDS)
        if status != spin_team.PARTS_DONE:  # (the common case: nothing to settle, no tuple built)
            team.settle(status, finish_depthwise,
                        (*arguments, own, epilogue.kind, epilogue.a, epilogue.b, spin_team.WAIT_ROUNDS), len(parts) - 1)
    finally:
        team.release()
    return True


def _team_layout(plan: DepthwisePlan, sharers: int) -> TeamLayout | None:
    """The `TeamLayout` of ``plan`` for ``sharers`` threads; None where its channels (and rows)
    are too few to share."""
    n, _, h, wd = plan.x_shape
    m = plan.bias.shape[0]
    ho, wo = plan.out
    parts, block = _team_parts(plan.loop, n, m, ho, sharers, plan.block)
    if parts is None:
        return None
    kh, kw = plan.kernel
    # each helper's row of scratch on a cache line too
    size = -(-scratch_floats(plan.loop, h, wd, ho, wo, kh, kw, *plan.geometry[:4], block) // 16) * 16
    spans = np.array(plan.geometry, np.int64)  # sh, sw, dh, dw, top, left
    spans.flags.writeable = False
    return TeamLayout(parts, block, size, spans)


@functools.lru_cache(maxsize=512)
def _team_parts(loop: int, n: int, m: int, ho: int, parts: int, block: int) -> tuple[np.ndarray | None, int]:
    """A depthwise conv's parts for ``parts`` sharers (int64 rows i0, i1, m0, m1, oh0, oh1:
    images, else bands of channels, whole blocks of ``block`` where the loop works channels last,
    or there bands of output rows when there are fewer channels than a vector a part), and the
    channel block to run them with; None where there are too few channels to share."""
    rows = [(0, -1)] * parts  # (output rows of each part: every one)
    if n >= parts:
        cuts = [n * i // parts for i in range(parts + 1)]
        ranges = [(cuts[i], cuts[i + 1], 0, m) for i in range(parts)]
    elif loop == CHANNELS_LAST and m < parts * CHANNEL_ALIGN and ho >= 2 * parts:
        # fewer channels than a vector a part: bands of output rows instead, over every channel
        cuts = [ho * i // parts for i in range(parts + 1)]
        ranges = [(0, n, 0, m)] * parts
        rows = [(cuts[i], cuts[i + 1]) for i in range(parts)]
    else:
        if loop == CHANNELS_LAST:  # blocks of whole SIMD vectors, at least one a part
            block = min(block, max(CHANNEL_ALIGN, -(-m // parts) // CHANNEL_ALIGN * CHANNEL_ALIGN))
        step = block if loop == CHANNELS_LAST else 1
        if m < parts * step:
            return None, block
        cuts = [min(m, m * i // parts // step * step) for i in range(parts)] + [m]
        ranges = [(0, n, cuts[i], cuts[i + 1]) for i in range(parts)]
    table = np.array([r + o for r, o in zip(ranges, rows)], np.int64)
    table.flags.writeable = False
    return table, block


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
