"""1x1 convs of float32 on GEMMs of their own (`compiled.pointwise`), bias and activation done in
registers, shared with the CPU backend's spinning helpers.

A 1x1 conv is a GEMM: most of a ResNet-50's multiply-adds (its bottlenecks' 1x1 convs) and
a third to a half of MobileNet's, EfficientNet's and ShuffleNet's. Run as BLAS's sgemm then a pass
for the bias and the activation, ResNet-50's took about twice ONNX Runtime's time (a 256 -> 64
1x1 at 56x56: 0.8-1.1 ms against 0.49). Both kernels here sum a block of 8 x 32 results in
vector registers over the whole depth (about 105 GF/s a core on AVX-512, where sgemm makes 95)
and apply the bias and the activation before the store:

- `pointwise_conv` on maps of some size: blocks of output channels x a panel of 32 positions,
  packed from the input per run (a map's last panel padded, computed and dropped);
- `small_map_conv` for deep inputs on small maps (ResNet-50's 14x14 and 7x7 stages): blocks of
  8 positions x a panel of 32 output channels, the weights packed into panels once, the input
  read in place, each block stored transposed: no wasted column.

`pointwise_plan` works out once per shape what `run_pointwise` then does each run: the kernel,
the weights' form (kept between runs through ``keep``, as the depthwise loops keep their taps),
the epilogue, and the parts: one per image where there are enough images, else ranges of whole
panels (of positions, or of channels), else (`pointwise_conv` on a map of a few panels) bands of
output channels; this thread takes one and each free spinning helper another.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..concurrency import parallel
from .compiled.panels import BLOCK_ROWS, panel_width
from .compiled.pointwise import pack_weights, part_arguments, pointwise_conv, small_map_arguments, small_map_conv
from .conv_kernels import KeepWeights, keep_nothing, scratch
from .epilogue import Epilogue
from .linalg import TEAM_MIN_MACS

#: Fewest output positions for the panel GEMMs (a squeeze-and-excitation 1x1 on a 1x1 map is left
#: to BLAS), and the most `pointwise_conv` may compute per position it keeps: a map's last panel
#: is padded, computed and dropped (at 7x7, 64 columns for 49: 1.31).
MIN_POSITIONS = panel_width(np.float32) // 2
MAX_WASTE = 1.35
#: Which kernel: `small_map_conv` (positions as the blocks' rows, channels as the panels, each
#: block stored transposed) from this input depth a group on maps of at most `SMALL_MAP`
#: positions, where its 256 scalar stores a block are few against the block's multiply-adds and
#: no column is wasted. Measured on one core: ResNet-50's 1024 -> 256 at 14x14 1.06 ms against
#: `pointwise_conv`'s 1.43, 512 -> 2048 at 7x7 1.22 against 2.32 (BLAS and a pass 1.73); a 24 ->
#: 72 at 28x28 0.071 against 0.037.
SMALL_MAP_DEPTH = 256
SMALL_MAP = 1024


def takes_pointwise(x_shape: tuple[int, ...], w_shape: tuple[int, ...], group: int, begin: tuple[int, ...],
                    end: tuple[int, ...], out: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether a 2-D conv runs on `compiled.pointwise`: float32, 1x1 kernel, not depthwise, no
    padding, at least `MIN_POSITIONS` output positions an image, and either `_small_map` or whole
    panels but for `MAX_WASTE`."""
    positions, width = math.prod(out), panel_width(np.float32)
    return (dtype == np.float32 and len(x_shape) == 4 and w_shape[2:] == (1, 1) and (group == 1 or w_shape[1] > 1)
            and not any(begin) and not any(end) and positions >= MIN_POSITIONS
            and (_small_map(w_shape[1], positions) or -(-positions // width) * width <= MAX_WASTE * positions))


def _small_map(depth: int, positions: int) -> bool:
    return depth >= SMALL_MAP_DEPTH and positions <= SMALL_MAP


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
    numbers: np.ndarray                 # the epilogue's (a, b), float64, for helpers
    geometry: tuple[int, int, int, int]  # in_width, out_width, sh, sw
    parts: tuple[tuple[int, ...], ...]  # (i0, i1, v0, v1, m0, m1) each, or (i0, i1, q0, q1)
    panels: int                         # `pointwise_conv`: panels of the widest part
    team: bool                          # offered to the spinning helpers


def pointwise_plan(x_shape: tuple[int, ...], w: np.ndarray, b: np.ndarray | None, group: int,
                   strides: tuple[int, ...], out: tuple[int, ...], epilogue: Epilogue,
                   keep: KeepWeights = keep_nothing) -> PointwisePlan:
    """The `PointwisePlan` of a conv `takes_pointwise` accepts, ``w`` (M, C/group, 1, 1), ``b``
    (M,) or None; ``keep`` keeps the weights' form between runs (a model's constants)."""
    n, c, h, wd = x_shape
    m, cg = w.shape[:2]
    mg = m // group
    ho, wo = out
    span = ho * wo
    width = panel_width(np.float32)
    small = _small_map(cg, span)

    def transposed() -> np.ndarray:
        return np.ascontiguousarray(w.reshape(group, mg, cg).transpose(0, 2, 1), dtype=np.float32)
    weights = keep("pointwise_panels", lambda: pack_weights(transposed())) if small else \
        keep("pointwise", transposed)
    bias = np.zeros(m, np.float32) if b is None else np.ascontiguousarray(b, dtype=np.float32)
    team = n * m * cg * span >= TEAM_MIN_MACS
    count = parallel.team_size() if team else 1
    panels = 0
    if count == 1 or n >= count:
        cuts = [n * i // count for i in range(count + 1)]
        whole = (0, group * weights.shape[1]) if small else (0, span, 0, m)
        parts = [(cuts[i], cuts[i + 1], *whole) for i in range(count)]
    elif small:  # panels of channels
        total = group * weights.shape[1]
        cuts = [total * i // count for i in range(count + 1)]
        parts = [(0, n, cuts[i], cuts[i + 1]) for i in range(count) if cuts[i] < cuts[i + 1]]
    elif span >= 2 * count * width:  # whole panels a part, the last one's partial panel with the fewest
        total = -(-span // width)
        cuts = [-(-total * i // count) * width for i in range(count)] + [span]
        parts = [(0, n, cuts[i], cuts[i + 1], 0, m) for i in range(count)]
    elif m >= 2 * count * BLOCK_ROWS:  # bands of channels over every position
        cuts = [m * i // count // BLOCK_ROWS * BLOCK_ROWS for i in range(count)] + [m]
        parts = [(0, n, 0, span, cuts[i], cuts[i + 1]) for i in range(count)]
    else:
        parts = [(0, n, 0, span, 0, m)]
    if small:
        padded = np.zeros((group, weights.shape[1] * width), np.float32)
        padded[:, :mg] = bias.reshape(group, mg)
        bias = padded
    else:
        panels = max(-(-(part[3] - part[2]) // width) for part in parts)
    return PointwisePlan((n, c, h * wd), (n, m, ho, wo), small, weights, bias, epilogue,
                         np.array([epilogue.a, epilogue.b], np.float64), (wd, wo, *strides), tuple(parts), panels,
                         team and len(parts) > 1)


def run_pointwise(plan: PointwisePlan, x: np.ndarray) -> np.ndarray:
    """The conv of ``x`` (the plan's input shape) as planned: a fresh (N, M, Ho, Wo) array."""
    x = np.ascontiguousarray(x).reshape(plan.x_shape)
    y = np.empty(plan.y_shape, np.float32)
    flat = y.reshape(plan.y_shape[0], plan.y_shape[1], -1)
    m, span = flat.shape[1:]
    width = panel_width(np.float32)
    epilogue = plan.epilogue
    if plan.small_map:
        c = plan.weights.shape[2]
        size = c * span

        def arrays(buffer: np.ndarray) -> tuple[np.ndarray, ...]:
            return (buffer.reshape(c, span),)

        def run(part: tuple[int, ...], buffer: np.ndarray) -> None:
            small_map_conv(plan.weights, x, flat, plan.bias, *arrays(buffer), *part, *plan.geometry, epilogue.kind,
                           epilogue.a, epilogue.b)
        post = small_map_arguments
    else:
        c = plan.weights.shape[1]
        size = plan.panels * c * width + m * width

        def arrays(buffer: np.ndarray) -> tuple[np.ndarray, ...]:
            return (buffer[:plan.panels * c * width].reshape(plan.panels, c, width),
                    buffer[plan.panels * c * width:].reshape(m, width))

        def run(part: tuple[int, ...], buffer: np.ndarray) -> None:
            pointwise_conv(plan.weights, x, flat, plan.bias, *arrays(buffer), *part, *plan.geometry, epilogue.kind,
                           epilogue.a, epilogue.b)
        post = part_arguments
    own = scratch((size,), np.float32, "pointwise")
    team = parallel.team() if plan.team else None
    if team is not None and len(plan.parts) - 1 <= team.helpers:
        helpers = team.scratch((len(plan.parts) - 1, size), np.float32)
        posted = [post(plan.weights, x, flat, plan.bias, *arrays(helpers[j]), plan.numbers, *part, *plan.geometry,
                       epilogue.kind) for j, part in enumerate(plan.parts[1:])]
        if team.try_run(posted, lambda: run(plan.parts[0], own)):
            return y
    for part in plan.parts:  # (alone, or the team busy: every core is, so every part here)
        run(part, own)
    return y
