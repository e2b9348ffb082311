"""Conv and ConvTranspose.

Convolutions are lowered to GEMMs so that the heavy lifting happens in BLAS (which releases the
GIL). 1-D and 2-D convs run as tiled GEMMs (`.conv_gemm`: im2col, GEMM, bias and the fused
activation one cache-sized block of outputs at a time), 3x3 ones at unit stride on maps of
some size by Winograd's F(4x4, 3x3) (`.conv_winograd`: a quarter of the multiply-adds), stems
and other deep windows on direct kernels (`.conv_direct`), 1x1 ones on register-blocked GEMMs
(`.conv_pointwise`); depthwise ones (one input channel per group) are no GEMM and run on compiled
loops over the kernel taps (`.conv_kernels`, where the choice of loop order is measured and
documented). 3-D and higher convs build their im2col matrix
from `windows.FlatWindows` (long contiguous runs rather than many short rows) and run one
(batched) matmul over all groups; their depthwise ones, per-channel im2col + tiny GEMMs.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .base import Op
from .conv_gemm import conv2d as conv2d_gemm
from .conv_gemm import exact_im2col_pays
from .conv_gemm import small_conv as conv2d_small
from .conv_direct import direct_plan, panel_plan, run_direct, run_direct_panels, takes_direct, takes_direct_panels
from .conv_pointwise import pointwise_plan, run_pointwise, takes_pointwise
from .conv_kernels import (KeepWeights, depthwise2d, depthwise_plan, keep_nothing, run_depthwise, run_tasks,
                           threads_for)
from .conv_kernels import scratch as _scratch  # per-thread im2col buffers (warm pages)
from .conv_winograd import conv2d_winograd, transform_weights, winograd_runs_on, winograd_tile
from .epilogue import NO_ACTIVATION, Activations, Epilogue, apply_activations
from .linalg import gemm_dtypes, matmul
from .registry import register
from .shape import op_error
from .windows import (FlatWindows, check_spatial_attrs, flat_windows, kernel_taps, pad_spatial, spatial_attrs,
                      tap_slices, window_geometry)

# -- Conv ------------------------------------------------------------------------------------------
class _ConvBase(Op):
    """Attribute checks shared by Conv and ConvTranspose."""

    multithreaded = True  # GEMM in BLAS; large depthwise convs on conv_kernels' threads: every core
    takes_activations = True  # stored through an Epilogue (the tiled 2-D conv: as each block is stored)

    def check(self) -> None:
        check_spatial_attrs(self)
        if int(self.attr("group")) < 1:
            self.unsupported(f"group={self.attr('group')}")

    def run(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, *,
            activations: Activations = ()) -> np.ndarray:
        work, out = gemm_dtypes(x, w, b)
        epilogue = Epilogue.of(activations, work)
        operands = (x, w, b)
        if work != out or x.dtype != w.dtype:
            # narrow floats: multiplied in float32 (BLAS), rounded once to the model's type (after
            # the fused activation, when the epilogue does it)
            x, w, b = x.astype(work), w.astype(work, copy=False), None if b is None else b.astype(work, copy=False)
        y = self.convolve(x, w, b, epilogue or NO_ACTIVATION).astype(out, copy=False)
        return y if epilogue is not None else apply_activations(y, activations, operands)

    def convolve(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, epilogue: Epilogue) -> np.ndarray:
        """The convolution, every operand in one dtype, followed by ``epilogue``; a fresh array."""
        raise NotImplementedError


@register("Conv", versions=(1, 11, 22))
class Conv(_ConvBase):
    """N-D convolution (1-D, 2-D, 3-D…) with groups, dilations, strides, pads and auto_pad."""

    def check(self) -> None:
        super().check()
        # The last case with a short way, and that way: (x shape, x dtype, w, b, activations, run)
        # (see `_shortcut`); the last case without one, not looked for again each run.
        self._known: tuple | None = None
        self._plain: tuple | None = None

    def run(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, *,
            activations: Activations = ()) -> np.ndarray:
        case = (x.shape, x.dtype, w, b, activations)
        known = self._known
        if known is not None and same_case(known, case):
            return known[5](x)
        y = _ConvBase.run(self, x, w, b, activations=activations)
        if self._plain is None or not same_case(self._plain, case):
            short = self._shortcut(x, w, b, activations)
            if short is None:
                self._plain = case
            else:
                self._known = case + (short,)
        return y

    def bound_run(self, activations: Activations = ()) -> Callable[[list], list]:
        # `run`'s test for its short way made here, on the list a job holds: a small conv's call
        # (a voice detector's 1-D convs, MobileNetV3's squeeze-and-excitation ones) went through
        # four calls and a case tuple before it, ~1 µs of a 5 µs layer. (Not for a conv whose
        # layer does more than the conv, `ConvMaxPool` and the like: their own `run`.)
        run = self.run
        if type(self).run is not Conv.run:
            return super().bound_run(activations)

        def outputs(args: list) -> list:
            x = args[0]
            known = self._known
            if (known is not None and x.shape == known[0] and x.dtype == known[1] and args[1] is known[2]
                    and (args[2] if len(args) > 2 else None) is known[3] and activations is known[4]):
                return [known[5](x)]
            return [run(*args, activations=activations)]

        return outputs

    def _shortcut(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
                  activations: Activations) -> Callable[[np.ndarray], np.ndarray] | None:
        """The short way to run this case again (the same input shape, the same weight, bias and
        activations objects: a model's constants), with its activations done by the epilogue, or
        None. The full way costs 10-50 µs of Python a call, run cold after a kernel has streamed
        through the caches, for kernels of a few to a few hundred microseconds (MobileNetV3's 18
        squeeze-and-excitation 1x1 convs on 1x1 maps, a voice detector's 1-D convs, depthwise
        layers): the short way does only what the full one ends in, on the same operands, so the
        same bits. Float32 only, activations the epilogue does; 1-D convs as 2-D ones one row
        high; the first that applies of:

        - Winograd, where the full way takes it;
        - a depthwise conv: its compiled loop as planned once (`conv_kernels.depthwise_plan`),
          then the activation;
        - a float32 stem (a few input channels): the direct kernel as planned once
          (`conv_direct`);
        - a float32 1x1 conv without padding on a map of some size: the panel GEMM as planned
          once (`conv_pointwise`);
        - a smaller 1x1 conv of one image, stride 1, no padding, one group: one GEMM, then bias
          and activation in place (`conv_gemm.conv2d`'s pointwise path);
        - a conv small enough to run whole on the calling thread in one compiled call
          (`conv_gemm.small_conv`);
        - any other: `conv_gemm.conv2d` called straight away."""
        if (x.ndim not in (3, 4) or w.ndim != x.ndim or x.dtype != np.float32 or w.dtype != np.float32
                or (b is not None and (b.dtype != np.float32 or b.shape != (w.shape[0],)))):
            return None
        epilogue = Epilogue.of(activations, np.dtype(np.float32))
        if epilogue is None:  # (activations applied after the conv: the full way)
            return None
        group = int(self.attr("group"))
        _, strides, dilations, begin, end, out = self._windows(x.shape, w.shape)
        if math.prod(out) == 0 or x.shape[0] == 0 or x.shape[1] != w.shape[1] * group or w.shape[0] % group:
            return None  # (nothing to compute, or operands that do not fit: the full way says so)
        if x.ndim == 3:  # 1-D: a 2-D conv over a map one row high, as `convolve` runs it
            short = _shortcut_2d(x.shape[:2] + (1, x.shape[2]), w[:, :, None], b, group, (1,) + strides,
                                 (1,) + dilations, (0,) + begin, (0,) + end, (1,) + out, epilogue)
            if short is None:
                return None
            as_2d, shape = x.shape[:2] + (1, x.shape[2]), (x.shape[0], w.shape[0], *out)
            return lambda x1: short(x1.reshape(as_2d)).reshape(shape)
        tile = 0 if w.shape[1] == 1 and group > 1 else self._winograd_tile(x, w)
        if tile:
            # the weights' transform the full way kept: none when they are no constant (then each
            # run transforms its own, and there is no short way to take)
            u = self.derived_constant(f"winograd{tile}", 1, w, lambda: transform_weights(w, tile), create=False)
            if u is None:
                return None

            def winograd(x1: np.ndarray) -> np.ndarray:
                x1 = np.ascontiguousarray(x1)
                if winograd_runs_on(x1, u):
                    return conv2d_winograd(x1, u, b, begin, out, epilogue)
                return conv2d_gemm(x1, w, b, group, strides, dilations, begin, end, out, epilogue)
            return winograd
        return _shortcut_2d(x.shape, w, b, group, strides, dilations, begin, end, out, epilogue,
                            lambda name, work_out: self.derived(name, {1: w}, work_out))

    def convolve(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, epilogue: Epilogue) -> np.ndarray:
        group = int(self.attr("group"))
        nsp = x.ndim - 2
        if x.ndim < 3 or w.ndim != x.ndim or x.shape[1] != w.shape[1] * group or w.shape[0] % group:
            raise op_error(self, f"input of shape {x.shape} and weights of shape {w.shape} do not fit "
                                 f"(group {group}: weights (M, C/group, kernel...), M a multiple of the group)")
        if b is not None and b.shape != (w.shape[0],):
            raise op_error(self, f"bias of shape {b.shape} for {w.shape[0]} output channels")
        kernel, strides, dilations, begin, end, out = self._windows(x.shape, w.shape)
        n, m = x.shape[0], w.shape[0]
        if math.prod(out) == 0 or n == 0:
            return epilogue.apply_inplace(np.zeros((n, m, *out), dtype=np.result_type(x.dtype, w.dtype)))
        if nsp == 1:  # 1-D: a 2-D conv over a map one row high
            y = _conv2d(x[:, :, None], w[:, :, None], b, group, (1,) + strides, (1,) + dilations, (0,) + begin,
                        (0,) + end, (1,) + out, epilogue)
            return y.reshape(n, m, *out)
        if nsp == 2:
            tile = self._winograd_tile(x, w)
            if tile:
                x = np.ascontiguousarray(x)
                u = self.derived(f"winograd{tile}", {1: w}, lambda: transform_weights(w, tile))
                if winograd_runs_on(x, u):
                    return conv2d_winograd(x, u, b, begin, out, epilogue)
            return _conv2d(x, w, b, group, strides, dilations, begin, end, out, epilogue,
                           lambda name, work_out: self.derived(name, {1: w}, work_out))
        return epilogue.apply_inplace(self._convolve_nd(x, w, b, group, kernel, strides, dilations, begin, end, out))

    def _winograd_tile(self, x: np.ndarray, w: np.ndarray) -> int:
        """`conv_winograd.winograd_tile` of a 2-D conv of these operands (0: no Winograd), once per shape."""
        def work_out() -> int:
            _, strides, dilations, begin, end, out = self._windows(x.shape, w.shape)
            return winograd_tile(x.shape, w.shape, int(self.attr("group")), strides, dilations, begin, end, out,
                                 x.dtype)
        return self.per_shape(("winograd", x.shape, w.shape, x.dtype), work_out)

    def _windows(self, x_shape: tuple[int, ...], w_shape: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
        """``kernel, strides, dilations, begin, end, out`` for these operand shapes (`per_shape`),
        as tuples of ints (hashable: `conv_gemm` keys its layouts on them)."""
        def work_out() -> tuple[tuple[int, ...], ...]:
            kernel = list(self.attr("kernel_shape", None) or w_shape[2:])
            strides, dilations, pads = spatial_attrs(self, len(x_shape) - 2, kernel)
            begin, end, out = window_geometry(x_shape[2:], kernel, strides, dilations, pads, self.attr("auto_pad"))
            strides = [1 if o == 1 else s for s, o in zip(strides, out)]  # one position: no step to take
            return tuple(tuple(int(v) for v in a) for a in (kernel, strides, dilations, begin, end, out))
        return self.per_shape((x_shape, w_shape), work_out)

    def _convolve_nd(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, group: int, kernel: list[int],
                     strides: list[int], dilations: list[int], begin: list[int], end: list[int],
                     out: list[int]) -> np.ndarray:
        """3-D and higher: im2col over flat windows (or exactly) and grouped GEMMs."""
        nsp = x.ndim - 2
        n, c = x.shape[:2]
        m = w.shape[0]
        cg, mg = c // group, m // group
        dtype = np.result_type(x.dtype, w.dtype)
        p = math.prod(out)
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
        win = flat_windows(x.shape[2:], kernel, strides, dilations, begin, end, out)
        if (cg > 1 or group == 1) and all(d == 1 for d in dilations) and exact_im2col_pays(win, p, strides):
            cols = _exact_columns(x, kernel, strides, begin, end, out)
            y = _grouped_matmul(w.reshape(group, mg, -1), cols.reshape(n, group, -1, p)).reshape(n, m, *out)
            if bias is not None:  # a pass over the output, in cache: cheaper than weights with a bias column
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
            # im2col (N, C·K, L), L virtual output positions, in this thread's reusable scratch
            cols = _scratch((n, rows, win.length), buf.dtype)
            win.columns(buf, out=cols.reshape(n, c, taps, win.length))
            y = _grouped_matmul(w.reshape(group, mg, -1), cols.reshape(n, group, cg * taps, win.length))
        y = win.crop(y.reshape(n, m, win.length), copy=False)
        if bias is not None:  # the bias add doubles as the copy dropping the virtual columns
            return np.add(y, bias, dtype=dtype) if not y.flags.c_contiguous else np.add(y, bias, out=y)
        return np.ascontiguousarray(y)


def _conv2d(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, group: int, strides: Sequence[int],
            dilations: Sequence[int], begin: Sequence[int], end: Sequence[int], out: Sequence[int],
            epilogue: Epilogue, keep: KeepWeights = keep_nothing) -> np.ndarray:
    """2-D: depthwise on its compiled loops (`conv_kernels`), a float32 stem on the direct kernel
    (`conv_direct`), float32 1x1 on the panel GEMM (`conv_pointwise`; ``keep`` keeps each one's
    form of constant weights), any other as tiled GEMM (`conv_gemm`)."""
    route = route_2d(x.shape, w.shape, group, tuple(strides), tuple(dilations), tuple(begin), tuple(end), tuple(out),
                     x.dtype)
    if route == DEPTHWISE:
        return depthwise2d(x, w, b, strides, dilations, begin, out, keep, epilogue)
    if route == DIRECT:
        return run_direct(direct_plan(x.shape, w, b, tuple(strides), tuple(begin), tuple(out), epilogue, keep), x)
    if route == DIRECT_PANELS:
        return run_direct_panels(panel_plan(x.shape, w, b, tuple(strides), tuple(dilations), tuple(begin), tuple(out),
                                            epilogue, keep), x)
    if route == POINTWISE:
        return run_pointwise(pointwise_plan(x.shape, w, b, group, tuple(strides), tuple(out), epilogue, keep), x)
    return conv2d_gemm(x, w, b, group, strides, dilations, begin, end, out, epilogue)


#: The kernels of a 2-D conv (`route_2d`).
DEPTHWISE, DIRECT, DIRECT_PANELS, POINTWISE, GEMM = "depthwise", "direct", "direct panels", "pointwise", "gemm"


def route_2d(x_shape: tuple[int, ...], w_shape: tuple[int, ...], group: int, strides: tuple[int, ...],
             dilations: tuple[int, ...], begin: tuple[int, ...], end: tuple[int, ...], out: tuple[int, ...],
             dtype: np.dtype) -> str:
    """Which kernel a 2-D conv runs on, the first that takes it of: `DEPTHWISE` (one input channel
    a group), `DIRECT` (a stem), `DIRECT_PANELS`, `POINTWISE` (a 1x1 conv on the panel GEMM), else
    `GEMM` (tiled im2col)."""
    if w_shape[1] == 1 and group > 1:
        return DEPTHWISE
    if takes_direct(x_shape, w_shape, group, strides, dilations, out, dtype):
        return DIRECT
    if takes_direct_panels(x_shape, w_shape, group, strides, out, dtype):
        return DIRECT_PANELS
    if takes_pointwise(x_shape, w_shape, group, begin, end, out, dtype):
        return POINTWISE
    return GEMM


def same_case(known: tuple, case: tuple) -> bool:
    """Whether ``case`` (x shape, x dtype, w, b, activations) is ``known``'s: equal shapes and
    dtypes, the very same weight, bias and activations objects."""
    return (case[0] == known[0] and case[1] == known[1] and case[2] is known[2] and case[3] is known[3]
            and case[4] is known[4])


def _shortcut_2d(x_shape: tuple[int, ...], w: np.ndarray, b: np.ndarray | None, group: int,
                 strides: tuple[int, ...], dilations: tuple[int, ...], begin: tuple[int, ...], end: tuple[int, ...],
                 out: tuple[int, ...], epilogue: Epilogue,
                 keep: KeepWeights = keep_nothing) -> Callable[[np.ndarray], np.ndarray] | None:
    """`Conv._shortcut` of a float32 2-D conv (not one that took Winograd): a depthwise one as
    `conv_kernels.run_depthwise` runs its plan (its taps from ``keep``: those the full way kept)
    and the activation; a stem the direct kernel takes, as planned once
    (`conv_direct.direct_plan`); a 1x1 conv the panel GEMM takes, as planned once
    (`conv_pointwise.pointwise_plan`); a smaller 1x1 conv of one image, stride 1, no padding, one
    group as `conv_gemm.conv2d`'s pointwise path does it (one GEMM, then bias and activation in
    place); else `conv_gemm.small_conv`, else `conv_gemm.conv2d`."""
    route = route_2d(x_shape, w.shape, group, strides, dilations, begin, end, out, np.dtype(np.float32))
    if route == DEPTHWISE:
        plan = depthwise_plan(x_shape, np.dtype(np.float32), w, b, strides, dilations, begin, out, keep)
        return lambda x: run_depthwise(plan, x, epilogue)
    if route == DIRECT:
        direct = direct_plan(x_shape, w, b, strides, begin, out, epilogue, keep)
        return functools.partial(run_direct, direct)
    if route == DIRECT_PANELS:
        panels = panel_plan(x_shape, w, b, strides, dilations, begin, out, epilogue, keep)
        return functools.partial(run_direct_panels, panels)
    if route == POINTWISE:
        planned = pointwise_plan(x_shape, w, b, group, strides, out, epilogue, keep)
        return functools.partial(run_pointwise, planned)
    if (x_shape[0] == 1 and w.shape[2:] == (1, 1) and group == 1 and strides == (1, 1) and not any(begin)
            and not any(end) and out == x_shape[2:]):
        m, c = w.shape[:2]
        weights, planes = np.ascontiguousarray(w).reshape(m, c), (c, x_shape[2] * x_shape[3])
        bias = (np.zeros(m, np.float32) if b is None else np.ascontiguousarray(b)) \
            if b is not None or epilogue != NO_ACTIVATION else None

        def pointwise(x: np.ndarray) -> np.ndarray:
            y = matmul(weights, np.ascontiguousarray(x).reshape(planes))
            if bias is not None:
                epilogue.apply(y, bias)
            return y.reshape((1, m) + out)
        return pointwise
    small = conv2d_small(x_shape, w, b, group, strides, dilations, begin, end, out, epilogue)
    if small is not None:
        return small
    return lambda x: conv2d_gemm(x, w, b, group, strides, dilations, begin, end, out, epilogue)


def _exact_columns(x: np.ndarray, kernel: Sequence[int], strides: Sequence[int], begin: Sequence[int],
                   end: Sequence[int], out: Sequence[int]) -> np.ndarray:
    """im2col ``(N, C·taps, P)`` over exactly the P output positions (undilated kernels), in scratch."""
    n, c = x.shape[:2]
    rows, p = c * math.prod(kernel), math.prod(out)
    xp = pad_spatial(x, begin, end)
    # (N, C, k…, o…): window origin on the strided output grid, tap offset inside the window
    shape = (n, c) + tuple(kernel) + tuple(out)
    strides_b = xp.strides[:2] + xp.strides[2:] + tuple(st * s for st, s in zip(xp.strides[2:], strides))
    view = as_strided(xp, shape=shape, strides=strides_b, writeable=False)
    cols = _scratch((n, rows, p), x.dtype)
    np.copyto(cols.reshape(shape), view)
    return cols


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

    def convolve(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, epilogue: Epilogue) -> np.ndarray:
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
        return epilogue.apply_inplace(np.ascontiguousarray(y))
