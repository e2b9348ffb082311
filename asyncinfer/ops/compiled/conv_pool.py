"""A stem conv and the 3x3/2 max pool after it, one block of channels at a time through a buffer
that stays in the core's L2 (`ops/conv_pool.py` says when).

Unfused, the stem's output (SqueezeNet's 64 x 111x111, ResNet's 64 x 112x112: 3.2 MB) is stored
past the core's L2 and read back by the pool. Here each image's block of `BLOCK_ROWS` channels
is summed into this thread's buffer (`direct.direct_conv`, the same kernel and order of sums as
the unfused layer: the same bits), then pooled from there (`pool_three.max_three_by_two`):
only the pooled map, a quarter of the size, leaves the core.
"""
from __future__ import annotations

import numpy as np

from . import kernel
from .direct import LANES, WIDE_VECTORS, direct_conv
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
