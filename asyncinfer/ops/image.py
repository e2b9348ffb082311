"""Image and geometry ops: GridSample, AffineGrid, Col2Im, CenterCropPad, RoiAlign, MaxUnpool,
DeformConv, NonMaxSuppression, plus Det and the deprecated Scatter (ImageDecoder: `.image_decoder`).

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
from .compiled.nms import greedy_walk, suppression_matrix
from .windows import kernel_taps, pad_spatial, spatial_attrs, tap_slices, window_geometry
from .elementwise import compute_dtype
from .indexing import ScatterElements, normalize_indices
from .registry import register
from .shape import MaybeArray, check_mode, int_list, normalize_axes, op_error, scalar_input

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
        padding = self.attr("padding_mode")
        align = bool(self.attr("align_corners"))
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
        align = bool(self.attr("align_corners"))
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
# Up to this many candidate boxes per image, NMS builds their overlap matrix once (16 MiB of
# booleans at most); beyond, it computes one box's overlaps per pick.
MATRIX_NMS_MAX_BOXES = 4096

@register("NonMaxSuppression", versions=(10, 11))
class NonMaxSuppression(Op):
    """Greedy per-(batch, class) suppression, highest score first (ties: lower box index first).

    Matches ONNX Runtime: a score must be strictly above ``score_threshold``; a box is suppressed
    when its IoU with a selected box is strictly above ``iou_threshold``; boxes of zero area never
    suppress nor get suppressed. The overlaps of an image's boxes are computed once for all its
    classes (a boxes × boxes matrix, up to ``MATRIX_NMS_MAX_BOXES``; beyond, one vectorised IoU
    per pick against the remaining boxes).
    """

    value_inputs = (2, 3, 4)

    def check(self) -> None:
        if int(self.attr("center_point_box")) not in (0, 1):
            self.unsupported(f"attribute center_point_box={self.attr('center_point_box')}")

    def run(self, boxes: Array, scores: Array, max_per_class: MaybeArray = None,
            iou_threshold: MaybeArray = None, score_threshold: MaybeArray = None) -> Array:
        if boxes.ndim != 3 or boxes.shape[2] != 4 or scores.ndim != 3 or \
                scores.shape[0] != boxes.shape[0] or scores.shape[2] != boxes.shape[1]:
            raise op_error(self, f"boxes {boxes.shape} and scores {scores.shape} do not fit together")
        limit = scalar_input(max_per_class, 0)
        iou_max = scalar_input(iou_threshold, 0.0, float)
        min_score = scalar_input(score_threshold, None, float)
        if limit <= 0:
            return np.zeros((0, 3), dtype=np.int64)
        corners = self._corners(boxes)
        area = np.prod(corners[..., 2:] - corners[..., :2], axis=-1)
        selected: list[Array] = []
        for b in range(scores.shape[0]):
            # Every class of an image ranks the same boxes: the pairwise overlaps of the boxes
            # any class may pick are computed once per image (when there are few enough of
            # them), then each class only walks that matrix.
            pool = np.arange(boxes.shape[1]) if min_score is None else \
                np.flatnonzero((scores[b] > min_score).any(axis=0))
            if pool.size <= MATRIX_NMS_MAX_BOXES:
                selected.append(self._by_matrix(b, scores[b], corners[b], area[b], pool, iou_max, min_score, limit))
                continue
            ranked = np.argsort(-scores[b], axis=1, kind="stable")  # descending, lower index first on ties
            for c in range(scores.shape[1]):
                candidates = ranked[c]
                if min_score is not None:
                    candidates = candidates[scores[b, c, candidates] > min_score]
                picks = self._suppress(corners[b], area[b], candidates, iou_max, limit)
                selected.append(np.array([(b, c, i) for i in picks], dtype=np.int64).reshape(-1, 3))
        return np.concatenate(selected).astype(np.int64, copy=False) if selected else np.zeros((0, 3), np.int64)

    def _by_matrix(self, image: int, scores: Array, corners: Array, area: Array, pool: Array, iou_max: float,
                   min_score: float | None, limit: int) -> Array:
        """One image's selections ``(image, class, box)`` through the overlaps of its ``pool`` of
        boxes: the candidates of every class, ranked by class, then descending score, then lower
        box first on ties, walked in one compiled call (`compiled.nms.greedy_walk`)."""
        over = self._overlaps(corners[pool], area[pool], iou_max)
        position = np.empty(len(area), dtype=np.intp)  # box -> row of ``over``
        position[pool] = np.arange(pool.size)
        classes, boxes = np.nonzero(np.ones(scores.shape, bool) if min_score is None else scores > min_score)
        ranked = np.lexsort((boxes, -scores[classes, boxes], classes))
        classes, boxes = classes[ranked], boxes[ranked]
        picked = np.zeros(len(ranked), dtype=bool)
        greedy_walk(over, classes, position[boxes], limit, picked)
        return np.stack([np.full(int(picked.sum()), image), classes[picked], boxes[picked]], axis=1)

    @staticmethod
    def _overlaps(corners: Array, area: Array, iou_max: float) -> Array:
        """``over[i, j]``: box i suppresses box j (IoU above the threshold, both with an area)."""
        over = np.empty((len(area), len(area)), dtype=bool)
        y0, x0, y1, x1 = (np.ascontiguousarray(corners[:, k], dtype=np.float32) for k in range(4))
        # the threshold in float32, as NumPy compares a float32 IoU with a Python float
        suppression_matrix(y0, x0, y1, x1, np.ascontiguousarray(area, dtype=np.float32), np.float32(iou_max), over)
        return over

    def _corners(self, boxes: Array) -> Array:
        """``(..., 4)`` as (y_min, x_min, y_max, x_max), whatever the input format and corner order."""
        if self.attr("center_point_box"):
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


# -- RoiAlign ------------------------------------------------------------------------------------
_ROI_CHUNK_ELEMENTS = 1 << 22  # gathered samples held at once: bounds memory on many large RoIs


@register("RoiAlign", versions=(10, 16, 22))
class RoiAlign(Op):
    """Average (or max) of bilinear samples on a regular grid inside each bin of each RoI.

    The sampling follows Mask R-CNN's reference: points more than one pixel outside the map
    count as 0, others are clamped into it. Opset 10 has no ``coordinate_transformation_mode`` and
    behaves as ``output_half_pixel`` (no -0.5 shift, RoIs at least 1x1). RoIs are processed in
    groups sharing a sampling grid size, a chunk of RoIs at a time.
    """

    def check(self) -> None:
        check_mode(self, "mode", "avg", ("avg", "max"))
        if self.version >= 16:
            check_mode(self, "coordinate_transformation_mode", "half_pixel", ("half_pixel", "output_half_pixel"))

    def run(self, x: Array, rois: Array, batch_indices: Array) -> Array:
        if x.ndim != 4 or rois.ndim != 2 or rois.shape[1] != 4 or np.shape(batch_indices) != (rois.shape[0],):
            raise op_error(self, f"X {x.shape}, rois {rois.shape}, batch_indices {np.shape(batch_indices)} do not fit")
        out_h, out_w = int(self.attr("output_height")), int(self.attr("output_width"))
        ratio, scale = int(self.attr("sampling_ratio")), float(self.attr("spatial_scale"))
        half_pixel = self.version >= 16 and self.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
        dtype = _float_dtype(x.dtype)
        batch = np.asarray(batch_indices).astype(np.int64)
        if ((batch < 0) | (batch >= x.shape[0])).any():
            raise op_error(self, f"batch index out of range for a batch of {x.shape[0]}")
        box = rois.astype(np.float64) * scale - (0.5 if half_pixel else 0.0)
        start = box[:, 1::-1]  # (y, x) of the top-left corner
        extent = box[:, :1:-1] - start  # (height, width)
        if not half_pixel:
            extent = np.maximum(extent, 1.0)
        bins = extent / np.array([out_h, out_w])
        grid = np.full(bins.shape, ratio, np.int64) if ratio > 0 else np.ceil(bins).astype(np.int64)
        grid = np.maximum(grid, 1)
        y = np.zeros((rois.shape[0], x.shape[1], out_h, out_w), dtype=dtype)
        for gh, gw in {tuple(g) for g in grid.tolist()}:
            members = np.flatnonzero((grid[:, 0] == gh) & (grid[:, 1] == gw))
            chunk = max(1, _ROI_CHUNK_ELEMENTS // (x.shape[1] * out_h * gh * out_w * gw))
            for i in range(0, members.size, chunk):
                r = members[i:i + chunk]
                y[r] = self._pool(x, batch[r], start[r], bins[r], (out_h, out_w), (gh, gw), dtype)
        return y.astype(x.dtype, copy=False)

    def _pool(self, x: Array, batch: Array, start: Array, bins: Array, out: tuple[int, int],
              grid: tuple[int, int], dtype: np.dtype) -> Array:
        """Pooled bins ``(R, C, out_h, out_w)`` of RoIs sharing the sampling grid ``grid``."""
        taps = []
        for d in range(2):  # y, then x: sample positions (R, out_d * grid_d)
            cell = (np.arange(out[d])[:, None] + (np.arange(grid[d]) + 0.5) / grid[d]).reshape(-1)
            taps.append(self._axis_taps(start[:, d, None] + cell * bins[:, d, None], x.shape[2 + d]))
        (yi, yw), (xi, xw) = taps
        # corner values weighted: (R, C, out_h*gh, 2, out_w*gw, 2)
        values = x[batch[:, None, None, None, None, None], np.arange(x.shape[1])[None, :, None, None, None, None],
                   yi[:, None, :, :, None, None], xi[:, None, None, None, :, :]].astype(dtype, copy=False)
        weighted = values * (yw[:, None, :, :, None, None] * xw[:, None, None, None, :, :]).astype(dtype)
        r, c = weighted.shape[:2]
        shape = (r, c, out[0], grid[0], 2, out[1], grid[1], 2)
        if self.attr("mode") == "max":  # ONNX Runtime's max: the largest weighted corner
            return weighted.reshape(shape).max(axis=(3, 4, 6, 7))
        return weighted.reshape(shape).sum(axis=(3, 4, 6, 7)) / (grid[0] * grid[1])

    @staticmethod
    def _axis_taps(pos: Array, size: int) -> tuple[Array, Array]:
        """Low/high taps ``(R, S, 2)`` and weights: 0 beyond one pixel outside, clamped inside."""
        outside = (pos < -1.0) | (pos > size)
        pos = np.maximum(pos, 0.0)
        low = np.minimum(np.floor(pos), size - 1)
        pos = np.where(low >= size - 1, low, pos)
        frac = pos - low
        index = np.minimum(low[..., None] + np.arange(2), size - 1).astype(np.int64)
        weight = np.where(outside[..., None], 0.0, np.stack([1 - frac, frac], axis=-1))
        return index, weight


# -- DeformConv ----------------------------------------------------------------------------------
@register("DeformConv", versions=(19, 22))
class DeformConv(Op):
    """Convolution whose kernel taps sample the input at learned offsets (bilinear, zeros outside),
    optionally modulated by ``mask``: im2col by sampling, then the grouped GEMM of a plain conv."""

    multithreaded = True

    def check(self) -> None:
        for name in ("group", "offset_group"):
            if int(self.attr(name, 1)) < 1:
                self.unsupported(f"attribute {name}={self.attr(name)}")
        for name in ("strides", "dilations"):
            if any(int(v) < 1 for v in self.attr(name, None) or []):
                self.unsupported(f"attribute {name}={list(self.attr(name))}")

    def run(self, x: Array, w: Array, offset: Array, b: MaybeArray = None, mask: MaybeArray = None) -> Array:
        n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
        r = len(spatial)
        group, og = int(self.attr("group")), int(self.attr("offset_group"))
        kernel = [int(k) for k in (self.attr("kernel_shape", None) or w.shape[2:])]
        strides, dilations, pads = spatial_attrs(self, r, kernel)
        _, _, out = window_geometry(spatial, kernel, strides, dilations, pads)
        taps, points, m = math.prod(kernel), math.prod(out), w.shape[0]
        if c % og or c % group or m % group or offset.shape != (n, og * taps * r, *out) or \
                (mask is not None and mask.shape != (n, og * taps, *out)):
            raise op_error(self, f"X {x.shape}, W {w.shape}, offset {offset.shape} and mask "
                                 f"{None if mask is None else mask.shape} do not fit group={group}, offset_group={og}")
        dtype = _float_dtype(x.dtype)
        # sampling positions (N*og, taps*points) per axis: output grid + tap + learned offset
        grid = np.stack(np.meshgrid(*(np.arange(o) for o in out), indexing="ij"), axis=0).reshape(r, 1, points)
        tap = np.array(kernel_taps(kernel), dtype=np.float64).T.reshape(r, taps, 1)
        base = grid * np.array(strides).reshape(r, 1, 1) - np.array(pads[:r]).reshape(r, 1, 1) \
            + tap * np.array(dilations).reshape(r, 1, 1)  # (r, taps, points)
        delta = offset.reshape(n * og, taps, r, points).astype(np.float64)
        strides_in = [math.prod(spatial[d + 1:]) for d in range(r)]
        axis_taps = [linear_taps((base[d] + delta[:, :, d]).reshape(n * og, -1), spatial[d]) for d in range(r)]
        cols = gather_taps(x.reshape(n * og, c // og, -1), axis_taps, strides_in, dtype)
        cols = cols.reshape(n, og, c // og, taps, points)
        if mask is not None:
            cols = cols * mask.reshape(n, og, 1, taps, points).astype(dtype, copy=False)
        cols = cols.reshape(n, group, (c // group) * taps, points)
        y = np.matmul(w.reshape(group, m // group, -1).astype(dtype, copy=False), cols).reshape(n, m, *out)
        if b is not None:
            y = y + b.reshape((m,) + (1,) * r).astype(dtype, copy=False)
        return y.astype(x.dtype, copy=False)


# -- rearrangements: Col2Im, CenterCropPad, MaxUnpool ---------------------------------------------
@register("Col2Im", versions=(18,))
class Col2Im(Op):
    """Sum the column blocks ``(N, C*prod(block), L)`` back into an image ``(N, C, *image_shape)``."""

    value_inputs = (1, 2)

    def run(self, cols: Array, image_shape: Array, block_shape: Array) -> Array:
        image, block = int_list(image_shape), int_list(block_shape)
        r = len(image)
        strides = [int(v) for v in self.attr("strides", None) or [1] * r]
        dilations = [int(v) for v in self.attr("dilations", None) or [1] * r]
        pads = [int(v) for v in self.attr("pads", None) or [0] * (2 * r)]
        begin, end, out = window_geometry(image, block, strides, dilations, pads)
        taps = math.prod(block)
        if len(block) != r or cols.ndim != 3 or cols.shape[1] % taps or cols.shape[2] != math.prod(out):
            raise op_error(self, f"input {cols.shape} does not fit image {image}, block {block}")
        n, c = cols.shape[0], cols.shape[1] // taps
        self.check_allocation([n, c, *image])
        blocks = cols.reshape(n, c, taps, *out)
        padded = np.zeros((n, c) + tuple(i + b + e for i, b, e in zip(image, begin, end)), dtype=cols.dtype)
        for t, tap in enumerate(kernel_taps(block)):  # overlapping blocks add up
            padded[(Ellipsis,) + tap_slices(tap, strides, dilations, out)] += blocks[:, :, t]
        return np.ascontiguousarray(pad_spatial(padded, [-b for b in begin], [-e for e in end]))


@register("CenterCropPad", versions=(18,))
class CenterCropPad(Op):
    """Centre-crop (start rounded down) or zero-pad (extra pixel at the end) ``axes`` to ``shape``."""

    value_inputs = (1,)

    def run(self, x: Array, shape: Array) -> Array:
        target = int_list(shape)
        axes = normalize_axes(self, self.attr("axes", None) or range(x.ndim), x.ndim)
        if len(axes) != len(target) or any(t < 0 for t in target):
            raise op_error(self, f"shape {target} does not fit axes {axes}")
        out_shape, src, dst = list(x.shape), [slice(None)] * x.ndim, [slice(None)] * x.ndim
        for axis, t in zip(axes, target):
            size = x.shape[axis]
            out_shape[axis] = t
            keep = min(size, t)
            src[axis] = slice((size - keep) // 2, (size - keep) // 2 + keep)
            dst[axis] = slice((t - keep) // 2, (t - keep) // 2 + keep)
        self.check_allocation(out_shape)
        out = np.zeros(out_shape, dtype=x.dtype)
        out[tuple(dst)] = x[tuple(src)]
        return out


@register("MaxUnpool", versions=(9, 11, 22))
class MaxUnpool(Op):
    """Scatter ``X`` into zeros at the flat positions ``I`` (as MaxPool's indices output gives them)."""

    value_inputs = (2,)

    def check(self) -> None:
        kernel = self.attr("kernel_shape")
        r = len(kernel)
        if len(self.attr("strides", None) or [1] * r) != r or len(self.attr("pads", None) or [0] * 2 * r) != 2 * r:
            self.unsupported("strides/pads inconsistent with kernel_shape")

    def run(self, x: Array, indices: Array, output_shape: MaybeArray = None) -> Array:
        kernel = [int(k) for k in self.attr("kernel_shape")]
        r = len(kernel)
        strides = [int(v) for v in self.attr("strides", None) or [1] * r]
        pads = [int(v) for v in self.attr("pads", None) or [0] * (2 * r)]
        inferred = list(x.shape[:2]) + [(i - 1) * s + k - pads[d] - pads[d + r]
                                         for d, (i, s, k) in enumerate(zip(x.shape[2:], strides, kernel))]
        shape = int_list(output_shape) if output_shape is not None and np.size(output_shape) else inferred
        if indices.shape != x.shape or len(shape) != x.ndim:
            raise op_error(self, f"indices {indices.shape} / output shape {shape} do not fit X {x.shape}")
        # the indices address the inferred shape; an explicit output_shape keeps their coordinates
        flat = normalize_indices(self, indices.reshape(-1), math.prod(inferred))
        coords = np.unravel_index(flat, inferred)
        if any((c >= s).any() for c, s in zip(coords, shape)):
            raise op_error(self, f"an index falls outside output_shape {shape}")
        self.check_allocation(shape)
        out = np.zeros(shape, dtype=x.dtype)
        out[coords] = x.reshape(-1)
        return out


# -- odds and ends: Det, Scatter ---------------------------------------------
@register("Det", versions=(11, 22))
class Det(Op):
    """Determinant of the trailing square matrices (LU in LAPACK; narrow floats in float32)."""

    def run(self, x: Array) -> Array:
        if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
            raise op_error(self, f"input of shape {x.shape} is not a (batch of) square matrices")
        return np.asarray(np.linalg.det(x.astype(compute_dtype(x.dtype), copy=False))).astype(x.dtype)


@register("Scatter", versions=(9, 11))
class Scatter(ScatterElements):
    """The deprecated Scatter: ScatterElements without a reduction attribute."""

    def check(self) -> None:
        if "reduction" in self.attrs:  # not part of Scatter's schema
            self.unsupported(f"attribute reduction={self.attr('reduction')!r}")
