"""Pooling ops: MaxPool, AveragePool, LpPool and their global variants.

2-D float max and average pools run on compiled loops (`compiled.pool`; an average pool sums,
then divides by each window's count): one over the tiles when the windows tile the map, else long
passes over padded planes laid end to end at unit strides and on small maps (`flat_pays`), else a
separable loop (down the columns first at vertical strides above one). Other windowed pools reduce
over kernel taps with whole-array NumPy ops: separably (one axis at a time) where the reduction
allows, else one op per tap on the flat, polyphase-split input of `FlatWindows` (long contiguous
runs instead of many short rows), sharing the window geometry with Conv.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..concurrency import parallel, spin_team
from .base import Op
from ..concurrency.spin_team import wait_parts
from .compiled.pool import (COLUMNS_FIRST, FIRST_PART_KIND, FLAT, LOOP_RANGES, ROWS_FIRST, THREE_BY_ONE_MAX,
                            THREE_BY_ONE_MEAN, THREE_BY_ONE_SUM, THREE_BY_TWO, TILES, post_pool)
from .compiled.rows import row_means
from .conv_kernels import TEAM_MIN_MACS, run_tasks, threads_for
from .windows import (FlatWindows, check_spatial_attrs, flat_windows, kernel_taps, pad_spatial, spatial_attrs,
                      window_geometry)
from .registry import register

#: Maps at most this wide take `compiled.pool.flat_pool` at any stride, through a padded copy.
#: Against the columns-first loop at 3x3/2, one thread: 832 x 14x14 157 against 238 µs, 256 x
#: 13x13 39 against 84, ShuffleNet's 136 x 28x28 average pool (pads of 1) 49 against 70; at 112
#: columns the columns-first loop wins (24 x 112x112 73 against 110).
FLAT_MAX_WIDTH = 32
#: Maps at most this wide take it when there is nothing to pad (the passes read the input in
#: place): SqueezeNet's 3x3/2 pools, one thread, 256 x 27x27 114 -> 54 µs, 128 x 55x55 145 ->
#: 108; 192 x 71x71 302 -> 269; at 111 columns the columns-first loop wins (210 against 220).
FLAT_IN_PLACE_MAX_WIDTH = 80


def flat_pays(strides: list[int], width: int, in_place: bool) -> bool:
    """Whether a 2-D pool whose windows do not tile the map takes the long flat passes
    (`compiled.pool.flat_pool`): at unit strides (576 x 14x14 3x3/1 on one thread 319 -> 120 µs,
    32 x 112x112 317 -> 260), and on maps of at most `FLAT_MAX_WIDTH` columns whatever the stride
    (`FLAT_IN_PLACE_MAX_WIDTH` where nothing is padded: ``in_place``); else the separable loop,
    row by row."""
    return (all(int(s) == 1 for s in strides) or width <= FLAT_MAX_WIDTH
            or (in_place and width <= FLAT_IN_PLACE_MAX_WIDTH))


#: Maps at most this wide with nothing to pad take the flat passes at 3x3/2 rather than the 3x3/2
#: loop (`takes_three_by_two`), which spends a row's set-up on each of their short rows. One
#: thread, 3x3/2 loop against flat passes: 512 x 9x9 13 against 9 µs, 256 x 13x13 9.4 against
#: 8.6, 832 x 14x14 29 against 29, SqueezeNet's 256 x 27x27 22 against 32, 64 x 32x32 6.5
#: against 11.5.
FLAT_THREE_BY_TWO_MAX_WIDTH = 13


def takes_three_by_two(kernel: list[int], strides: list[int], dilations: list[int], width: int,
                       in_place: bool) -> bool:
    """Whether a 2-D pool takes the 3x3/2 loop (`compiled.pool_three`): a 3x3 window at stride 2,
    no dilation, unless the map is at most `FLAT_THREE_BY_TWO_MAX_WIDTH` wide with nothing to pad
    (the flat passes over all its planes at once then win). One thread, max (sum) against the
    loop taken before: 64 x 111x111 216 -> 143 µs, 128 x 55x55 108 -> 97, ResNet's 64 x 112x112
    (pads of 1) 195 -> 149, ShuffleNet's 24 x 112x112 75 -> 58, and its average pools 136 x
    28x28 (50 -> 39) and 272 x 14x14 (39 -> 33)."""
    return (list(kernel) == [3, 3] and [int(s) for s in strides] == [2, 2] and all(int(d) == 1 for d in dilations)
            and not (in_place and width <= FLAT_THREE_BY_TWO_MAX_WIDTH))


def pool_range(loop: int, x: np.ndarray, out: np.ndarray, p0: int, p1: int, *geometry: Any) -> None:
    """Planes ``p0:p1`` of ``out`` pooled from ``x`` on ``loop``'s kernel (`compiled.pool.LOOP_RANGES`:
    each compiles on its first call, not with the others)."""
    LOOP_RANGES[loop](x, out, p0, p1, *geometry)


class _WindowPool(Op):
    """Shared attribute handling and geometry of the windowed pools, and the compiled 2-D loops
    of the max and average pools (``summing``: the loops add instead of taking the max)."""

    summing = False

    def check(self) -> None:
        check_spatial_attrs(self)
        if self.attr("kernel_shape", None) is None:
            self.unsupported("missing kernel_shape")
        if int(self.attr("ceil_mode", 0)) not in (0, 1):
            self.unsupported(f"ceil_mode={self.attr('ceil_mode')}")

    def windows(self, x: np.ndarray) -> tuple[FlatWindows, list[int], list[int], list[int]]:
        """The flat windows over ``x`` plus the explicit begin/end pads and the output size."""
        kernel = [int(k) for k in self.attr("kernel_shape")]
        strides, dilations, pads = spatial_attrs(self, x.ndim - 2, kernel)
        begin, end, out = window_geometry(x.shape[2:], kernel, strides, dilations, pads,
                                          self.attr("auto_pad"), bool(self.attr("ceil_mode", 0)))
        return flat_windows(x.shape[2:], kernel, strides, dilations, begin, end, out), begin, end, out

    def separable_reduce(self, x: np.ndarray, ufunc: np.ufunc, fill: float) -> tuple[np.ndarray, list, list, list]:
        """Reduce every window with ``ufunc`` one spatial axis at a time.

        Max and sum are separable, so a k×k window costs 2(k−1) whole-array passes instead of
        k²−1 (4 instead of 8 for 3×3), and the second axis works on an already shrunk array.
        Returns the result with the window's begin/end pads and output size.
        """
        kernel = [int(k) for k in self.attr("kernel_shape")]
        nsp = x.ndim - 2
        strides, dilations, pads = spatial_attrs(self, nsp, kernel)
        begin, end, out = window_geometry(x.shape[2:], kernel, strides, dilations, pads,
                                          self.attr("auto_pad"), bool(self.attr("ceil_mode", 0)))
        if math.prod(out) == 0 or x.size == 0:
            return np.zeros(x.shape[:2] + tuple(out), dtype=x.dtype), begin, end, out
        # pad to the explicit pads, and further where ceil_mode lets the last window overhang
        reach = [max(e, (o - 1) * s + (k - 1) * d + 1 - (size + b))
                 for e, o, s, k, d, size, b in zip(end, out, strides, kernel, dilations, x.shape[2:], begin)]
        y = pad_spatial(x, begin, reach, fill)
        for axis, (k, s, d, o) in enumerate(zip(kernel, strides, dilations, out), start=2):
            def window(tap: int) -> tuple[slice, ...]:
                return (slice(None),) * axis + (slice(tap * d, tap * d + (o - 1) * s + 1, s),)

            acc = ufunc(y[window(0)], y[window(1)]) if k > 1 else y[window(0)]
            for tap in range(2, k):
                ufunc(acc, y[window(tap)], out=acc)
            y = acc
        return np.ascontiguousarray(y), begin, end, out

    def _compiled_2d(self, x: np.ndarray, plan: "Plan2d") -> np.ndarray:
        """2-D float max (sum) pool on a compiled loop, planes shared out when large: with the
        CPU backend's spinning helpers (float32, from `TEAM_MIN_MACS` window taps: SqueezeNet's
        and ResNet's 3x3/2 pools), else between the pool's threads."""
        n, c, h, w = x.shape
        y = np.empty((n * c, *plan.out), dtype=x.dtype)
        if y.size == 0:
            return y.reshape(n, c, *plan.out)
        planes = np.ascontiguousarray(x).reshape(n * c, h, w)
        if not (plan.team and self._on_team(plan, planes, y)):
            run_tasks([functools.partial(pool_range, plan.loop, planes, y, p0, p1, *plan.geometry, plan.lowest[0],
                                         self.summing) for p0, p1 in plan.parts], plan.threads)
        return y.reshape(n, c, *plan.out)

    def _plan_of(self, x: np.ndarray) -> "Plan2d":
        """`plan_2d` for ``x``'s shape and type, made once."""
        return self.per_shape((x.shape, x.dtype), lambda: self.plan_2d(x.shape, x.dtype))

    def _on_team(self, plan: "Plan2d", planes: np.ndarray, y: np.ndarray) -> bool:
        """The planes in one share per sharer, this thread's and each spinning helper's: posted,
        this thread's run, and waited for in compiled code; False, having done nothing, when no
        team is free."""
        team = parallel.team(FIRST_PART_KIND + plan.loop)
        control = None if team is None else team.claim()
        if control is None:
            return False
        try:
            count = team.helpers + 1  # type: ignore[union-attr]
            cuts = spin_team.range_cuts(len(planes), count, 1)
            if post_pool(control, plan.loop, planes, y, cuts, plan.geometry_array, plan.lowest, self.summing):
                team.wake()  # type: ignore[union-attr]
            pool_range(plan.loop, planes, y, int(cuts[0]), int(cuts[1]), *plan.geometry, plan.lowest[0], self.summing)
            if not wait_parts(control, count - 1, spin_team.WAIT_ROUNDS):
                team.wait_posted(count - 1)  # type: ignore[union-attr]
        finally:
            team.release()  # type: ignore[union-attr]
        return True

    def plan_2d(self, shape: tuple[int, ...], dtype: np.dtype) -> "Plan2d":
        """For one input shape: the output size, the loop and its geometry, the parts of the
        planes for the pool's threads, and whether to offer them to the spinning helpers."""
        kernel = [int(k) for k in self.attr("kernel_shape")]
        strides, dilations, pads = spatial_attrs(self, 2, kernel)
        begin, _, out = window_geometry(shape[2:], kernel, strides, dilations, pads,
                                        self.attr("auto_pad"), bool(self.attr("ceil_mode", 0)))
        planes = shape[0] * shape[1]
        work = planes * math.prod(out) * kernel[0] * kernel[1]
        threads = threads_for(work)
        edges = np.linspace(0, planes, min(planes, 2 * threads) + 1).astype(int)
        parts = tuple((int(p0), int(p1)) for p0, p1 in zip(edges[:-1], edges[1:]))
        # (an axis with one output has no step to take: a whole-map window is one tile)
        steps = [k if o == 1 else int(s) for s, k, o in zip(strides, kernel, out)]
        tiles = (steps == kernel and not any(begin) and all(int(d) == 1 for d in dilations)
                 and all(o * k <= size for o, k, size in zip(out, kernel, shape[2:])))
        lowest = np.array([0.0 if self.summing else float(_lowest(dtype))], np.float64)
        if tiles:
            loop, geometry = TILES, (*kernel, *kernel, 1, 1, 0, 0)
        else:
            # nothing to pad: no leading pads, and the last window ends inside the map
            in_place = not any(begin) and all((o - 1) * int(s) + (k - 1) * int(d) + 1 <= size for o, s, k, d, size
                                              in zip(out, strides, kernel, dilations, shape[2:]))
            if takes_three_by_two(kernel, strides, dilations, shape[3], in_place):
                loop = THREE_BY_TWO
            elif kernel == [3, 3] and [int(b) for b in begin] == [1, 1] \
                    and tuple(int(o) for o in out) == tuple(shape[2:]) \
                    and all(int(s) == 1 for s in strides) and all(int(d) == 1 for d in dilations):
                # (a pad of one all round: Inception's average pools, divided in the loop where the pads
                # do not count, as the windows at the edges then hold fewer values; and its max pools)
                loop = (THREE_BY_ONE_MAX if not self.summing else THREE_BY_ONE_SUM
                        if self.attr("count_include_pad", 0) else THREE_BY_ONE_MEAN)
            else:
                loop = (FLAT if flat_pays(strides, shape[3], in_place) else COLUMNS_FIRST if int(strides[0]) > 1
                        else ROWS_FIRST)
            geometry = (*kernel, *(int(s) for s in strides), *(int(d) for d in dilations), int(begin[0]),
                        int(begin[1]))
        team = dtype == np.float32 and planes > 1 and work >= TEAM_MIN_MACS
        return Plan2d(tuple(int(o) for o in out), loop, geometry, np.array(geometry, np.int64), lowest, parts, threads,
                       team)

    def tap_sum(self, x: np.ndarray, win: FlatWindows, fn=None) -> np.ndarray:
        """Sum over each window of ``fn(x)`` (zero padding), still on the virtual output grid."""
        buf = win.load(x if fn is None else fn(x))
        acc = win.tap(buf, 0).copy()
        for i in range(1, len(win.offsets)):
            acc += win.tap(buf, i)
        return acc


