"""Conv and ConvTranspose, plus the window geometry shared with the pooling ops.

Convolutions are lowered to GEMMs so that the heavy lifting happens in BLAS (which releases the
GIL): a 1x1 stride-1 unpadded conv is a GEMM on the ``(C, H*W)`` view of the input; any other conv
builds its im2col matrix with a single strided copy of the padded input and runs one (batched)
matmul over all groups. Depthwise convs (one input channel per group) are no GEMM: 2-D ones run
on compiled loops over the kernel taps (`.conv_kernels`, where the choice of loop order is
measured and documented), the rest as per-channel im2col + a stack of tiny GEMMs.
im2col is built from `FlatWindows` — long contiguous runs rather than many short rows,
since NumPy's per-row overhead would otherwise dominate on small feature maps.
"""
from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .base import Op
from .compiled.im2col import im2col2d
from .conv_kernels import depthwise2d, run_tasks, threads_for
from .conv_kernels import scratch as _scratch  # per-thread im2col buffers (warm pages)
from .linalg import gemm_dtypes, matmul
from .registry import register

_AUTO_PADS = ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER")
# When the flat-window im2col would compute this many times the real outputs (the garbage columns
# of small padded maps: 9/7 of the work at 7x7), an exact im2col copy is cheaper than the waste.
EXACT_IM2COL_WASTE = 1.2
# Strided convs with at most this many taps (3x3/s2, the 2x2 and 4x4 "patchify" convs, stems) also
# take the exact im2col: the flat windows would split the whole input into phases and crop the
# result, two passes that cost more than the exact copy's strided reads (measured: -10..-40% on
# the stems and 3x3/s2 layers of bench/conv_shapes.py; with 49 taps, the 7x7/s2 stem, +15%).
EXACT_IM2COL_MAX_STRIDED_TAPS = 16
# Kernels with more taps than this (1-D STFT-like filters: 256 taps) always take the exact im2col:
# flat windows copy one slice per tap in Python, the exact copy is one strided copy (lstm_vad's
# 256-tap STFT conv: 280 -> 20 us).
EXACT_IM2COL_MIN_TAPS = 64


# -- geometry shared with pool.py ------------------------------------------------------------------
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


