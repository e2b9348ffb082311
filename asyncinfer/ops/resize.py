"""Resize (versions 10-19) and the deprecated Upsample.

Interpolation is separable: for every resized axis we compute, once per call, a small table of
source indices and weights per output position (``(out, taps)``), then apply it with one
``np.take`` + multiply-add per tap along that axis. Nearest mode is a single gather per axis.
The tables are built in float64 (they are tiny); the data stays in its own dtype.
"""
from __future__ import annotations

import math

import numpy as np

from .base import Op
from .shape import op_error
from .registry import register

_COORD_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                "tf_half_pixel_for_nn", "tf_crop_and_resize")
_NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
_POLICIES = ("stretch", "not_larger", "not_smaller")


def _source_coords(mode: str, out_len: int, in_len: int, scale: float, roi: tuple[float, float]) -> np.ndarray:
    """``x_original`` for every output position of one axis (float64)."""
    x = np.arange(out_len, dtype=np.float64)
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        adjustment = out_len / (in_len * scale)
        offset = in_len / 2 * (1 - adjustment)
        return offset + (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if out_len > 1 else np.zeros_like(x)
    if mode == "align_corners":  # ONNX uses the fractional resized length in*scale here
        return x * (in_len - 1) / (in_len * scale - 1) if out_len > 1 else np.zeros_like(x)
    if mode == "asymmetric":
        return x / scale
    if mode == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    start, end = roi  # tf_crop_and_resize
    if out_len > 1:
        return start * (in_len - 1) + x * (end - start) * (in_len - 1) / (out_len - 1)
    return np.full_like(x, 0.5 * (start + end) * (in_len - 1))


def _nearest_index(coords: np.ndarray, nearest_mode: str) -> np.ndarray:
    if nearest_mode == "floor":
        return np.floor(coords)
    if nearest_mode == "ceil":
        return np.ceil(coords)
    frac = coords - np.floor(coords)
    if nearest_mode == "round_prefer_ceil":
        return np.where(frac == 0.5, np.ceil(coords), np.round(coords))
    return np.where(frac == 0.5, np.floor(coords), np.round(coords))  # round_prefer_floor


def _cubic_kernel(d: np.ndarray, a: float) -> np.ndarray:
    d = np.abs(d)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _linear_kernel(d: np.ndarray) -> np.ndarray:
    return np.maximum(0.0, 1 - np.abs(d))


def _filter_taps(coords: np.ndarray, in_len: int, mode: str, scale: float, cubic_a: float,
                 exclude_outside: bool, antialias: bool) -> tuple[np.ndarray, np.ndarray]:
    """Source indices and weights ``(out, taps)`` of linear/cubic interpolation along one axis.

    With antialias and downscaling, the kernel is stretched by ``1/scale`` (more taps) and the
    weights renormalized to sum to one.
    """
    support = 1.0 if mode == "linear" else 2.0
    stretch = 1.0 / scale if antialias and scale < 1 else 1.0
    radius = support * stretch
    first = np.floor(coords - radius) + 1  # first integer position strictly inside the support
    taps = int(math.ceil(2 * radius)) + 1
    idx = first[:, None] + np.arange(taps)[None, :]
    dist = (idx - coords[:, None]) / stretch
    w = _linear_kernel(dist) if mode == "linear" else _cubic_kernel(dist, cubic_a)
    if exclude_outside:
        w = np.where((idx >= 0) & (idx < in_len), w, 0.0)
    if exclude_outside or stretch != 1.0:  # otherwise outside taps read the (clamped) edge
        total = w.sum(axis=1, keepdims=True)
        w = w / np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, in_len - 1).astype(np.intp), w


class _ResizeBase(Op):
    """Shared resampling; subclasses turn their inputs/attributes into per-axis sizes and scales."""

    def mode(self) -> str:
        return str(self.attr("mode")).lower()

    def resample(self, x: np.ndarray, out_shape: list[int], scales: list[float], rois: list[tuple[float, float]],
                 coord_mode: str, nearest_mode: str) -> np.ndarray:
        if any(d < 0 for d in out_shape):
            raise op_error(self, f"output shape {out_shape} has a negative dimension")
        self.check_allocation(out_shape)
        mode = self.mode()
        cubic_a = float(self.attr("cubic_coeff_a", -0.75))
        exclude = bool(self.attr("exclude_outside", 0))
        antialias = bool(self.attr("antialias", 0))
        extrapolation = float(self.attr("extrapolation_value", 0.0))
        y = x
        outside = []  # per-axis masks of output positions sampling outside the input (tf_crop_and_resize)
        for axis, (in_len, out_len) in enumerate(zip(x.shape, out_shape)):
            if in_len == out_len and scales[axis] == 1.0 and coord_mode != "tf_crop_and_resize":
                outside.append(None)
                continue
            coords = _source_coords(coord_mode, out_len, in_len, scales[axis], rois[axis])
            if coord_mode == "tf_crop_and_resize":
                out_of_range = (coords < 0) | (coords > in_len - 1)
                outside.append(out_of_range if out_of_range.any() else None)
            else:
                outside.append(None)
            if mode == "nearest":
                idx = np.clip(_nearest_index(coords, nearest_mode), 0, in_len - 1).astype(np.intp)
                y = np.take(y, idx, axis=axis)
                continue
            idx, w = _filter_taps(coords, in_len, mode, scales[axis], cubic_a, exclude, antialias)
            w = w.astype(x.dtype if x.dtype.kind == "f" else np.float32)
            bshape = [1] * x.ndim
            bshape[axis] = out_len
            acc = None
            for k in range(idx.shape[1]):
                if not w[:, k].any():
                    continue
                term = np.take(y, idx[:, k], axis=axis) * w[:, k].reshape(bshape)
                acc = term if acc is None else np.add(acc, term, out=acc)
            y = acc if acc is not None else np.zeros(
                y.shape[:axis] + (out_len,) + y.shape[axis + 1:], dtype=w.dtype)
        if any(m is not None for m in outside):
            mask = np.zeros(tuple(out_shape), dtype=bool)
            for axis, m in enumerate(outside):
                if m is not None:
                    shape = [1] * x.ndim
                    shape[axis] = out_shape[axis]
                    mask |= m.reshape(shape)
            y = np.where(mask, np.asarray(extrapolation, dtype=y.dtype), y)
        if y.dtype != x.dtype:
            y = np.round(y) if x.dtype.kind in "iu" else y
            y = y.astype(x.dtype)
        return y if y is not x else x.copy()


