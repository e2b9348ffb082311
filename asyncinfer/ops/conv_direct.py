"""Float32 convs of a few input channels (network stems) on a direct kernel (`compiled.direct`),
shared with the CPU backend's spinning helpers.

A stem conv (3 channels, a 3x3 to 7x7 window at stride 2, a 4x4 patchify at stride 4) is a GEMM
of depth 27 to 147 whose im2col copies the image that many times: the tiled GEMM way took
2.8-3.5x ONNX Runtime's time on these layers. The direct kernel sums blocks of output channels x
positions of an output row in vector registers over every tap, reading a zero-padded copy of
the input in place (each thread keeps the padded buffer, so only the input is copied per run).

`direct_plan` works out once per shape what `run_direct` then does each run: the weights
transposed and padded to whole blocks of channels (kept between runs through ``keep``), each
tap's offset in the padded image, and the parts (ranges of output rows through the images):
this thread takes one and each free spinning helper another.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..concurrency import parallel, spin_team
from .compiled.direct import (LANES, STRIDES, WIDE_VECTORS, copy_inside, direct_conv, finish_direct,
                              post_and_finish_direct)
from .compiled.direct_panels import BLOCK_POSITIONS, direct_panel_conv, pack_joined_taps
from .compiled.direct_panels import WIDTH as PANEL_WIDTH
from .compiled.direct import PART_KIND as DIRECT_PART
from .compiled.direct_panels import PART_KIND as PANELS_PART
from .compiled.direct_panels import finish_panels, post_and_finish_panels
from .compiled.panels import BLOCK_ROWS
from .conv_kernels import KeepWeights, keep_nothing, scratch
from .epilogue import Epilogue
from .linalg import TEAM_MIN_MACS

#: Most input channels a conv may have for the direct kernel: beyond a stem's few, the tiled
#: GEMM's deeper sums win (and Winograd's, at stride 1).
MAX_CHANNELS = 4
#: Fewest output columns: a block is a vector of positions of one output row.
MIN_WIDTH = LANES
#: A shallow conv (depth C·kh·kw under `DEEP`) with more than `MAX_SHALLOW_OUTPUTS` output
#: channels whose windows do not overlap (stride = window: ConvNeXt's 4x4/4 patchify, whose
#: im2col is a plain reshuffle) keeps the GEMM way: 252 against 275 µs on 2 cores. Overlapping
#: stems take this kernel, in the models (the first layer, median of 40 runs, GEMM way -> direct):
#: MobileNetV3's 3x3/2 3 -> 16 519 -> 370 µs, ShuffleNet's 3 -> 24 459 -> 358, EfficientNet's
#: 3 -> 32 823 -> 702, the 7x7/2 3 -> 64 of ResNet-18/50, DenseNet and Inception 2.3-2.7 -> 1.8-2.1
#: ms; and since rows are stored as their phases (`compiled.direct`), SqueezeNet's 3x3/2 3 -> 64
#: too (a single layer in a worker: 400-462 -> 290-295 µs; 7x7/2 3 -> 64 1325-1341 -> 1161-1233).
DEEP = 64
MAX_SHALLOW_OUTPUTS = 32

#: The panel kernel (`compiled.direct_panels`) takes the other convs of at least this many taps
#: (C·kh·kw: its transposed stores need a deep sum to pay for) and strides of at most
#: `PANEL_MAX_STRIDE`, where Winograd does not take them (`conv_winograd.winograd_tile`).
PANEL_MIN_DEPTH = 64
PANEL_MAX_STRIDE = 2
#: ... and at any stride a conv of at most this many output positions an image, whose im2col
#: GEMM would be as narrow (BLAS runs far below speed on a few columns): a voice detector's
#: STFT, 258 filters of 256 taps at stride 128 over 640 samples (4 frames), took 23.5 µs in
#: sgemm (Haswell kernels) and takes 8-9 here.
PANEL_FEW_POSITIONS = 16


def takes_direct(x_shape: tuple[int, ...], w_shape: tuple[int, ...], group: int, strides: tuple[int, ...],
                 dilations: tuple[int, ...], out: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether a 2-D conv runs on `compiled.direct`: float32, one group of at most `MAX_CHANNELS`
    input channels, a window larger than 1x1, no dilation, the same stride both ways (one of
    `compiled.direct.STRIDES`), output rows at least `MIN_WIDTH` wide, and overlapping windows,
    deep or narrow enough (`DEEP`, `MAX_SHALLOW_OUTPUTS`)."""
    return (dtype == np.float32 and len(x_shape) == 4 and group == 1 and x_shape[1] <= MAX_CHANNELS
            and w_shape[2:] != (1, 1) and dilations == (1, 1) and strides[0] == strides[1]
            and strides[0] in STRIDES and out[1] >= MIN_WIDTH
            and (tuple(strides) != tuple(w_shape[2:]) or w_shape[0] <= MAX_SHALLOW_OUTPUTS
                 or math.prod(w_shape[1:]) >= DEEP))