@dataclass(frozen=True)
class Plan2d:
    """`_WindowPool._compiled_2d` for one input shape (see `plan_2d`)."""

    out: tuple[int, int]
    loop: int                      # `compiled.pool`'s ROWS_FIRST, COLUMNS_FIRST, TILES, …
    geometry: tuple[int, ...]      # kh, kw, sh, sw, dh, dw, top, left
    geometry_array: np.ndarray     # the same, int64 (for the compiled posting)
    lowest: np.ndarray             # (1,) float64: what a window wholly in the padding gives
    parts: tuple[tuple[int, int], ...]  # planes, for the pool's threads
    threads: int
    team: bool


def _lowest(dtype: np.dtype):
    """The neutral element of max for ``dtype``."""
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


@register("MaxPool", versions=(1, 8, 10, 11, 12, 22))
class MaxPool(_WindowPool):
    """Max over each window; the optional Indices output is the flat (N, C, spatial…) argmax."""

    def check(self) -> None:
        super().check()
        if int(self.attr("storage_order", 0)) not in (0, 1):
            self.unsupported(f"storage_order={self.attr('storage_order')}")

    def run(self, x: np.ndarray) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        want_indices = len(self.layer.outputs) > 1 and bool(self.layer.outputs[1])
        if not want_indices and x.ndim == 4 and x.dtype in (np.float32, np.float64):
            return self._compiled_2d(x, self._plan_of(x))
        if not want_indices:
            return self.separable_reduce(x, np.maximum, _lowest(x.dtype))[0]
        win, begin, _, out = self.windows(x)
        if math.prod(out) == 0:
            y = np.zeros(x.shape[:2] + tuple(out), dtype=x.dtype)
            return (y, np.zeros(y.shape, np.int64)) if want_indices else y
        buf = win.load(x, fill=_lowest(x.dtype))
        acc = win.tap(buf, 0).copy()
        if not want_indices:
            for i in range(1, len(win.offsets)):
                np.maximum(acc, win.tap(buf, i), out=acc)
            return win.crop(acc)
        best = np.zeros(acc.shape, dtype=np.int32)
        for i in range(1, len(win.offsets)):
            t = win.tap(buf, i)
            better = t > acc  # strict: the first tap holding the max wins
            np.copyto(acc, t, where=better)
            best[better] = i
        return win.crop(acc), self._indices(x.shape, win.crop(best), begin, out)

    def _indices(self, shape: tuple[int, ...], best: np.ndarray, begin: list[int], out: list[int]) -> np.ndarray:
        """Flat input index of each chosen tap: row-major, or column-major spatial for storage_order=1."""
        nsp = len(out)
        kernel = [int(k) for k in self.attr("kernel_shape")]
        strides, dilations, _ = spatial_attrs(self, nsp, kernel)
        taps = np.array(kernel_taps(kernel), dtype=np.int64).reshape(-1, nsp)
        in_sp = shape[2:]
        column_major = int(self.attr("storage_order", 0)) == 1
        flat = np.zeros(best.shape, dtype=np.int64)
        for k in range(nsp):
            grid = (np.arange(out[k], dtype=np.int64) * strides[k] - begin[k]).reshape(
                (out[k],) + (1,) * (nsp - 1 - k))
            coord = grid + taps[best, k] * dilations[k]
            weight = math.prod(in_sp[:k]) if column_major else math.prod(in_sp[k + 1:])
            flat += coord * weight
        plane = math.prod(in_sp)
        lead = np.arange(shape[0] * shape[1], dtype=np.int64).reshape(shape[:2] + (1,) * nsp) * plane
        return flat + lead


