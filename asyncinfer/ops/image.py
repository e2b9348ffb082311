"""Image and geometry ops: GridSample, AffineGrid, Col2Im, CenterCropPad, RoiAlign, MaxUnpool,
DeformConv, NonMaxSuppression, plus Det, the deprecated Scatter, CumProd and ImageDecoder.

The samplers (GridSample, RoiAlign, DeformConv) share one idea: per spatial axis, compute the
integer taps and their weights for every sampling point, then gather from the flattened input
one tap combination at a time, so the memory held is one gathered copy of the output, never
``taps`` of them.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from .base import Op
from .conv import Conv, kernel_taps, pad_spatial, tap_slices
from .elementwise import compute_dtype
from .indexing import ScatterElements
from .registry import register
from .shape import MaybeArray, check_mode, int_list, normalize_axes, normalize_axis, op_error

Array = np.ndarray
_CUBIC_A = -0.75  # the cubic convolution coefficient of GridSample's (and PyTorch's) bicubic mode


# -- sampling helpers shared by GridSample, RoiAlign and DeformConv -------------------------------
def _float_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype interpolation arithmetic runs in for data of ``dtype`` (float64 for integers)."""
    dtype = np.dtype(dtype)
    return compute_dtype(dtype) if dtype.kind in "fc" or "float" in dtype.name else np.dtype(np.float64)