@dataclass(frozen=True)
class DirectPlan:
    """What `run_direct` does with an input: the operands and the parts of `direct_conv`."""

    x_shape: tuple[int, ...]            # (N, C, H, W)
    y_shape: tuple[int, ...]            # (N, M, Ho, Wo)
    padded: tuple[int, ...]             # (N, C, Hp, stride·Wq): the zero-padded input, each row as
    top: int                            # its ``stride`` phases; its rows and columns of padding
    left: int                           # before the input's
    columns: np.ndarray                 # (taps, Mp): the weights transposed, zero past M
    bias: np.ndarray                    # (Mp,), zero past M (and where there is none)
    offsets: np.ndarray                 # (taps,) int64: each tap's offset in a padded image
    stride: int                         # (both ways; the phases of a row: `padded_input`)
    epilogue: Epilogue
    numbers: np.ndarray                 # the epilogue's (a, b), float64, for helpers
    parts: tuple[tuple[int, int], ...]  # output rows (q0, q1), counted through the images
    bounds: np.ndarray                  # the parts as an int64 (parts, 2) array, for the team's posts
    team: bool                          # offered to the spinning helpers


def direct_plan(x_shape: tuple[int, ...], w: np.ndarray, b: np.ndarray | None, strides: tuple[int, ...],
                begin: tuple[int, ...], out: tuple[int, ...], epilogue: Epilogue,
                keep: KeepWeights = keep_nothing) -> DirectPlan:
    """The `DirectPlan` of a conv `takes_direct` accepts, ``w`` (M, C, kh, kw), ``b`` (M,) or None;
    ``keep`` keeps the weights' form between runs (a model's constants)."""
    n, c, h, wd = x_shape
    m, _, kh, kw = w.shape
    ho, wo = out
    stride = strides[0]
    padded_m = -(-m // BLOCK_ROWS) * BLOCK_ROWS

    def transposed() -> np.ndarray:
        columns = np.zeros((c * kh * kw, padded_m), np.float32)
        columns[:, :m] = w.reshape(m, -1).T
        return columns
    columns = keep("direct", transposed)
    bias = np.zeros(padded_m, np.float32)
    if b is not None:
        bias[:m] = b
    # Each padded row is stored as its ``stride`` phases (columns ``stride·j + phase``, each
    # ``wq`` wide): a tap then reads consecutive values of one phase, not every ``stride``-th
    # value of the row (a load and a shuffle per lane: 16 G multiply-adds/s a core at stride 2).
    # Every block reads whole vectors: phases as wide as the last block's reach.
    wq = max(-(-(begin[1] + wd) // stride), -(-wo // LANES) * LANES + (kw - 1) // stride)
    hp = max(begin[0] + h, (ho - 1) * stride + kh)
    ci, ky, kx = _taps(c, kh, kw)
    offsets = ((ci * hp + ky) * stride + kx % stride) * wq + kx // stride
    rows = n * ho
    team = n * m * c * kh * kw * ho * wo >= TEAM_MIN_MACS
    count = min(parallel.team_size() if team else 1, rows)
    cuts = [rows * i // count for i in range(count + 1)]
    parts = tuple((cuts[i], cuts[i + 1]) for i in range(count))
    return DirectPlan(tuple(x_shape), (n, m, ho, wo), (n, c, hp, stride * wq), begin[0], begin[1], columns, bias,
                      offsets, stride, epilogue, epilogue.numbers, parts, np.array(parts, np.int64).reshape(-1, 2),
                      team and count > 1)


def _taps(c: int, kh: int, kw: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The channel, row and column of each tap of a window, in ``(c, ky, kx)`` order (int64 each,
    C·kh·kw long; a plan is made on every run of a conv that has no short way)."""
    ci, ky, kx = np.meshgrid(np.arange(c, dtype=np.int64), np.arange(kh, dtype=np.int64),
                             np.arange(kw, dtype=np.int64), indexing="ij")
    return ci.reshape(-1), ky.reshape(-1), kx.reshape(-1)


_PADDED = threading.local()
#: Padded images a thread keeps a buffer for (a model has one stem, and a few dozen deep convs
#: on small maps: 10-900 KB each).
PADDED_SHAPES = 32


def padded_input(shape: tuple[int, ...], top: int, left: int, x_shape: tuple[int, ...], x: np.ndarray,
                 phases: int = 1) -> np.ndarray:
    """``x`` copied into this thread's zero-padded image buffer of ``shape``, ``top`` rows and
    ``left`` columns from its corner, each row stored as its ``phases`` phases (padded column
    ``phases·j + f`` at ``f·W/phases + j``). The buffer is kept for the same shape and place of ``x``, so
    its border stays zero between runs and a run copies only the input into it
    (`compiled.direct.copy_inside`: writing the border too took 4x as long on a 224x224 image)."""
    source = np.ascontiguousarray(x)
    if source.shape != x_shape:  # (a new view only where needed: NumPy calls cost µs each, cold)
        source = source.reshape(x_shape)
    if shape == x_shape and phases == 1:  # (no padding, nothing read past the input: read it in place)
        return source
    buffers = getattr(_PADDED, "buffers", None)
    if buffers is None:
        buffers = _PADDED.buffers = {}
    key = (shape, top, left, x_shape, phases)
    buffer = buffers.get(key)
    if buffer is None:  # (the oldest shape makes way: a model of more shapes pads some twice a run)
        buffer = np.zeros(shape, np.float32)
        while len(buffers) >= PADDED_SHAPES:
            del buffers[next(iter(buffers))]
        buffers[key] = buffer
    copy_inside(source, buffer, top, left, phases)
    return buffer


def run_direct(plan: DirectPlan, x: np.ndarray) -> np.ndarray:
    """The conv of ``x`` (the plan's input shape) as planned: a fresh (N, M, Ho, Wo) array."""
    padded = padded_input(plan.padded, plan.top, plan.left, plan.x_shape, x, plan.stride)
    n, m, ho, wo = plan.y_shape
    y = np.empty(plan.y_shape, np.float32)
    flat = y.reshape(n, m, ho * wo)
    padded_m = plan.columns.shape[1]
    epilogue = plan.epilogue
    # each thread's scratch: a row's last positions (tail), a block past the last channel (spare)
    size = padded_m * LANES + BLOCK_ROWS * WIDE_VECTORS * LANES
    own = scratch((size,), np.float32, "direct_scratch")
    tail, spare = own[:padded_m * LANES].reshape(padded_m, LANES), own[padded_m * LANES:].reshape(BLOCK_ROWS, -1)
    helpers = len(plan.parts) - 1
    team = parallel.team(DIRECT_PART) if plan.team else None
    control = None if team is None or helpers > team.helpers else team.claim()
    if control is None:  # alone, or the team busy (every core is): all the rows here, in one call
        direct_conv(plan.columns, padded, plan.offsets, flat, plan.bias, tail, spare, plan.parts[0][0],
                    plan.parts[-1][1], ho, wo, plan.stride, epilogue.kind, epilogue.a, epilogue.b)
        return y
    try:
        buffers = team.scratch((helpers, size), np.float32)  # type: ignore[union-attr]
        status = post_and_finish_direct(control, plan.columns, padded, plan.offsets, flat, plan.bias, buffers, tail,
                                        spare, plan.numbers, plan.bounds, ho, wo, plan.stride, epilogue.kind,
                                        spin_team.WAIT_ROUNDS)
        if status != spin_team.PARTS_DONE:  # (the common case: nothing to settle, no tuple built)
            team.settle(status, finish_direct,  # type: ignore[union-attr]
                        (control, plan.columns, padded, plan.offsets, flat, plan.bias, tail, spare, plan.bounds,
                         ho, wo, plan.stride, epilogue.kind, epilogue.a, epilogue.b, spin_team.WAIT_ROUNDS), helpers)
    finally:
        team.release()  # type: ignore[union-attr]
    return y


def takes_direct_panels(x_shape: tuple[int, ...], w_shape: tuple[int, ...], group: int, strides: tuple[int, ...],
                        out: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether a 2-D conv with output map ``out`` runs on `compiled.direct_panels`: float32, one
    group, a window larger than 1x1 of at least `PANEL_MIN_DEPTH` taps (C·kh·kw), strides of at
    most `PANEL_MAX_STRIDE` or at most `PANEL_FEW_POSITIONS` output positions."""
    return (dtype == np.float32 and len(x_shape) == 4 and group == 1 and tuple(w_shape[2:]) != (1, 1)
            and math.prod(w_shape[1:]) >= PANEL_MIN_DEPTH
            and (max(strides) <= PANEL_MAX_STRIDE or math.prod(out) <= PANEL_FEW_POSITIONS))


@dataclass(frozen=True)
class PanelPlan:
    """What `run_direct_panels` does with an input: the operands and the parts of
    `direct_panel_conv`."""

    x_shape: tuple[int, ...]            # (N, C, H, W)
    y_shape: tuple[int, ...]            # (N, M, Ho, Wo)
    padded: tuple[int, ...]             # (N, C, Hp, Wp): the zero-padded input
    top: int                            # its rows and columns of padding before the input's
    left: int
    panels: np.ndarray                  # (P, T, W): `direct_panels.pack_joined_taps` of the weights
    bias: np.ndarray                    # (P·W,), zero past M (and where there is none)
    tap_sets: np.ndarray                # (S, T) int64: each conv's taps' offsets in a padded image
    panel_taps: np.ndarray              # (P, 2) int64: each panel's conv (row of tap_sets) and taps
    strides: tuple[int, int]
    epilogue: Epilogue
    numbers: np.ndarray                 # the epilogue's (a, b), float64, for helpers
    parts: tuple[tuple[int, int, int, int], ...]  # (u0, u1, q0, q1): units (panels x rows) of a band of rows
    bounds: np.ndarray                  # the parts as an int64 (parts, 4) array, for the team's posts
    team: bool                          # offered to the spinning helpers


@dataclass(frozen=True)
class PanelConv:
    """One of the convs of one input a `PanelPlan` runs side by side (`joined_panel_plan`)."""

    weight: np.ndarray                  # (M, C, kh, kw)
    bias: np.ndarray | None             # (M,)
    dilations: tuple[int, ...]
    begin: tuple[int, ...]              # its pads before the input's first row and column


#: What a unit of `direct_panel_conv` costs besides its taps, in taps: its blocks' transposed
#: stores (8 positions x `PANEL_WIDTH` channels) and the loop around them. Weighs the parts of a
#: joined conv, whose panels sum 16 to 576 taps each.
UNIT_OVERHEAD_TAPS = 16


def panel_plan(x_shape: tuple[int, ...], w: np.ndarray, b: np.ndarray | None, strides: tuple[int, ...],
               dilations: tuple[int, ...], begin: tuple[int, ...], out: tuple[int, ...], epilogue: Epilogue,
               keep: KeepWeights = keep_nothing) -> PanelPlan:
    """The `PanelPlan` of a conv `takes_direct_panels` accepts, ``w`` (M, C, kh, kw), ``b`` (M,)
    or None; ``keep`` keeps the packed weights between runs (a model's constants)."""
    return joined_panel_plan(x_shape, [PanelConv(w, b, tuple(dilations), tuple(begin))], strides, out, epilogue,
                             keep)


def joined_panel_plan(x_shape: tuple[int, ...], convs: Sequence[PanelConv], strides: tuple[int, ...],
                      out: tuple[int, ...], epilogue: Epilogue, keep: KeepWeights = keep_nothing) -> PanelPlan:
    """The `PanelPlan` of ``convs`` of one input at the same ``strides`` onto the same output map
    ``out``, their results one after another along the channels (their Concat): one padded copy
    of the input, as far as the widest window reaches; each conv's panels sum its own taps
    (every conv's output channels but the last's fill whole panels: `pack_joined_taps`)."""
    n, c, h, wd = x_shape
    ho, wo = out
    panels = keep("direct_panels", lambda: pack_joined_taps([conv.weight for conv in convs]))
    top, left = max(conv.begin[0] for conv in convs), max(conv.begin[1] for conv in convs)
    hp, wp = top + h, left + wd
    for conv in convs:  # as tall and wide as the last window reaches
        kh, kw = conv.weight.shape[2:]
        hp = max(hp, top - conv.begin[0] + (ho - 1) * strides[0] + (kh - 1) * conv.dilations[0] + 1)
        wp = max(wp, left - conv.begin[1] + (wo - 1) * strides[1] + (kw - 1) * conv.dilations[1] + 1)
    tap_sets = np.zeros((len(convs), panels.shape[1]), np.int64)
    panel_taps = np.zeros((panels.shape[0], 2), np.int64)
    bias = np.zeros(panels.shape[0] * PANEL_WIDTH, np.float32)
    channel = macs = 0
    for i, conv in enumerate(convs):
        m, _, kh, kw = conv.weight.shape
        ci, ky, kx = _taps(c, kh, kw)
        tap_sets[i, :ci.size] = ((ci * hp + top - conv.begin[0] + ky * conv.dilations[0]) * wp
                                 + left - conv.begin[1] + kx * conv.dilations[1])
        panel_taps[channel // PANEL_WIDTH:-(-(channel + m) // PANEL_WIDTH)] = (i, ci.size)
        if conv.bias is not None:
            bias[channel:channel + m] = conv.bias
        channel += m
        macs += n * m * ci.size * ho * wo
    team = macs >= TEAM_MIN_MACS
    parts = _panel_parts(panel_taps, n * ho, parallel.team_size() if team else 1, panels.nbytes, 4 * n * c * hp * wp)
    return PanelPlan(tuple(x_shape), (n, channel, ho, wo), (n, c, hp, wp), top, left, panels, bias, tap_sets,
                     panel_taps, (int(strides[0]), int(strides[1])), epilogue, epilogue.numbers,
                     parts, np.array(parts, np.int64).reshape(-1, 4), team and len(parts) > 1)


#: `direct_panel_conv` splits rows between threads only where they share the work this evenly
#: (the slowest part's share of an even one): else units of panels x rows cut anywhere.
ROWS_EXCESS = 1.05


def _panel_parts(panel_taps: np.ndarray, rows: int, count: int, weight_bytes: int,
                 input_bytes: int) -> tuple[tuple[int, int, int, int], ...]:
    """`direct_panel_conv`'s parts (u0, u1, q0, q1) for ``count`` threads: a band of the output
    rows each, every panel, where the padded input outweighs the packed weights and the rows
    divide evenly enough (`ROWS_EXCESS`): each thread then reads only its rows' input (ResNet's
    3x3/2 128 -> 128 from 56x56, its 1.7 MB input read whole by each of two threads, ran 1.22x as
    fast on two cores as on one, now 1.7x); else ranges of the units (panels x every row, panel
    after panel), cut where the taps summed (and each unit's stores) are shared evenly: a joined
    conv's panels of a 1x1 conv take a ninth of the time of its 3x3's (and ResNet's 512 -> 512
    at 7x7 has 9.4 MB of weights, 100 KB of input: each thread reads only its panels')."""
    total = panel_taps.shape[0]
    if count > 1 and rows >= count and input_bytes >= weight_bytes and -(-rows // count) * count <= ROWS_EXCESS * rows:
        bands = [rows * i // count for i in range(count + 1)]
        return tuple((0, total * (bands[i + 1] - bands[i]), bands[i], bands[i + 1]) for i in range(count))
    units = total * rows
    count = min(count, units)
    work = np.concatenate([[0], np.cumsum(np.repeat(panel_taps[:, 1] + UNIT_OVERHEAD_TAPS, rows))])
    cuts = [int(np.searchsorted(work, work[-1] * i / count, side="right")) - 1 for i in range(count)] + [units]
    return tuple((cuts[i], cuts[i + 1], 0, rows) for i in range(count) if cuts[i] < cuts[i + 1])


def run_direct_panels(plan: PanelPlan, x: np.ndarray) -> np.ndarray:
    """The conv of ``x`` (the plan's input shape) as planned: a fresh (N, M, Ho, Wo) array."""
    padded = padded_input(plan.padded, plan.top, plan.left, plan.x_shape, x)
    n, m, ho, wo = plan.y_shape
    y = np.empty(plan.y_shape, np.float32)
    flat = y.reshape(n, m, ho * wo)
    epilogue = plan.epilogue
    sh, sw = plan.strides
    own = scratch((BLOCK_POSITIONS, PANEL_WIDTH), np.float32, "direct_panel_block")
    helpers = len(plan.parts) - 1
    team = parallel.team(PANELS_PART) if plan.team else None
    control = None if team is None or helpers > team.helpers else team.claim()
    if control is None:  # (a small conv, or the team busy: every core is, so every unit here, in one call)
        direct_panel_conv(plan.panels, padded, plan.tap_sets, plan.panel_taps, flat, plan.bias, own, 0,
                          plan.panels.shape[0] * n * ho, 0, n * ho, ho, wo, sh, sw, epilogue.kind, epilogue.a,
                          epilogue.b)
        return y
    try:
        blocks = team.scratch((helpers, BLOCK_POSITIONS, PANEL_WIDTH), np.float32)  # type: ignore[union-attr]
        status = post_and_finish_panels(control, plan.panels, padded, plan.tap_sets, plan.panel_taps, flat,
                                        plan.bias, blocks, own, plan.numbers, plan.bounds, ho, wo, sh, sw,
                                        epilogue.kind, spin_team.WAIT_ROUNDS)
        if status != spin_team.PARTS_DONE:  # (the common case: nothing to settle, no tuple built)
            team.settle(status, finish_panels,  # type: ignore[union-attr]
                        (control, plan.panels, padded, plan.tap_sets, plan.panel_taps, flat, plan.bias, own,
                         plan.bounds, ho, wo, sh, sw, epilogue.kind, epilogue.a, epilogue.b, spin_team.WAIT_ROUNDS),
                        helpers)
    finally:
        team.release()  # type: ignore[union-attr]
    return y