@register("AveragePool", versions=(1, 7, 10, 11, 19, 22))
class AveragePool(_WindowPool):
    """Mean over each window; count_include_pad decides whether explicit pads count as elements.
    2-D float ones sum on the compiled loops of MaxPool (GoogLeNet's and ShuffleNet's 3x3 pools:
    one pass instead of a padded copy and four whole-array ones), then divide; Inception's 3x3/1
    pools with a pad of one that does not count divide in the loop itself."""

    summing = True

    def run(self, x: np.ndarray) -> np.ndarray:
        if x.ndim == 4 and self.per_shape(("whole", x.shape), lambda: self._whole_map(x.shape)):
            return global_average(x)  # (ResNet's and ShuffleNet's last pool: 7x7 on a 7x7 map)
        if x.ndim == 4 and x.dtype in (np.float32, np.float64):
            plan = self._plan_of(x)
            total = self._compiled_2d(x, plan)
            if plan.loop == THREE_BY_ONE_MEAN:  # (divided already)
                return total
            begin, end, out = self.per_shape(("geometry", x.shape), lambda: self._geometry(x.shape))
        else:
            total, begin, end, out = self.separable_reduce(x, np.add, 0)
        if total.size == 0:
            return total
        kernel = [int(k) for k in self.attr("kernel_shape")]
        strides, dilations, _ = spatial_attrs(self, x.ndim - 2, kernel)
        include_pad = bool(self.attr("count_include_pad", 0))

        def divisors() -> np.ndarray:
            counts = _window_counts(x.shape[2:], kernel, strides, dilations, begin, end, out, include_pad)
            return _FULL if counts is None else counts.astype(x.dtype)
        counts = self.per_shape(("counts", x.shape, x.dtype), divisors)
        if counts is _FULL:  # every window is full: a scalar divide
            total *= x.dtype.type(1.0 / math.prod(kernel))
            return total
        total /= counts
        return total

    def _whole_map(self, shape: tuple[int, ...]) -> bool:
        """Whether the one window is the whole map (no pads, no dilation): a plane's mean, one
        pass (`global_average`) where the separable sum made two over a map too small for them."""
        kernel = [int(k) for k in self.attr("kernel_shape")]
        _, dilations, _ = spatial_attrs(self, len(shape) - 2, kernel)
        begin, end, out = self._geometry(shape)
        return (kernel == list(shape[2:]) and not any(begin) and not any(end) and all(d == 1 for d in dilations)
                and all(o == 1 for o in out))

    def _geometry(self, shape: tuple[int, ...]) -> tuple[list[int], list[int], list[int]]:
        """``begin, end, out`` of the windows over an input of ``shape``."""
        kernel = [int(k) for k in self.attr("kernel_shape")]
        strides, dilations, pads = spatial_attrs(self, len(shape) - 2, kernel)
        return window_geometry(shape[2:], kernel, strides, dilations, pads, self.attr("auto_pad"),
                               bool(self.attr("ceil_mode", 0)))