def _cast_back(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Interpolated ``values`` in the data's ``dtype`` (integers rounded, not truncated)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iub":
        values = np.rint(values)
    return values.astype(dtype, copy=False)


def _reflect(x: np.ndarray, low: float, high: float) -> np.ndarray:
    """``x`` folded back into ``[low, high]`` by repeated reflection at both ends."""
    span = high - low
    if span <= 0:
        return np.full_like(x, low)
    dist = np.abs(x - low)
    flips = np.floor(dist / span)
    extra = dist - flips * span
    return np.where(flips % 2 == 0, low + extra, high - extra)


def _cubic_weights(t: np.ndarray) -> np.ndarray:
    """Weights ``(..., 4)`` of the taps at offsets -1, 0, 1, 2 for fractional position ``t``."""
    a = _CUBIC_A

    def near(d: np.ndarray) -> np.ndarray:  # |d| <= 1
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d: np.ndarray) -> np.ndarray:  # 1 < |d| < 2
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    return np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def gather_taps(flat: np.ndarray, taps: Sequence[tuple[np.ndarray, np.ndarray]],
                strides: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """Sum over every combination of per-axis taps of ``weight * flat[..., index]``.

    ``flat`` is ``(N, C, P)`` (spatial dims flattened with ``strides``); ``taps[d]`` is
    ``(index, weight)``, each ``(N, Q, K_d)``, with invalid taps given weight 0 (and any in-range
    index). Returns ``(N, C, Q)`` in ``dtype``.
    """
    n, c = flat.shape[:2]
    q = taps[0][0].shape[1]
    batch = np.arange(n)[:, None]
    source = np.moveaxis(flat, 1, -1)  # (N, P, C): one gather brings every channel of a point
    out = np.zeros((n, q, c), dtype=dtype)
    for combo in itertools.product(*(range(idx.shape[-1]) for idx, _ in taps)):
        index = sum(taps[d][0][..., k] * strides[d] for d, k in enumerate(combo))
        weight = math.prod(taps[d][1][..., k] for d, k in enumerate(combo))
        out += source[batch, index].astype(dtype, copy=False) * weight[..., None].astype(dtype, copy=False)
    return np.moveaxis(out, -1, 1)


def linear_taps(pos: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The two taps of linear interpolation at ``pos``; taps outside ``[0, size)`` get weight 0."""
    low = np.floor(pos)
    frac = pos - low
    index = low.astype(np.int64)[..., None] + np.arange(2)
    weight = np.stack([1 - frac, frac], axis=-1)
    inside = (index >= 0) & (index < size)
    return np.clip(index, 0, size - 1), np.where(inside, weight, 0)


# -- GridSample ----------------------------------------------------------------------------------
@register("GridSample", versions=(16, 20, 22))
class GridSample(Op):
    """Sample ``X`` (N, C, d1…dr) at the normalised positions of ``grid`` (N, o1…or, r).

    ``grid[..., 0]`` addresses the last (width) axis. Linear and nearest sampling apply the
    padding mode to the sampling position; cubic sampling applies it to each of its 4 taps, as
    PyTorch's ``grid_sample`` does.
    """

    _MODES = {16: {"bilinear": "linear", "nearest": "nearest", "bicubic": "cubic"},
              20: {"linear": "linear", "nearest": "nearest", "cubic": "cubic"}}

    def check(self) -> None:
        modes = self._MODES[16 if self.version < 20 else 20]
        mode = self.attr("mode", "bilinear" if self.version < 20 else "linear")
        if mode not in modes:
            self.unsupported(f"attribute mode={mode!r}")
        check_mode(self, "padding_mode", "zeros", ("zeros", "border", "reflection"))

    def run(self, x: Array, grid: Array) -> Array:
        modes = self._MODES[16 if self.version < 20 else 20]
        mode = modes[self.attr("mode", "bilinear" if self.version < 20 else "linear")]
        padding = self.attr("padding_mode", "zeros")
        align = bool(self.attr("align_corners", 0))
        r = x.ndim - 2
        if r < 1 or (self.version < 20 and r != 2) or grid.ndim != r + 2 or grid.shape[-1] != r \
                or grid.shape[0] != x.shape[0]:
            raise op_error(self, f"grid of shape {grid.shape} does not fit input of shape {x.shape}")
        n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
        out_sp = grid.shape[1:-1]
        if x.size == 0 or grid.size == 0:
            return np.zeros((n, c) + out_sp, dtype=x.dtype)
        dtype = _float_dtype(x.dtype)
        pts = grid.reshape(n, -1, r).astype(np.float64)
        strides = [math.prod(spatial[d + 1:]) for d in range(r)]
        taps = []
        for d, size in enumerate(spatial):
            g = pts[..., r - 1 - d]  # grid's innermost component addresses the last axis
            pos = (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2
            if mode == "cubic":
                taps.append(self._cubic_taps(pos, size, padding, align))
                continue
            pos = self._pad(pos, size, padding, align)
            if mode == "nearest":
                index = np.rint(pos).astype(np.int64)[..., None]
                inside = (index >= 0) & (index < size)
                taps.append((np.clip(index, 0, size - 1), inside.astype(np.float64)))
            else:
                taps.append(linear_taps(pos, size))
        flat = x.reshape(n, c, -1)
        if mode == "nearest":  # pure gather: keep the dtype exact (ints, strings, bools)
            index = sum(t[0][..., 0] * s for t, s in zip(taps, strides))
            valid = math.prod(t[1][..., 0] for t in taps).astype(bool)
            y = np.moveaxis(np.moveaxis(flat, 1, -1)[np.arange(n)[:, None], index], -1, 1)
            y = np.where(valid[:, None], y, np.zeros((), x.dtype))
        else:
            y = _cast_back(gather_taps(flat, taps, strides, dtype), x.dtype)
        return y.reshape((n, c) + out_sp)

    @staticmethod
    def _pad(pos: np.ndarray, size: int, padding: str, align: bool) -> np.ndarray:
        """Apply the border or reflection padding to a (pixel-unit) sampling position."""
        if padding == "border":
            return np.clip(pos, 0, size - 1)
        if padding == "reflection":
            low, high = (0, size - 1) if align else (-0.5, size - 0.5)
            return np.clip(_reflect(pos, low, high), 0, size - 1)
        return pos

    def _cubic_taps(self, pos: np.ndarray, size: int, padding: str, align: bool) -> tuple[np.ndarray, np.ndarray]:
        low = np.floor(pos)
        weight = _cubic_weights(pos - low)
        index = low[..., None] + np.arange(-1, 3)
        if padding == "zeros":
            weight = np.where((index >= 0) & (index < size), weight, 0)
        index = np.clip(self._pad(index, size, padding, align), 0, size - 1)
        return index.astype(np.int64), weight


@register("AffineGrid", versions=(20,))
class AffineGrid(Op):
    """The sampling grid ``theta @ [positions; 1]`` over a regular grid of normalised positions."""

    value_inputs = (1,)

    def run(self, theta: Array, size: Array) -> Array:
        dims = int_list(size)
        r = len(dims) - 2
        if r not in (2, 3) or theta.shape != (dims[0], r, r + 1):
            raise op_error(self, f"theta of shape {theta.shape} does not fit size {dims}")
        dtype = compute_dtype(theta.dtype)
        align = bool(self.attr("align_corners", 0))
        axes = []
        for s in dims[2:]:
            lin = np.linspace(-1, 1, s, dtype=np.float64) if s > 1 else np.zeros(s)
            axes.append(lin if align or s <= 1 else lin * (s - 1) / s)
        # base[..., :] = (x, y[, z], 1) with x along the last axis
        mesh = np.meshgrid(*axes, indexing="ij")
        base = np.stack([m for m in reversed(mesh)] + [np.ones_like(mesh[0])], axis=-1).astype(dtype)
        grid = np.einsum("...k,njk->n...j", base, theta.astype(dtype, copy=False))
        return grid.astype(theta.dtype, copy=False)


# -- NonMaxSuppression ---------------------------------------------------------------------------
@register("NonMaxSuppression", versions=(10, 11))
class NonMaxSuppression(Op):
    """Greedy per-(batch, class) suppression, highest score first (ties: lower box index first).

    Matches ONNX Runtime: a score must be strictly above ``score_threshold``; a box is suppressed
    when its IoU with a selected box is strictly above ``iou_threshold``; boxes of zero area never
    suppress nor get suppressed. Each pick costs one vectorised IoU against the remaining boxes,
    so no (boxes x boxes) matrix is ever built.
    """

    value_inputs = (2, 3, 4)

    def check(self) -> None:
        if int(self.attr("center_point_box", 0)) not in (0, 1):
            self.unsupported(f"attribute center_point_box={self.attr('center_point_box')}")

    def run(self, boxes: Array, scores: Array, max_per_class: MaybeArray = None,
            iou_threshold: MaybeArray = None, score_threshold: MaybeArray = None) -> Array:
        if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3 or \
                scores.shape[0] != boxes.shape[0] or scores.shape[2] != boxes.shape[1]:
            raise op_error(self, f"boxes {boxes.shape} and scores {scores.shape} do not fit together")
        limit = 0 if max_per_class is None or np.size(max_per_class) == 0 else int(np.asarray(max_per_class).reshape(-1)[0])
        iou_max = 0.0 if iou_threshold is None or np.size(iou_threshold) == 0 else float(np.asarray(iou_threshold).reshape(-1)[0])
        min_score = None if score_threshold is None or np.size(score_threshold) == 0 \
            else float(np.asarray(score_threshold).reshape(-1)[0])
        if limit <= 0:
            return np.zeros((0, 3), dtype=np.int64)
        corners = self._corners(boxes)
        area = np.prod(corners[..., 2:] - corners[..., :2], axis=-1)
        selected = []
        for b, c in np.ndindex(scores.shape[0], scores.shape[1]):
            s = scores[b, c]
            candidates = np.argsort(-s, kind="stable")  # descending, lower index first on ties
            if min_score is not None:
                candidates = candidates[s[candidates] > min_score]
            picks = self._suppress(corners[b], area[b], candidates, iou_max, limit)
            selected.extend((b, c, i) for i in picks)
        return np.array(selected, dtype=np.int64).reshape(-1, 3)

    def _corners(self, boxes: Array) -> Array:
        """``(..., 4)`` as (y_min, x_min, y_max, x_max), whatever the input format and corner order."""
        if self.attr("center_point_box", 0):
            centre, half = boxes[..., 1::-1], boxes[..., :1:-1] / 2  # (y, x) centre, (h, w) / 2
            return np.concatenate([centre - half, centre + half], axis=-1)
        return np.concatenate([np.minimum(boxes[..., :2], boxes[..., 2:]),
                               np.maximum(boxes[..., :2], boxes[..., 2:])], axis=-1)

    @staticmethod
    def _suppress(corners: Array, area: Array, order: Array, iou_max: float, limit: int) -> list[int]:
        picks: list[int] = []
        while order.size and len(picks) < limit:
            best, rest = order[0], order[1:]
            picks.append(int(best))
            lo = np.maximum(corners[best, :2], corners[rest, :2])
            hi = np.minimum(corners[best, 2:], corners[rest, 2:])
            inter = np.prod(np.clip(hi - lo, 0, None), axis=-1)
            with np.errstate(all="ignore"):
                iou = inter / (area[best] + area[rest] - inter)
            suppressed = (iou > iou_max) & (area[best] > 0) & (area[rest] > 0)
            order = rest[~suppressed]
        return picks
