"""Convs and the 3x3/2 max pool after them, one block of channels at a time through a buffer
that stays in the core's L2 (`ops/conv_pool.py` says when).

Unfused, the conv's output (SqueezeNet's stem, 64 x 111x111, and ResNet's, 64 x 112x112: 3.2 MB;
its fire modules' joined 1x1 and 3x3 expand convs before a pool, 128 x 55x55 and 256 x 27x27:
1.5 and 0.75 MB) is stored past the core's L2 and read back by the pool. Here each image's block
of channels is summed into this thread's buffer by the unfused layer's own kernel, in its order
of sums (the same bits), then pooled from there (`pool_three.max_three_by_two`): only the pooled
map, a quarter of the size, leaves the core.
"""
from __future__ import annotations

import numpy as np

from . import kernel
from .direct import LANES, WIDE_VECTORS, direct_conv
from .direct_panels import direct_panel_conv
from .panels import BLOCK_ROWS
from .pool_three import max_three_by_two


@kernel(contract=False)
def conv_max_pool(columns: np.ndarray, padded: np.ndarray, offsets: np.ndarray, buffer: np.ndarray, bias: np.ndarray,
                  y: np.ndarray, out_height: int, out_width: int, stride: int, act: int, a: float, b: float, top: int,
                  left: int, lowest: float) -> None:
    """``y`` (N, M, Hq, Wq) = the 3x3/2 max pool (``top``, ``left`` rows and columns of padding
    before the map, holding ``lowest``) of the conv `direct.direct_conv` computes from the padded
    images ``padded`` with taps ``offsets`` (``out_height`` x ``out_width`` outputs at ``stride``,
    epilogue ``act``, ``a``, ``b``). ``columns`` (B, taps, `BLOCK_ROWS`) and ``bias`` (B,
    `BLOCK_ROWS`) are the conv's weights and bias by blocks of channels, zero past M; ``buffer``
    (`buffer_size` values) this thread's."""
    blocks = columns.shape[0]
    m = y.shape[1]
    span = out_height * out_width
    planes = buffer[:BLOCK_ROWS * span].reshape(1, BLOCK_ROWS, span)
    maps = planes.reshape(BLOCK_ROWS, out_height, out_width)
    tail = buffer[BLOCK_ROWS * span:BLOCK_ROWS * (span + LANES)].reshape(BLOCK_ROWS, LANES)
    spare = buffer[BLOCK_ROWS * (span + LANES):].reshape(BLOCK_ROWS, WIDE_VECTORS * LANES)
    for i in range(y.shape[0]):
        for block in range(blocks):
            direct_conv(columns[block], padded[i:i + 1], offsets, planes, bias[block], tail, spare, 0, out_height,
                        out_height, out_width, stride, act, a, b)
            c0 = block * BLOCK_ROWS
            max_three_by_two(maps, y[i, c0:min(m, c0 + BLOCK_ROWS)], 0, min(BLOCK_ROWS, m - c0), top, left, lowest)


def buffer_size(out_height: int, out_width: int) -> int:
    """Float32 values of a thread's buffer for `conv_max_pool`: a block's conv planes, and the
    conv's tail and spare blocks."""
    return BLOCK_ROWS * (out_height * out_width + LANES + WIDE_VECTORS * LANES)


@kernel(contract=False)
def panel_conv_max_pool(panels: np.ndarray, padded: np.ndarray, tap_sets: np.ndarray, panel_taps: np.ndarray,
                        buffer: np.ndarray, bias: np.ndarray, block: np.ndarray, y: np.ndarray, out_height: int,
                        out_width: int, row_stride: int, column_stride: int, act: int, a: float, b: float,
                        top: int, left: int, lowest: float) -> None:
    """``y`` (N, M, Hq, Wq) = the 3x3/2 max pool (``top``, ``left`` rows and columns of padding
    before the map, holding ``lowest``) of the conv `direct_panels.direct_panel_conv` computes
    with these operands (``out_height`` x ``out_width`` outputs at ``row_stride``,
    ``column_stride``; epilogue ``act``, ``a``, ``b``), one panel of channels of one image at a
    time: ``buffer`` (at least ``panels.shape[2]·out_height·out_width`` values) and ``block`` are
    this thread's."""
    m = y.shape[1]
    width = panels.shape[2]
    span = out_height * out_width
    for i in range(y.shape[0]):
        for p in range(panels.shape[0]):
            c0 = p * width
            channels = min(width, m - c0)
            # the panel as a conv of its own: its weights, taps and biases, its channels the buffer's
            planes = buffer[:channels * span].reshape(1, channels, span)
            direct_panel_conv(panels[p:p + 1], padded[i:i + 1], tap_sets, panel_taps[p:p + 1], planes,
                              bias[c0:c0 + width], block, 0, out_height, 0, out_height, out_height, out_width,
                              row_stride, column_stride, act, a, b)
            max_three_by_two(planes.reshape(channels, out_height, out_width), y[i, c0:c0 + channels], 0, channels,
                             top, left, lowest)
