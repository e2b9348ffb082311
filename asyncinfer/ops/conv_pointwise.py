"""1x1 convs of float32 on GEMMs of their own (`compiled.pointwise`), bias and activation done in
registers, shared with the CPU backend's spinning helpers.

A 1x1 conv is a GEMM: most of a ResNet-50's multiply-adds (its bottlenecks' 1x1 convs) and
a third to a half of MobileNet's, EfficientNet's and ShuffleNet's. Run as BLAS's sgemm then a pass
for the bias and the activation, ResNet-50's took about twice ONNX Runtime's time (a 256 -> 64
1x1 at 56x56: 0.8-1.1 ms against 0.49). Both kernels here sum a block of 8 x 32 results in
vector registers over the whole depth (about 105 GF/s a core on AVX-512, where sgemm makes 95)
and apply the bias and the activation before the store:

- `pointwise_conv` on maps of some size: blocks of output channels x a panel of 32 positions,
  read in place from the input at unit stride (a map's last panel packed, padded, computed and
  dropped; a strided conv's panels packed);
- `small_map_conv` for deep inputs on small maps (ResNet-50's 14x14 and 7x7 stages): blocks of
  8 positions x a panel of 32 output channels, the weights packed into panels once, the input
  read in place, each block stored transposed: no wasted column.

`pointwise_plan` works out once per shape what `run_pointwise` then does each run: the kernel,
the weights' form (kept between runs through ``keep``, as the depthwise loops keep their taps),
the epilogue, and the parts: one per image where there are enough images, else ranges of whole
panels (of positions, or of channels), else (`pointwise_conv` on a map of a few panels) bands of
output channels; this thread takes one and each free spinning helper another. Small maps split
by panels of channels where those divide evenly, else by blocks of 8 positions (a 96-channel 1x1
on 7x7 has three panels: a third against two thirds waited on the slower half). Each run posts
the helpers' parts, runs its own and waits in compiled code (`compiled.pointwise.post_pointwise`,
`finish_pointwise`): arguments built in Python cost 6-10 µs a layer, a fifth of a MobileNet 1x1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..concurrency import parallel, spin_team
from .compiled.epilogue import NONE, RELU
from .compiled.panels import BLOCK_ROWS, panel_width
from .compiled.pointwise import PART_KIND as POINTWISE_PART
from .compiled.pointwise import SMALL_MAP_PART_KIND as SMALL_MAP_PART
from .compiled.pointwise import (finish_pointwise, finish_small_map, pack_weights, pointwise_buffer_size,
                                 pointwise_parts, post_and_finish_pointwise, post_and_finish_small_map,
                                 small_map_parts)
from .conv_kernels import KeepWeights, keep_nothing, scratch
from .epilogue import Epilogue

#: From this many multiply-adds a 1x1 conv is shared with the spinning helpers (a GEMM's
#: `linalg.TEAM_MIN_MACS` is 1 M): its parts are posted and waited for in compiled code, a few
#: microseconds against the 10-40 µs of MobileNetV3's and ShuffleNet's 1x1s of 0.3-1 M. In one
#: process, 300 k against 1 M: MobileNetV3-small 0.955x, SSDlite 0.977x, ShuffleNet 0.979x (150 k:
#: no further gain).
TEAM_MIN_MACS = 300_000
#: Fewest output positions an image for these kernels: any. `MAX_WASTE` keeps `pointwise_conv` off
#: maps under 24 positions, and `small_map_conv` takes the smaller ones where its channels waste
#: less of its panels (`_small_map`): SSDlite's extra layers and heads on 3x3 to 1x1 maps, left
#: to BLAS below 16 positions before, in one process 0.93-0.96x. And the most `pointwise_conv` may
#: compute per position it keeps: a map's last panel is padded, computed and dropped (at 7x7, 64
#: columns for 49: 1.31).
MIN_POSITIONS = 1
MAX_WASTE = 1.35
#: Which kernel: `small_map_conv` (positions as the blocks' rows, channels as the panels, each
#: block stored transposed) from this input depth a group on maps of at most `SMALL_MAP`
#: positions, where its 256 scalar stores a block are few against the block's multiply-adds and
#: no column is wasted. Measured on one core: ResNet-50's 1024 -> 256 at 14x14 1.06 ms against
#: `pointwise_conv`'s 1.43, 512 -> 2048 at 7x7 1.22 against 2.32 (BLAS and a pass 1.73), its 256
#: -> 64 at 56x56 454 against 515 µs; a 24 -> 72 at 28x28 0.071 against 0.037. Shallower than
#: this, the waste rule below decides: SqueezeNet's 256 -> 48 and 384 -> 48 at 13x13 (a panel and
#: a half of 32 channels: 64 computed for 48) took 81 and 104 µs here against `pointwise_conv`'s
#: 72 and 97 (one core, from 256 on before), its 384 -> 64 and 512 -> 64 the same either way.
SMALL_MAP_DEPTH = 512
SMALL_MAP = 4096
#: ... and from `SMALL_MAP_WASTE_DEPTH` on, the maps where it wastes less of its panels of output
#: channels than `pointwise_conv` would of its panels of positions, counting its blocks as
#: `SMALL_MAP_DEEP_COST` of the others' from `SMALL_MAP_DEEP` input channels on (EfficientNet's
#: and MobileNetV3's expansions on 7x7 and 14x14 maps: 64 columns for 49 positions, 224 for 196,
#: against whole panels of 576-1152 channels). One core: 192 -> 1152 at 7x7 126 -> 110 µs, 96 ->
#: 576 at 7x7 34 -> 27, 112 -> 672 at 14x14 140 -> 123, 128 -> 512 at 28x28 500 -> 421, 64 -> 256
#: at 56x56 472 -> 424; shallower inputs lose their transposed stores' cost (24 -> 144 at 14x14 10
#: against 12), and few channels their panel's padding (144 -> 24 at 56x56 101 against 162).
SMALL_MAP_WASTE_DEPTH = 32
SMALL_MAP_DEEP = 64
SMALL_MAP_DEEP_COST = 0.9


def takes_pointwise(x_shape: tuple[int, ...], w_shape: tuple[int, ...], group: int, begin: tuple[int, ...],
                    end: tuple[int, ...], out: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether a 2-D conv runs on `compiled.pointwise`: float32, 1x1 kernel, not depthwise, no
    padding, at least `MIN_POSITIONS` output positions an image, and either `_small_map` or whole
    panels but for `MAX_WASTE`."""
    positions, width = math.prod(out), panel_width(np.float32)
    return (dtype == np.float32 and len(x_shape) == 4 and w_shape[2:] == (1, 1) and (group == 1 or w_shape[1] > 1)
            and not any(begin) and not any(end) and positions >= MIN_POSITIONS
            and (_small_map(w_shape[1], positions, w_shape[0] // group)
                 or -(-positions // width) * width <= MAX_WASTE * positions))


def _small_map(depth: int, positions: int, channels: int) -> bool:
    """Whether a 1x1 conv of ``depth`` input and ``channels`` output channels a group on a map of
    ``positions`` takes `small_map_conv` (`SMALL_MAP_DEPTH`, `SMALL_MAP_WASTE_DEPTH`)."""
    if positions > SMALL_MAP:
        return False
    if depth >= SMALL_MAP_DEPTH:
        return True
    width = panel_width(np.float32)
    cost = SMALL_MAP_DEEP_COST if depth >= SMALL_MAP_DEEP else 1.0
    return (depth >= SMALL_MAP_WASTE_DEPTH
            and -(-channels // width) * positions * cost < -(-positions // width) * channels)


@dataclass(frozen=True)
class PointwisePlan:
    """What `run_pointwise` does with an input: the operands and the parts of `pointwise_conv`,
    or of `small_map_conv`."""

    x_shape: tuple[int, int, int]       # (N, C, H·W), as the kernels read it
    y_shape: tuple[int, ...]            # (N, M, Ho, Wo)
    small_map: bool                     # `small_map_conv`, else `pointwise_conv`
    weights: np.ndarray                 # each group's weights transposed (G, C/G, M/G), or in panels
    bias: np.ndarray                    # (M,), or (G, panels' width) for `small_map_conv`: zeros where none
    epilogue: Epilogue
    geometry: tuple[int, int, int, int]  # in_width, out_width, sh, sw
    parts: np.ndarray                   # int64 rows (i0, i1, v0, v1, m0, m1), or (i0, i1, q0, q1, r0, r1)
    panels: int                         # `pointwise_conv`: panels of the widest part
    buffer: int                         # float32 values of one part's scratch
    team: bool                          # offered to the spinning helpers
    shuffled: bool                      # channels stored in a channel shuffle's order (`compiled.pointwise`)


def pointwise_plan(x_shape: tuple[int, ...], w: np.ndarray, b: np.ndarray | None, group: int,
                   strides: tuple[int, ...], out: tuple[int, ...], epilogue: Epilogue,
                   keep: KeepWeights = keep_nothing, shuffled: bool = False) -> PointwisePlan:
    """The `PointwisePlan` of a conv `takes_pointwise` accepts, ``w`` (M, C/group, 1, 1), ``b``
    (M,) or None; ``keep`` keeps the weights' form between runs (a model's constants);
    ``shuffled``: the output's channels in the order of a channel shuffle of ``group`` groups
    (`fused.ShuffledConv`)."""
    n, c, h, wd = x_shape
    m, cg = w.shape[:2]
    mg = m // group
    ho, wo = out
    span = ho * wo
    width = panel_width(np.float32)
    small = _small_map(cg, span, mg)

    def transposed() -> np.ndarray:
        return np.ascontiguousarray(w.reshape(group, mg, cg).transpose(0, 2, 1), dtype=np.float32)
    weights = keep("pointwise_panels", lambda: pack_weights(transposed())) if small else \
        keep("pointwise", transposed)
    bias = np.zeros(m, np.float32) if b is None else np.ascontiguousarray(b, dtype=np.float32)
    team = n * m * cg * span >= TEAM_MIN_MACS
    count = parallel.team_size() if team else 1
    panels = 0
    if small:
        parts = _small_map_parts(n, group * weights.shape[1], span, count, 4 * c * span, mg % width == 0)
        padded = np.zeros((group, weights.shape[1] * width), np.float32)
        padded[:, :mg] = bias.reshape(group, mg)
        bias = padded
        buffer = cg * span  # a strided conv's gathered input
    else:
        parts = _panel_parts(n, span, m, count, width)
        panels = max(-(-(part[3] - part[2]) // width) for part in parts)
        buffer = pointwise_buffer_size(panels, cg, m)
    return PointwisePlan((n, c, h * wd), (n, m, ho, wo), small, weights, bias, epilogue, (wd, wo, *strides),
                         np.array(parts, np.int64).reshape(-1, 6), panels, buffer, team and len(parts) > 1, shuffled)


def _panel_parts(n: int, span: int, m: int, count: int, width: int) -> list[tuple[int, ...]]:
    """`pointwise_conv`'s parts (i0, i1, v0, v1, m0, m1) for ``count`` threads: images, else
    ranges of whole panels of positions (the last one's partial panel with the fewest) or bands
    of output channels, whichever leaves the largest part the smaller share of the work (panels
    of positions on a tie; bands where the map has a few panels), else one. (A 14x14 map is 7
    panels, 4 against 3: ShuffleNet's grouped 272 -> 272 1x1 at 14x14 in bands of channels on
    two cores, alone and hot, 40-42 -> 37 µs.)"""
    if count == 1 or n >= count:
        cuts = [n * i // count for i in range(count + 1)]
        return [(cuts[i], cuts[i + 1], 0, span, 0, m) for i in range(count)]
    total, blocks = -(-span // width), -(-m // BLOCK_ROWS)
    by_positions = span >= 2 * count * width
    by_channels = m >= 2 * count * BLOCK_ROWS
    if by_positions and by_channels:  # each the larger part's share of the work
        by_positions = -(-total // count) * blocks <= -(-blocks // count) * total
    if by_positions:
        cuts = [-(-total * i // count) * width for i in range(count)] + [span]
        return [(0, n, cuts[i], cuts[i + 1], 0, m) for i in range(count)]
    if by_channels:
        cuts = [m * i // count // BLOCK_ROWS * BLOCK_ROWS for i in range(count)] + [m]
        return [(0, n, 0, span, cuts[i], cuts[i + 1]) for i in range(count)]
    return [(0, n, 0, span, 0, m)]


#: `small_map_conv` splits by positions in blocks of this many (its register blocks' rows).
POSITION_BLOCK = 8
#: ... and by panels of channels, every thread reading the whole input, where that input is at
#: most this many bytes and the panels are whole and divide evenly: the input then comes from
#: the cores' caches (its producer's threads wrote it) and each thread's blocks read fewer of its
#: lines than the positions' split does. SqueezeNet's 512 -> 64 and 384 -> 64 at 13x13 (346 and
#: 260 KB of input) on two cores in the model's run: 74-78 -> 68-70 and 62-63 -> 54-55 µs; at 512
#: KB, ResNet-50's 128 -> 512 at 28x28 (401 KB) took 3-12 µs longer (of 415-475) so.
PANELS_INPUT_BYTES = 384 << 10


def _small_map_parts(n: int, total: int, span: int, count: int, input_bytes: int = 0,
                     whole_panels: bool = False) -> list[tuple[int, ...]]:
    """`small_map_conv`'s parts (i0, i1, q0, q1, r0, r1) for ``count`` threads over ``total``
    panels of output channels on ``span`` positions, reading ``input_bytes`` (``whole_panels``:
    no panel has unused channels): images, else panels where they divide evenly or are many and
    the weights are the larger operand (each thread then reads only its panels' weights:
    ResNet-50's 512 -> 2048 at 7x7 has 4 MB) or the input is small (`PANELS_INPUT_BYTES`), else
    blocks of `POSITION_BLOCK` positions, every panel (three panels of 96 channels: 1 against 2;
    and a map larger than its panels of weights, each thread then reading only its positions'
    input: ResNet-50's 256 -> 64 at 56x56, whose two panels each read the whole 3.2 MB input
    took as long on two cores as on one)."""
    if count == 1 or n >= count:
        cuts = [n * i // count for i in range(count + 1)]
        return [(cuts[i], cuts[i + 1], 0, total, 0, span) for i in range(count)]
    even = total % count == 0
    if ((even or total >= 8 * count) and span <= total * panel_width(np.float32)
            or even and whole_panels and input_bytes <= PANELS_INPUT_BYTES):
        cuts = [total * i // count for i in range(count + 1)]
        return [(0, n, cuts[i], cuts[i + 1], 0, span) for i in range(count) if cuts[i] < cuts[i + 1]]
    blocks = -(-span // POSITION_BLOCK)
    cuts = [min(span, blocks * i // count * POSITION_BLOCK) for i in range(count)] + [span]
    return [(0, n, 0, total, cuts[i], cuts[i + 1]) for i in range(count) if cuts[i] < cuts[i + 1]]


#: `run_pointwise`'s residual when there is none (the kernels' argument is a typed array).
_NO_RESIDUAL = np.empty((0, 0, 0), np.float32)


#: The largest output map (positions an image) whose conv adds a residual in its stores
#: (`adds_residual`). Each block then reads its 32 channels' residual rows beside the output rows it
#: writes, and on a large map a panel's pass over its positions is that many more streams than
#: the prefetchers follow: one core, hot, ResNet-50's 64 -> 256 at 56x56 with its residual 1471
#: µs in the stores against 1335 as the conv then a NumPy add; at 28x28 867 against 898, 14x14
#: 686 / 707, 7x7 700 / 741 (in ResNet-50's run on two cores, 14x14 393 against 428 µs with the
#: Add's own pass).
RESIDUAL_MAX_POSITIONS = 1024


def adds_residual(plan: PointwisePlan, over_residual: bool = False) -> bool:
    """Whether `run_pointwise` can add a residual map to this plan's conv as it stores it: a map
    of at most `RESIDUAL_MAX_POSITIONS`, unshuffled, an epilogue (then the Add's, after the sum)
    of none or a Relu. With ``over_residual`` (the result written over the residual), on
    `small_map_conv` (whose blocks then each read and write their own positions) on a map of any
    size: a block reads the lines it writes, no more streams than the conv alone, and no line of
    the output is read from memory only to be written. In ResNet-50's run on two cores
    (`worker.profile()`, two processes each): its 64 -> 256 residual layers at 56x56
    567/525/517 -> 423/420/405 µs and 530/510/468 -> 388/381/374 against the conv then the
    Add's own pass, the 128 -> 512 ones at 28x28 482/468/473/478 -> 413/400/411/404 and
    441/420/445/435 -> 379/370/374/381 against the residual added into a map of their own; at
    14x14 about 3% less, at 7x7 the same."""
    if plan.shuffled or plan.epilogue.kind not in (NONE, RELU):
        return False
    if over_residual:
        return plan.small_map
    return plan.y_shape[2] * plan.y_shape[3] <= RESIDUAL_MAX_POSITIONS


def run_pointwise(plan: PointwisePlan, x: np.ndarray, residual: np.ndarray | None = None,
                  over_residual: bool = False) -> np.ndarray:
    """The conv of ``x`` (the plan's input shape) as planned: a fresh (N, M, Ho, Wo) array (its
    channels shuffled where the plan says). With ``residual`` (float32, C-contiguous, the
    output's shape; only where `adds_residual`), ``act(conv + residual)``: the plan's epilogue
    then is the residual Add's activation, applied after the sum (`compiled.pointwise`); with
    ``over_residual`` too (only where `adds_residual` says so), written over ``residual``, which
    is returned (the caller owns it, and nothing else reads it: not ``x`` either)."""
    x = np.ascontiguousarray(x).reshape(plan.x_shape)
    y = residual if over_residual and residual is not None else np.empty(plan.y_shape, np.float32)
    flat = y.reshape(plan.y_shape[0], plan.y_shape[1], -1)
    extra = _NO_RESIDUAL if residual is None else residual.reshape(flat.shape)
    epilogue, parts = plan.epilogue, plan.parts
    own = scratch((plan.buffer,), np.float32, "pointwise")
    team = parallel.team(SMALL_MAP_PART if plan.small_map else POINTWISE_PART) if plan.team else None
    control = None if team is None or len(parts) - 1 > team.helpers else team.claim()
    if control is None:  # alone, or the team busy (every core is): every part here
        if plan.small_map:
            small_map_parts(plan.weights, x, flat, plan.bias, own.reshape(plan.weights.shape[2], -1), extra, parts, 0,
                            *plan.geometry, epilogue.kind, epilogue.a, epilogue.b, plan.shuffled)
        else:
            pointwise_parts(plan.weights, x, flat, plan.bias, own, extra, parts, 0, plan.panels, *plan.geometry,
                            epilogue.kind, epilogue.a, epilogue.b, plan.shuffled)
        return y
    try:
        helpers = team.scratch((len(parts) - 1, plan.buffer), np.float32)  # type: ignore[union-attr]
        if plan.small_map:
            c = plan.weights.shape[2]
            columns = own.reshape(c, -1)
            status = post_and_finish_small_map(control, plan.weights, x, flat, plan.bias,
                                               helpers.reshape(len(parts) - 1, c, -1), columns, extra,
                                               epilogue.numbers, parts, *plan.geometry, epilogue.kind, plan.shuffled,
                                               spin_team.WAIT_ROUNDS)
            if status != spin_team.PARTS_DONE:  # (the common case: nothing to settle, no tuple built)
                team.settle(status, finish_small_map,  # type: ignore[union-attr]
                            (control, plan.weights, x, flat, plan.bias, columns, extra, parts, *plan.geometry,
                             epilogue.kind, epilogue.a, epilogue.b, plan.shuffled, spin_team.WAIT_ROUNDS),
                            len(parts) - 1)
        else:
            status = post_and_finish_pointwise(control, plan.weights, x, flat, plan.bias, helpers, own, extra,
                                               epilogue.numbers, parts, plan.panels, *plan.geometry, epilogue.kind,
                                               plan.shuffled, spin_team.WAIT_ROUNDS)
            if status != spin_team.PARTS_DONE:  # (the common case: nothing to settle, no tuple built)
                team.settle(status, finish_pointwise,  # type: ignore[union-attr]
                            (control, plan.weights, x, flat, plan.bias, own, extra, parts, plan.panels,
                             *plan.geometry, epilogue.kind, epilogue.a, epilogue.b, plan.shuffled,
                             spin_team.WAIT_ROUNDS),
                            len(parts) - 1)
    finally:
        team.release()  # type: ignore[union-attr]
    return y
