"""How a tensor's values are laid out in an RGBA32F texture: four values per texel.

A layout factors the tensor's element count as ``outer × depth × inner`` over its C-order flat
index ``i = (o·depth + d)·inner + r``, and packs *four consecutive* ``d`` into one texel:

    texel ``t = (o·blocks + d // 4)·inner + r`` holds the elements ``d = 4·(d//4) + 0..3``,
    with ``blocks = ceil(depth / 4)``; the lanes past ``depth`` are padding and always hold 0.

Texels fill the texture row by row. Two layouts matter:

- NCHW activations block the channels (``outer=N, depth=C, inner=H·W``): a texel holds four
  channels of one pixel, so convolutions and pools work on ``vec4``s of channels;
- everything else blocks the last axis (``inner=1``): a texel holds four neighbours of a row,
  which is what MatMul/Gemm/Softmax/LayerNormalization want.

Because a layout addresses elements by their flat index, any reshape of a tensor keeps its
layout: Reshape, Flatten, Squeeze and Unsqueeze cost nothing on this backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Texture row width for tensors that need several rows (a row of 1024 RGBA32F texels is 16 KiB).
ROW_TEXELS = 1024


@dataclass(frozen=True)
class Layout:
    """``outer × depth × inner`` blocking of a flat index, and the texture it needs."""

    outer: int
    depth: int
    inner: int

    @property
    def blocks(self) -> int:
        return -(-self.depth // 4)

    @property
    def texels(self) -> int:
        return max(1, self.outer * self.blocks * self.inner)

    @property
    def size(self) -> int:
        return self.outer * self.depth * self.inner

    def texture_size(self, max_size: int) -> tuple[int, int]:
        """``(width, height)`` of the texture; raises ValueError when the largest texture is too small."""
        texels = self.texels
        width = min(texels, ROW_TEXELS)
        height = -(-texels // width)
        if height > max_size:
            width = -(-texels // max_size)
            height = -(-texels // width)
        if width > max_size or height > max_size:
            raise ValueError(f"{self.size} values need {texels} texels, more than the largest "
                             f"texture ({max_size}×{max_size}) holds")
        return width, height

    # -- host-side packing ------------------------------------------------------------------
    def pack(self, array: np.ndarray, width: int, height: int) -> np.ndarray:
        """The ``(height, width, 4)`` float32 texel image of ``array`` (C-order values)."""
        flat = np.asarray(array, dtype=np.float32).reshape(self.outer, self.depth, self.inner)
        blocked = np.zeros((self.outer, self.blocks * 4, self.inner), np.float32)
        blocked[:, :self.depth] = flat
        texels = blocked.reshape(self.outer, self.blocks, 4, self.inner).transpose(0, 1, 3, 2)
        image = np.zeros((height * width, 4), np.float32)
        image[:self.outer * self.blocks * self.inner] = texels.reshape(-1, 4)
        return image.reshape(height, width, 4)

    def unpack(self, image: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The C-order values of ``shape`` from a texel image (as read from the texture)."""
        texels = np.asarray(image, np.float32).reshape(-1, 4)[:self.outer * self.blocks * self.inner]
        blocked = texels.reshape(self.outer, self.blocks, self.inner, 4).transpose(0, 1, 3, 2)
        values = blocked.reshape(self.outer, self.blocks * 4, self.inner)[:, :self.depth]
        return np.ascontiguousarray(values).reshape(shape)


def natural_layout(shape: tuple[int, ...]) -> Layout:
    """The default layout: channel-blocked for rank-4 (NCHW) tensors, else last-axis blocked."""
    if len(shape) == 4:
        return Layout(shape[0], shape[1], shape[2] * shape[3])
    return axis_layout(shape, len(shape) - 1)


def axis_layout(shape: tuple[int, ...], axis: int) -> Layout:
    """The layout that blocks ``axis`` of ``shape`` (a scalar is one value)."""
    if not shape:
        return Layout(1, 1, 1)
    axis = axis % len(shape)
    return Layout(math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:]))


def flat_layout(size: int) -> Layout:
    """Plain row-major packing: texel ``t`` holds elements ``4t..4t+3``."""
    return Layout(1, size, 1)
