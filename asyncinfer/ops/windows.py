"""Sliding-window geometry shared by the conv and pooling ops (and the device kernels).

`spatial_attrs` / `window_geometry` turn a layer's kernel, strides, dilations, pads and auto_pad
into each spatial axis's pads and output size; `pad_spatial`, `tap_slices` and `kernel_taps` are
the NumPy building blocks; `FlatWindows` lays a padded input out so that every kernel tap reads
one contiguous run (the im2col of the tiled conv and the pooling windows).
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .base import Op

_AUTO_PADS = ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER")
def spatial_attrs(op: Op, nspatial: int, kernel: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """``strides``, ``dilations`` and ``pads`` (begin+end, 2*nspatial values) with ONNX defaults."""
    strides = list(op.attr("strides", None) or [1] * nspatial)
    dilations = list(op.attr("dilations", None) or [1] * nspatial)
    pads = list(op.attr("pads", None) or [0] * (2 * nspatial))
    if len(strides) != nspatial or len(dilations) != nspatial or len(pads) != 2 * nspatial or len(kernel) != nspatial:
        op.unsupported(f"attributes inconsistent with {nspatial} spatial dims "
                       f"(kernel {list(kernel)}, strides {strides}, dilations {dilations}, pads {pads})")
    return strides, dilations, pads


def check_spatial_attrs(op: Op) -> None:
    """Refuse, at worker creation, attribute values the window code cannot handle."""
    auto_pad = op.attr("auto_pad", "NOTSET")
    if auto_pad not in _AUTO_PADS:
        op.unsupported(f"auto_pad={auto_pad!r}")
    for name in ("strides", "dilations", "kernel_shape"):
        values = op.attr(name, None)
        if values is not None and any(int(v) < 1 for v in values):
            op.unsupported(f"{name}={list(values)} (values must be >= 1)")
    pads = op.attr("pads", None)
    if pads is not None and any(int(p) < 0 for p in pads):
        op.unsupported(f"negative pads {list(pads)}")


def window_geometry(in_shape: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
                    dilations: Sequence[int], pads: Sequence[int], auto_pad: str = "NOTSET",
                    ceil_mode: bool = False) -> tuple[list[int], list[int], list[int]]:
    """Begin pads, end pads and output size of a sliding window over the spatial dims ``in_shape``.

    The pads are the explicit (or auto_pad-derived) ones; with ceil_mode the last window may reach
    past them, which `FlatWindows` accounts for by padding further with the fill value.
    """
    n = len(in_shape)
    begin, end, out = [0] * n, [0] * n, [0] * n
    for i in range(n):
        size, k, s, d = int(in_shape[i]), int(kernel[i]), int(strides[i]), int(dilations[i])
        span = (k - 1) * d + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-size // s)
            total = max(0, (o - 1) * s + span - size)
            small = total // 2
            begin[i], end[i] = (small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small)
        else:
            if auto_pad == "NOTSET":
                begin[i], end[i] = int(pads[i]), int(pads[i + n])
            room = size + begin[i] + end[i] - span
            if room < 0:
                o = 0
            elif ceil_mode:
                o = -(-room // s) + 1
                if (o - 1) * s >= size + begin[i]:  # the last window would start in the end padding
                    o -= 1
            else:
                o = room // s + 1
        out[i] = max(o, 0)
    return begin, end, out


def pad_spatial(x: np.ndarray, begin: Sequence[int], end: Sequence[int], value: float = 0) -> np.ndarray:
    """``x`` padded (or, for negative values, cropped) on its trailing spatial dims; no copy when all pads are 0."""
    n = len(begin)
    if not any(begin) and not any(end):
        return x
    lead = x.ndim - n
    if min(min(begin), min(end)) < 0:  # crop first, then pad what remains positive
        crop = tuple([slice(None)] * lead + [slice(max(-b, 0), x.shape[lead + i] - max(-e, 0))
                                             for i, (b, e) in enumerate(zip(begin, end))])
        x = x[crop]
        begin = [max(b, 0) for b in begin]
        end = [max(e, 0) for e in end]
        if not any(begin) and not any(end):
            return x
    shape = x.shape[:lead] + tuple(x.shape[lead + i] + begin[i] + end[i] for i in range(n))
    out = np.full(shape, value, dtype=x.dtype) if value else np.zeros(shape, dtype=x.dtype)
    out[(Ellipsis,) + tuple(slice(b, b + x.shape[lead + i]) for i, b in enumerate(begin))] = x
    return out


def tap_slices(tap: Sequence[int], strides: Sequence[int], dilations: Sequence[int],
               out: Sequence[int]) -> tuple[slice, ...]:
    """Slices selecting, for every output position, the input element under kernel tap ``tap``."""
    return tuple(slice(t * d, t * d + (o - 1) * s + 1, s) for t, s, d, o in zip(tap, strides, dilations, out))


def kernel_taps(kernel: Sequence[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(int(k)) for k in kernel)))


def flat_windows(in_shape: Sequence[int], kernel: Sequence[int], strides: Sequence[int], dilations: Sequence[int],
                 begin: Sequence[int], end: Sequence[int], out: Sequence[int]) -> "FlatWindows":
    """A (cached, immutable, shareable between threads) `FlatWindows` for this geometry."""
    return _flat_windows_cached(*(tuple(int(v) for v in a) for a in (in_shape, kernel, strides, dilations,
                                                                       begin, end, out)))


@functools.lru_cache(maxsize=1024)
def _flat_windows_cached(*geometry: tuple[int, ...]) -> "FlatWindows":
    return FlatWindows(*geometry)


class FlatWindows:
    """Sliding windows as contiguous 1-D slices of a flattened, padded (and polyphase-split) input.

    NumPy is slow on many short rows, and a 2-D window slice of a small feature map is just that.
    Flattening the padded spatial dims makes "the element under tap t for every output position"
    a single contiguous run ``flat[..., off_t : off_t + L]`` over a *virtual* output grid that
    keeps the padded row width (the extra columns are garbage, dropped by `crop`). Strides
    > 1 are handled by first splitting the padded input into its ``prod(strides)`` phases
    (polyphase), so that every tap reads one phase with unit stride.
    """

    def __init__(self, in_shape: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
                 dilations: Sequence[int], begin: Sequence[int], end: Sequence[int], out: Sequence[int]):
        n = len(in_shape)
        self.in_shape, self.strides, self.begin, self.out = list(in_shape), list(strides), list(begin), list(out)
        # padded extent: the explicit pads, or more where ceil_mode lets the last window overhang
        padded = [max(i + b + e, (o - 1) * s + (k - 1) * d + 1)
                  for i, b, e, o, s, k, d in zip(in_shape, begin, end, out, strides, kernel, dilations)]
        self.q = [-(-p // s) for p, s in zip(padded, strides)]  # per-phase extent of each axis
        self.plane = math.prod(self.q)
        self.phases = math.prod(strides)
        row = math.prod(self.q[1:])
        self.length = out[0] * row  # virtual outputs: out[0] rows of the full phase-plane width
        self.total = self.phases * self.plane + row  # slack so that the last tap's run stays inside
        self.kernel, self.dilations = [int(k) for k in kernel], [int(d) for d in dilations]
        self.qstride = qstride = [math.prod(self.q[k + 1:]) for k in range(n)]
        self.offsets = []
        for tap in kernel_taps(kernel):
            pos = [t * d for t, d in zip(tap, dilations)]
            phase = int(np.ravel_multi_index([p % s for p, s in zip(pos, strides)], strides)) if n else 0
            self.offsets.append(phase * self.plane + sum((p // s) * qs for p, s, qs in zip(pos, strides, qstride)))

    def load(self, x: np.ndarray, fill: float = 0) -> np.ndarray:
        """The flat buffer ``(lead..., total)`` holding ``x`` padded with ``fill`` and phase-split."""
        n = len(self.q)
        lead = x.shape[:x.ndim - n]
        buf = np.full(lead + (self.total,), fill, dtype=x.dtype) if fill else np.zeros(lead + (self.total,), x.dtype)
        planes = buf[..., :self.phases * self.plane].reshape(lead + tuple(self.strides) + tuple(self.q))
        for phase in itertools.product(*(range(s) for s in self.strides)):
            dst, src = [], []
            for r, s, b, size in zip(phase, self.strides, self.begin, self.in_shape):
                q0 = max(0, -(-(b - r) // s))  # first phase index whose padded position is inside x
                i0 = r + q0 * s - b
                cnt = len(range(i0, size, s))
                dst.append(slice(q0, q0 + cnt))
                src.append(slice(i0, i0 + (cnt - 1) * s + 1 if cnt else i0, s))
            planes[(Ellipsis,) + phase + tuple(dst)] = x[(Ellipsis,) + tuple(src)]
        return buf

    def tap(self, buf: np.ndarray, i: int) -> np.ndarray:
        """Input values under tap ``i`` for every virtual output position (a view)."""
        off = self.offsets[i]
        return buf[..., off:off + self.length]

    def columns(self, buf: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """im2col over the flat buffer (or a slice of its leading dims): ``(lead..., taps, L)``."""
        lead = buf.shape[:-1]
        shape = lead + (len(self.offsets), self.length)
        if self.phases == 1:  # unit strides: taps form a regular grid, so one strided copy does it
            item = buf.itemsize
            view = as_strided(buf, shape=lead + tuple(self.kernel) + (self.length,),
                              strides=buf.strides[:-1] + tuple(d * qs * item for d, qs in zip(self.dilations, self.qstride))
                              + (item,), writeable=False)
            if out is None:
                return view.reshape(shape)
            np.copyto(out.reshape(lead + tuple(self.kernel) + (self.length,)), view)
            return out
        cols = np.empty(shape, dtype=buf.dtype) if out is None else out
        for i in range(len(self.offsets)):
            cols[..., i, :] = self.tap(buf, i)
        return cols

    def crop(self, y: np.ndarray, copy: bool = True) -> np.ndarray:
        """Drop the garbage virtual columns of ``y`` (``(lead..., L)``) → ``(lead..., *out)``.

        With ``copy=False`` the result may be a strided view, for callers that make a new array anyway.
        """
        lead = y.shape[:-1]
        y = y.reshape(lead + (self.out[0],) + tuple(self.q[1:]))
        if all(o == q for o, q in zip(self.out[1:], self.q[1:])):
            return y
        y = y[(Ellipsis,) + tuple(slice(0, o) for o in self.out)]
        return np.ascontiguousarray(y) if copy else y
