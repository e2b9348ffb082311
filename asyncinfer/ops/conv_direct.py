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
from dataclasses import dataclass

import numpy as np

from ..concurrency import parallel
from .compiled.direct import LANES, STRIDES, direct_conv, part_arguments
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
#: channels keeps the GEMM way: its im2col is cheap against its multiply-adds, where sgemm's
#: blocks are as fast. Measured in the models on 2 cores (the first layer, median of 40 runs,
#: GEMM way -> direct): MobileNetV3's 3x3/2 3 -> 16 519 -> 370 µs, ShuffleNet's 3 -> 24 459 ->
#: 358, EfficientNet's 3 -> 32 823 -> 702, the 7x7/2 3 -> 64 of ResNet-18/50, DenseNet and
#: Inception 2.3-2.7 -> 1.8-2.1 ms; but SqueezeNet's 3x3/2 3 -> 64 801 -> 882 and ConvNeXt's
#: 4x4/4 3 -> 96 729 -> 734.
DEEP = 64
MAX_SHALLOW_OUTPUTS = 32


def takes_direct(x_shape: tuple[int, ...], w_shape: tuple[int, ...], group: int, strides: tuple[int, ...],
                 dilations: tuple[int, ...], out: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether a 2-D conv runs on `compiled.direct`: float32, one group of at most `MAX_CHANNELS`
    input channels, a window larger than 1x1, no dilation, the same stride both ways (one of
    `compiled.direct.STRIDES`), output rows at least `MIN_WIDTH` wide, and deep or narrow enough
    (`DEEP`, `MAX_SHALLOW_OUTPUTS`)."""
    return (dtype == np.float32 and len(x_shape) == 4 and group == 1 and x_shape[1] <= MAX_CHANNELS
            and w_shape[2:] != (1, 1) and dilations == (1, 1) and strides[0] == strides[1]
            and strides[0] in STRIDES and out[1] >= MIN_WIDTH
            and (w_shape[0] <= MAX_SHALLOW_OUTPUTS or math.prod(w_shape[1:]) >= DEEP))


@dataclass(frozen=True)
class DirectPlan:
    """What `run_direct` does with an input: the operands and the parts of `direct_conv`."""

    x_shape: tuple[int, ...]            # (N, C, H, W)
    y_shape: tuple[int, ...]            # (N, M, Ho, Wo)
    padded: tuple[int, ...]             # (N, C, Hp, Wp): the zero-padded input
    top: int                            # its rows and columns of padding before the input's
    left: int
    columns: np.ndarray                 # (taps, Mp): the weights transposed, zero past M
    bias: np.ndarray                    # (Mp,), zero past M (and where there is none)
    offsets: np.ndarray                 # (taps,) int64: each tap's offset in a padded image
    stride: int
    epilogue: Epilogue
    numbers: np.ndarray                 # the epilogue's (a, b), float64, for helpers
    parts: tuple[tuple[int, int], ...]  # output rows (q0, q1), counted through the images
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
    # every block reads whole vectors of ``stride`` lanes each: rows as wide as the last block's reach
    reach = -(-wo // LANES) * LANES * stride + kw - 1
    hp, wp = max(begin[0] + h, (ho - 1) * stride + kh), max(begin[1] + wd, reach)
    offsets = np.array([(ci * hp + ky) * wp + kx for ci in range(c) for ky in range(kh) for kx in range(kw)],
                       np.int64)
    rows = n * ho
    team = n * m * c * kh * kw * ho * wo >= TEAM_MIN_MACS
    count = min(parallel.team_size() if team else 1, rows)
    cuts = [rows * i // count for i in range(count + 1)]
    parts = tuple((cuts[i], cuts[i + 1]) for i in range(count))
    return DirectPlan(tuple(x_shape), (n, m, ho, wo), (n, c, hp, wp), begin[0], begin[1], columns, bias, offsets,
                      stride, epilogue, np.array([epilogue.a, epilogue.b], np.float64), parts, team and count > 1)


_PADDED = threading.local()
#: Padded image shapes a thread keeps a buffer for (a model has one stem, or a few).
PADDED_SHAPES = 2


def _padded_image(shape: tuple[int, ...]) -> np.ndarray:
    """This thread's zero-padded image buffer of ``shape``: its border stays zero between runs, so
    a run copies only the input into it (NumPy's copy, about four times faster than a compiled loop
    that writes the border too: 22 against 80-100 µs for a 224x224 image)."""
    buffers = getattr(_PADDED, "buffers", None)
    if buffers is None:
        buffers = _PADDED.buffers = {}
    buffer = buffers.pop(shape, None)
    if buffer is None:
        buffer = np.zeros(shape, np.float32)
        while len(buffers) >= PADDED_SHAPES:
            del buffers[next(iter(buffers))]
    buffers[shape] = buffer  # (the most recent last)
    return buffer


def run_direct(plan: DirectPlan, x: np.ndarray) -> np.ndarray:
    """The conv of ``x`` (the plan's input shape) as planned: a fresh (N, M, Ho, Wo) array."""
    x = np.ascontiguousarray(x).reshape(plan.x_shape)
    padded = _padded_image(plan.padded)
    _, _, h, wd = plan.x_shape
    np.copyto(padded[:, :, plan.top:plan.top + h, plan.left:plan.left + wd], x)
    n, m, ho, wo = plan.y_shape
    y = np.empty(plan.y_shape, np.float32)
    flat = y.reshape(n, m, ho * wo)
    padded_m = plan.columns.shape[1]
    size = padded_m * LANES + BLOCK_ROWS * 2 * LANES
    epilogue = plan.epilogue

    def arrays(buffer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return buffer[:padded_m * LANES].reshape(padded_m, LANES), buffer[padded_m * LANES:].reshape(BLOCK_ROWS, -1)

    def run(part: tuple[int, int], buffer: np.ndarray) -> None:
        direct_conv(plan.columns, padded, plan.offsets, flat, plan.bias, *arrays(buffer), *part, ho, wo, plan.stride,
                    epilogue.kind, epilogue.a, epilogue.b)
    own = scratch((size,), np.float32, "direct_tail")
    team = parallel.team() if plan.team else None
    if team is not None and len(plan.parts) - 1 <= team.helpers:
        helpers = team.scratch((len(plan.parts) - 1, size), np.float32)
        posted = [part_arguments(plan.columns, padded, plan.offsets, flat, plan.bias, *arrays(helpers[j]), plan.numbers,
                                 *part, ho, wo, plan.stride, epilogue.kind) for j, part in enumerate(plan.parts[1:])]
        if team.try_run(posted, lambda: run(plan.parts[0], own)):
            return y
    for part in plan.parts:  # (alone, or the team busy: every core is, so every part here)
        run(part, own)
    return y