_FULL = np.empty(0)  # AveragePool's divisors when every window is full (`_window_counts` gives None)


def _window_counts(in_shape, kernel, strides, dilations, begin, end, out, include_pad: bool) -> np.ndarray | None:
    """Number of counted elements in every window (an array of shape ``out``), or None if all are full.

    The count is separable: the product over axes of how many taps of that axis land in the
    counted range (the input, plus the explicit pads when ``include_pad``).
    """
    per_axis, full = [], True
    for k in range(len(out)):
        lo, hi = (-begin[k], in_shape[k] + end[k]) if include_pad else (0, in_shape[k])
        pos = (np.arange(out[k])[:, None] * strides[k] - begin[k]
               + np.arange(kernel[k])[None, :] * dilations[k])
        cnt = ((pos >= lo) & (pos < hi)).sum(axis=1)
        full &= bool((cnt == kernel[k]).all())
        per_axis.append(cnt.astype(np.float64))
    if full:
        return None
    counts = per_axis[0]
    for c in per_axis[1:]:
        counts = np.multiply.outer(counts, c)
    return counts


def _lp_power(p: float):
    """``|x|**p`` without float64 temporaries, with the common p=1/p=2 fast paths."""
    if p == 2:
        return lambda x: np.square(x)
    if p == 1:
        return np.abs
    return lambda x: np.power(np.abs(x), x.dtype.type(p))