@register("Resize", versions=(10, 11, 13, 18, 19))
class Resize(_ResizeBase):
    value_inputs = (1, 2, 3)

    def check(self) -> None:
        if self.mode() not in ("nearest", "linear", "cubic"):
            self.unsupported(f"mode={self.attr('mode')!r}")
        if self.version >= 11:
            coord = self.attr("coordinate_transformation_mode", "half_pixel")
            if coord not in _COORD_MODES or (coord == "tf_half_pixel_for_nn" and self.version >= 18) \
                    or (coord == "half_pixel_symmetric" and self.version < 18):
                self.unsupported(f"coordinate_transformation_mode={coord!r}")
            if self.attr("nearest_mode", "round_prefer_floor") not in _NEAREST_MODES:
                self.unsupported(f"nearest_mode={self.attr('nearest_mode')!r}")
            if self.attr("keep_aspect_ratio_policy", "stretch") not in _POLICIES:
                self.unsupported(f"keep_aspect_ratio_policy={self.attr('keep_aspect_ratio_policy')!r}")
        elif self.mode() == "cubic":
            self.unsupported("mode='cubic' before opset 11")

    def run(self, x: np.ndarray, roi: np.ndarray | None = None, scales: np.ndarray | None = None,
            sizes: np.ndarray | None = None) -> np.ndarray:
        if self.version < 11:  # Resize-10: (X, scales), asymmetric coordinates, floor for nearest
            return _resize_v10(self, x, roi)
        rank = x.ndim
        axes = [int(a) % rank for a in self.attr("axes", None) or range(rank)]
        coord = self.attr("coordinate_transformation_mode", "half_pixel")
        full_scales = [1.0] * rank
        out_shape = list(x.shape)
        rois = [(0.0, 1.0)] * rank
        if roi is not None and roi.size and coord == "tf_crop_and_resize":
            r = roi.astype(np.float64).ravel()
            for i, a in enumerate(axes):
                rois[a] = (float(r[i]), float(r[i + len(axes)]))
        if sizes is not None and sizes.size:
            sizes = [int(s) for s in sizes.ravel()]
            policy = self.attr("keep_aspect_ratio_policy", "stretch")
            if policy == "stretch":
                for a, s in zip(axes, sizes):
                    out_shape[a] = s
                    full_scales[a] = s / x.shape[a]
            else:
                ratios = [s / x.shape[a] for a, s in zip(axes, sizes)]
                scale = min(ratios) if policy == "not_larger" else max(ratios)
                for a in axes:
                    out_shape[a] = int(math.floor(scale * x.shape[a] + 0.5))
                    full_scales[a] = scale
        elif scales is not None and scales.size:
            for a, s in zip(axes, scales.astype(np.float64).ravel()):
                full_scales[a] = float(s)
                extent = rois[a][1] - rois[a][0] if coord == "tf_crop_and_resize" else 1.0
                out_shape[a] = int(math.floor(x.shape[a] * extent * float(s)))
        else:
            raise ValueError("Resize needs either scales or sizes")
        return self.resample(x, out_shape, full_scales, rois, coord,
                             self.attr("nearest_mode", "round_prefer_floor"))


def _resize_v10(op: _ResizeBase, x: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Resize-10 / Upsample semantics: ``out = floor(in * scale)``, asymmetric coordinates."""
    sc = [float(s) for s in scales.astype(np.float64).ravel()]
    out_shape = [int(math.floor(d * s)) for d, s in zip(x.shape, sc)]
    return op.resample(x, out_shape, sc, [(0.0, 1.0)] * x.ndim, "asymmetric", "floor")


@register("Upsample", versions=(7, 9, 10))
class Upsample(_ResizeBase):
    """Deprecated Resize-10 predecessor: scales as an attribute (7) or an input (9, 10)."""

    value_inputs = (1,)

    def check(self) -> None:
        mode = self.mode()
        if mode == "bilinear":  # old spelling accepted by some exporters
            mode = "linear"
        if mode not in ("nearest", "linear"):
            self.unsupported(f"mode={self.attr('mode')!r}")
        if self.version < 9 and self.attr("scales", None) is None:
            self.unsupported("missing scales attribute")

    def mode(self) -> str:
        m = str(self.attr("mode")).lower()
        return "linear" if m == "bilinear" else m

    def run(self, x: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
        if self.version < 9:
            scales = np.asarray(self.attr("scales"), dtype=np.float64)
        return _resize_v10(self, x, scales)