# -- Conv ------------------------------------------------------------------------------------------
class _ConvBase(Op):
    """Attribute checks shared by Conv and ConvTranspose."""

    multithreaded = True  # GEMM in BLAS; large depthwise convs on conv_kernels' threads: every core

    def check(self) -> None:
        check_spatial_attrs(self)
        if int(self.attr("group")) < 1:
            self.unsupported(f"group={self.attr('group')}")

    def run(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        work, out = gemm_dtypes(x, w, b)
        if work == out and x.dtype == w.dtype:
            return self.convolve(x, w, b)
        # narrow floats: multiplied in float32 (BLAS), rounded once to the model's type
        y = self.convolve(x.astype(work), w.astype(work, copy=False), None if b is None else b.astype(work, copy=False))
        return y.astype(out, copy=False)

    def convolve(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        """The convolution, every operand in one dtype."""
        raise NotImplementedError


@register("Conv", versions=(1, 11, 22))
class Conv(_ConvBase):
    """N-D convolution (1-D, 2-D, 3-D…) with groups, dilations, strides, pads and auto_pad."""

    def convolve(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        group = int(self.attr("group"))
        nsp = x.ndim - 2
        kernel = list(self.attr("kernel_shape", None) or w.shape[2:])
        strides, dilations, pads = spatial_attrs(self, nsp, kernel)
        n, c = x.shape[:2]
        m = w.shape[0]
        cg, mg = c // group, m // group
        begin, end, out = window_geometry(x.shape[2:], kernel, strides, dilations, pads, self.attr("auto_pad"))
        strides = [1 if o == 1 else s for s, o in zip(strides, out)]  # one position: no step to take
        dtype = np.result_type(x.dtype, w.dtype)
        p = math.prod(out)
        if p == 0 or n == 0:
            return np.zeros((n, m, *out), dtype=dtype)
        bias = None if b is None else b.reshape((m,) + (1,) * nsp)
        if all(k == 1 for k in kernel) and not any(begin) and not any(end):
            # pointwise: the input (subsampled when strided) already is the GEMM operand
            if any(s > 1 for s in strides) or tuple(out) != x.shape[2:]:
                x = x[(Ellipsis,) + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out, strides))]
            cols = x.reshape(n, group, cg, p)
            y = _grouped_matmul(w.reshape(group, mg, cg), cols).reshape(n, m, *out)
            if bias is not None:
                y += bias
            return y
        if cg == 1 and group > 1 and nsp == 2:
            # depthwise: compiled loops over the taps, no im2col (see conv_kernels.py)
            return depthwise2d(x, w, b, strides, dilations, begin, out)
        win = flat_windows(x.shape[2:], kernel, strides, dilations, begin, end, out)
        fold_bias = b is not None and group == 1  # as a row of ones in im2col: BLAS adds it
        if (cg > 1 or group == 1) and all(d == 1 for d in dilations) and _exact_im2col_pays(win, p, strides):
            cols = _exact_columns(x, kernel, strides, begin, end, out, ones_row=fold_bias)
            wk = _with_bias(w, b) if fold_bias else w.reshape(group, mg, -1)
            y = _grouped_matmul(wk, cols.reshape(n, group, -1, p)).reshape(n, m, *out)
            if bias is not None and not fold_bias:
                y += bias
            return y
        buf = win.load(x)
        if cg == 1:  # depthwise, one image at a time (images shared out between threads when large)
            y = np.empty((n, group, mg, win.length), dtype=dtype)
            wg = w.reshape(group, mg, -1)
            run_tasks([functools.partial(_depthwise, win, buf[i], wg, y[i]) for i in range(n)],
                      threads_for(y.size * wg.shape[2]))
        elif group == 1 and m < c:
            y = _tap_gemms(win, buf, w.reshape(m, c, -1))
        else:
            taps, rows = len(win.offsets), c * len(win.offsets)
            # im2col (N, C·K [+1], L), L virtual output positions, in this thread's reusable scratch
            cols = _scratch((n, rows + fold_bias, win.length), buf.dtype)
            win.columns(buf, out=cols[:, :rows].reshape(n, c, taps, win.length))
            if fold_bias:
                cols[:, rows] = 1
                y = _grouped_matmul(_with_bias(w, b), cols[:, None])
                return np.ascontiguousarray(win.crop(y.reshape(n, m, win.length), copy=False))
            y = _grouped_matmul(w.reshape(group, mg, -1), cols.reshape(n, group, cg * taps, win.length))
        y = win.crop(y.reshape(n, m, win.length), copy=False)
        if bias is not None:  # the bias add doubles as the copy dropping the virtual columns
            return np.add(y, bias, dtype=dtype) if not y.flags.c_contiguous else np.add(y, bias, out=y)
        return np.ascontiguousarray(y)


def _exact_im2col_pays(win: FlatWindows, p: int, strides: Sequence[int]) -> bool:
    """Exact im2col over the P outputs rather than flat windows: small maps, small strided kernels."""
    return (win.length > EXACT_IM2COL_WASTE * p or len(win.offsets) > EXACT_IM2COL_MIN_TAPS
            or (max(strides) > 1 and len(win.offsets) <= EXACT_IM2COL_MAX_STRIDED_TAPS))


def _exact_columns(x: np.ndarray, kernel: Sequence[int], strides: Sequence[int], begin: Sequence[int],
                   end: Sequence[int], out: Sequence[int], ones_row: bool = False) -> np.ndarray:
    """im2col ``(N, C·taps [+1], P)`` over exactly the P output positions (undilated kernels), in
    scratch; ``ones_row`` appends a row of ones, the bias's partner in `_with_bias`."""
    n, c = x.shape[:2]
    rows, p = c * math.prod(kernel), math.prod(out)
    if len(kernel) == 2 and x.dtype in (np.float32, np.float64):  # compiled: no padded copy
        cols = _scratch((n, rows + ones_row, p), x.dtype)
        x = np.ascontiguousarray(x)
        geometry = ((int(kernel[0]), int(kernel[1])), int(out[1]), tuple(int(s) for s in strides), (1, 1),
                    (int(begin[0]), int(begin[1])))
        for i in range(n):
            im2col2d(x[i], cols[i], *geometry)
        if ones_row:
            cols[:, rows] = 1
        return cols
    xp = pad_spatial(x, begin, end)
    # (N, C, k…, o…): window origin on the strided output grid, tap offset inside the window
    shape = (n, c) + tuple(kernel) + tuple(out)
    strides_b = xp.strides[:2] + xp.strides[2:] + tuple(st * s for st, s in zip(xp.strides[2:], strides))
    view = as_strided(xp, shape=shape, strides=strides_b, writeable=False)
    cols = _scratch((n, rows + ones_row, p), x.dtype)
    np.copyto(cols[:, :rows].reshape(shape), view)
    if ones_row:
        cols[:, rows] = 1
    return cols


def _with_bias(w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(1, M, C·taps + 1)``: the weights of an ungrouped conv with the bias as a last column.

    Against im2col with a row of ones, the GEMM adds the bias as it writes each output: no pass
    over the output of its own.
    """
    m = w.shape[0]
    wb = np.empty((1, m, w[0].size + 1), dtype=w.dtype)
    wb[0, :, :-1] = w.reshape(m, -1)
    wb[0, :, -1] = b
    return wb


_CACHE_BYTES = 256 * 1024  # im2col block size for depthwise convs: stays in L2 between copy and use


def _depthwise(win: FlatWindows, buf: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:
    """One input channel per group: im2col + a stack of tiny GEMMs, in channel blocks, into ``out``.

    The per-channel columns are ``taps`` times the input; building and consuming them a block at a
    time keeps them in cache instead of streaming a large im2col matrix through memory.
    ``buf`` is the flat input of one image ``(C, total)``, ``w`` is ``(C, mult, taps)``, ``out`` is
    ``(C, mult, L)``. (1-D and 3-D depthwise convs; 2-D ones run on ``conv_kernels.depthwise2d``.)
    """
    c, mult, taps = w.shape
    block = max(1, _CACHE_BYTES // (taps * win.length * buf.itemsize))
    scratch = _scratch((min(block, c), taps, win.length), buf.dtype)
    for c0 in range(0, c, block):
        c1 = min(c, c0 + block)
        cols = win.columns(buf[c0:c1], out=scratch[:c1 - c0])
        np.matmul(w[c0:c1], cols, out=out[c0:c1])


def _tap_gemms(win: FlatWindows, buf: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Convolution as one GEMM per kernel tap, accumulated, reading the input in place.

    With fewer output than input channels (DenseNet's 128→32 3x3 convs), the im2col matrix is
    the bulk of the memory traffic while each of its elements feeds few multiply-adds; GEMMs
    straight on the tap views (BLAS takes their row stride) skip that copy. ``w`` is (M, C, taps).
    """
    y = np.matmul(w[:, :, 0], win.tap(buf, 0))
    partial = np.empty_like(y)
    for i in range(1, w.shape[2]):
        np.matmul(w[:, :, i], win.tap(buf, i), out=partial)
        y += partial
    return y


def _grouped_matmul(w: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``(G, Mg, K) @ (N, G, K, L)`` → ``(N, G, Mg, L)``: one BLAS call per (image, group), a
    large one split across the pool's idle threads (``linalg.matmul``).

    A batch of one is passed without its batch axis: a plain stack of matmuls is cheaper than a
    broadcast one.
    """
    if cols.shape[0] == 1:
        return matmul(w, cols[0])[None]
    return matmul(w, cols)


# -- ConvTranspose ---------------------------------------------------------------------------------
@register("ConvTranspose", versions=(1, 11, 22))
class ConvTranspose(_ConvBase):
    """Transposed convolution as GEMM (input → per-tap contributions) followed by col2im scatter-adds."""

    def convolve(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
        group = int(self.attr("group"))
        nsp = x.ndim - 2
        n, c = x.shape[:2]
        cg = c // group
        mg = w.shape[1]
        m = mg * group
        kernel = [int(k) for k in (self.attr("kernel_shape", None) or w.shape[2:])]
        strides, dilations, pads = spatial_attrs(self, nsp, kernel)
        out_pad = list(self.attr("output_padding", None) or [0] * nsp)
        auto_pad = self.attr("auto_pad")
        in_sp = x.shape[2:]
        # size of the full (unpadded) result of scattering every tap
        full = [s * (i - 1) + op + (k - 1) * d + 1
                for s, i, op, k, d in zip(strides, in_sp, out_pad, kernel, dilations)]
        target = self.attr("output_shape", None)
        if target is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            if target is not None:
                target = [int(v) for v in list(target)[-nsp:]]
            else:
                target = [i * s for i, s in zip(in_sp, strides)]
            total = [f - t for f, t in zip(full, target)]
            if auto_pad == "SAME_UPPER":
                begin = [t // 2 for t in total]
            else:
                begin = [t - t // 2 for t in total]
            end = [t - bg for t, bg in zip(total, begin)]
        elif auto_pad == "VALID":
            begin, end = [0] * nsp, [0] * nsp
        else:
            begin, end = [int(p) for p in pads[:nsp]], [int(p) for p in pads[nsp:]]
        dtype = np.result_type(x.dtype, w.dtype)
        kk = math.prod(kernel)
        p = math.prod(in_sp)
        # cols[n, g, mg, tap, p] = sum_c w[g, c, mg, tap] * x[n, g, c, p]
        wg = w.reshape(group, cg, mg * kk).transpose(0, 2, 1)
        cols = np.matmul(wg, x.reshape(n, group, cg, p)).reshape(n, m, kk, *in_sp)
        y = np.zeros((n, m, *full), dtype=dtype)
        for i, tap in enumerate(kernel_taps(kernel)):
            y[(slice(None), slice(None)) + tap_slices(tap, strides, dilations, in_sp)] += cols[:, :, i]
        y = pad_spatial(y, [-v for v in begin], [-v for v in end])
        if b is not None:
            y = y + b.reshape((m,) + (1,) * nsp).astype(dtype, copy=False)
        return np.ascontiguousarray(y)