def _lp_root(y: np.ndarray, p: float) -> np.ndarray:
    if p == 2:
        return np.sqrt(y, out=y)
    if p == 1:
        return y
    return np.power(y, y.dtype.type(1.0 / p), out=y)


@register("LpPool", versions=(1, 2, 11, 18, 22))
class LpPool(_WindowPool):
    """``(sum |x|^p)^(1/p)`` over each window (zero padding)."""

    def check(self) -> None:
        super().check()
        if float(self.attr("p")) <= 0:
            self.unsupported(f"p={self.attr('p')}")

    def run(self, x: np.ndarray) -> np.ndarray:
        p = float(self.attr("p"))
        win, _, _, out = self.windows(x)
        if math.prod(out) == 0:
            return np.zeros(x.shape[:2] + tuple(out), dtype=x.dtype)
        return _lp_root(win.crop(self.tap_sum(x, win, _lp_power(p))), p)


@register("GlobalAveragePool", versions=(1, 22))
class GlobalAveragePool(Op):
    def run(self, x: np.ndarray) -> np.ndarray:
        return global_average(x)


def global_average(x: np.ndarray) -> np.ndarray:
    """``GlobalAveragePool(x)``: the mean of each (image, channel) plane, kept as ``(N, C, 1…)``."""
    if x.dtype in (np.float32, np.float64) and x.ndim > 2 and x.size:
        # one vectorised pass per (image, channel) plane (NumPy's multi-axis mean: 2-3x slower)
        planes = np.ascontiguousarray(x).reshape(x.shape[0] * x.shape[1], -1)
        out = np.empty(x.shape[:2] + (1,) * (x.ndim - 2), x.dtype)
        row_means(planes, out.reshape(-1))
        return out
    return x.mean(axis=tuple(range(2, x.ndim)), keepdims=True, dtype=x.dtype)


@register("GlobalMaxPool", versions=(1, 22))
class GlobalMaxPool(Op):
    def run(self, x: np.ndarray) -> np.ndarray:
        return x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


@register("GlobalLpPool", versions=(1, 2, 22))
class GlobalLpPool(Op):
    def check(self) -> None:
        if float(self.attr("p")) <= 0:
            self.unsupported(f"p={self.attr('p')}")

    def run(self, x: np.ndarray) -> np.ndarray:
        p = float(self.attr("p"))
        s = _lp_power(p)(x).sum(axis=tuple(range(2, x.ndim)), keepdims=True, dtype=x.dtype)
        return _lp_root(s, p)
