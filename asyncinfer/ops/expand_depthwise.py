"""A 1x1 conv whose result only a depthwise conv reads: the two as one layer, the wide map between
them kept channels last in the cache (`compiled.expand_depthwise`).

An inverted residual block (MobileNetV2/V3, EfficientNet, SSDlite's backbone) widens its input
with a 1x1 conv and filters the wide map with a depthwise conv. The loader joins the two
(`loader.patterns.fuse_expand_depthwise`) into one `ExpandDepthwise` layer: where both are float32,
the 1x1 ungrouped and unpadded at unit stride and the activations ones the epilogue has, each
panel of expanded channels is summed into a zero-padded channels-last buffer and filtered from
there (the module docstring of `compiled.expand_depthwise`), with the very bits of the two
layers; any other case runs the two layers, which are the layer's expansion (for other backends
too).

Parts: images where there are as many as sharers, else panels of channels or bands of output
rows, whichever leaves the largest part the smaller share of the work (`_parts`); shared with
the CPU backend's spinning helpers as the other compiled convs are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..concurrency import parallel, spin_team
from .base import Op
from .compiled.expand_depthwise import PART_KIND as EXPAND_DEPTHWISE_PART
from .compiled.expand_depthwise import (expand_depthwise_range, finish_expand_depthwise,
                                        post_and_finish_expand_depthwise, scratch_floats)
from .compiled.panels import panel_width
from .compiled.pointwise import pack_weights
from ..concurrency.aligned import aligned_bytes
from .conv_kernels import CHANNELS_LAST, depthwise_taps, scratch
from .epilogue import Activations, Epilogue
from .fused import FUSED_DOMAIN
from .registry import create, register

#: Fewest input channels of a 1x1 expansion the loader joins with its depthwise conv (`joins`),
#: and fewest where that conv is a 3x3 at unit stride. On shallower inputs a block of 14
#: positions x a panel of 32 channels has few multiply-adds against its finishing and stores,
#: and a panel of 32 computes the channels of a width like 72 a third in vain (`pointwise_conv`'s
#: blocks of 8 channels waste none); a 3x3 window at unit stride is what the NCHW register loop
#: does best (`compiled.depthwise_block`: no shuffles). Per layer in the runs on two cores
#: (`worker.profile()`, µs fused against the two layers): MobileNetV3-small's 16 -> 72 at 56x56
#: then 3x3/2 106 / 99, its 24 -> 88 at 28x28 then 3x3 66 / 50 and 24 -> 96 then 5x5/2 46 / 53, the
#: deeper ones 32-60 / 46-75; EfficientNet-B0's 16 -> 96 at 112x112 886 / 711, 24 -> 144 at 56x56
#: then 3x3 452 / 396 and then 5x5/2 338 / 356, the deeper ones 152-260 / 188-317.
MIN_DEPTH = 24
MIN_DEPTH_THREE_BY_ONE = 32
#: Most bytes of a part's padded channels-last buffer (one panel of channels by the rows a band of
#: output rows reads): a larger map goes by bands of output rows, each expanding the input rows
#: its windows read (the rows two bands share, twice), so that the buffer stays in the core's L2
#: between its expansion and the depthwise sums that read it.
BAND_BYTES = 256 << 10
#: From this many multiply-adds (the 1x1's and the depthwise conv's) a layer is shared with the
#: spinning helpers (as `conv_pointwise.TEAM_MIN_MACS`).
TEAM_MIN_MACS = 300_000


def joins(depth: int, kernel: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether the loader joins a 1x1 conv of ``depth`` input channels with the depthwise conv of
    window ``kernel`` and ``strides`` that reads its result (`MIN_DEPTH`)."""
    three_by_one = tuple(kernel) == (3, 3) and all(s == 1 for s in strides)
    return depth >= (MIN_DEPTH_THREE_BY_ONE if three_by_one else MIN_DEPTH)


@dataclass(frozen=True)
class ExpandDepthwisePlan:
    """What `run_expand_depthwise` does with an input of ``x_shape``."""

    x_shape: tuple[int, ...]            # (N, C, H, W)
    y_shape: tuple[int, int, int, int]  # (N, M, Ho, Wo)
    panels: np.ndarray                  # the 1x1's weights in panels (P, C, W)
    bias1: np.ndarray                   # (P·W,), zero past M
    taps: np.ndarray                    # the depthwise weights channels last (kh, kw, ≥ P·W), zero past M
    bias2: np.ndarray                   # (M,)
    acts: np.ndarray                    # the two epilogue codes
    numbers: np.ndarray                 # their float64 a1, b1, a2, b2
    first: Epilogue
    second: Epilogue
    geometry: np.ndarray                # the depthwise conv's sh, sw, dh, dw, top, left (int64)
    band: int                           # output rows a band
    parts: np.ndarray                   # int64 rows (i0, i1, q0, q1, oh0, oh1)
    scratch: int                        # float32 values of one part's scratch (a cache line's multiple)
    team: bool                          # offered to the spinning helpers
    # each part's last arguments of `expand_depthwise_range` as Python numbers (its rows, the band,
    # the geometry, the activations): unpacked from the int64 rows each call, they became NumPy
    # scalars, which numba's dispatcher types slowly (2-3 µs of a layer run alone)
    alone: tuple[tuple[int | float, ...], ...]


def expand_depthwise_plan(x_shape: tuple[int, ...], w1: np.ndarray, b1: np.ndarray | None, w2: np.ndarray,
                          b2: np.ndarray | None, strides: tuple[int, ...], dilations: tuple[int, ...],
                          begin: tuple[int, ...], out: tuple[int, ...], first: Epilogue, second: Epilogue,
                          sharers: int) -> ExpandDepthwisePlan:
    """The plan of a float32 1x1 conv by ``w1`` (M, C, 1, 1) then a depthwise one by ``w2`` (M, 1,
    kh, kw) with ``strides``, ``dilations``, top/left pads ``begin`` and output size ``out``, for
    ``sharers`` threads."""
    n, c, h, wd = x_shape
    m = w1.shape[0]
    kh, kw = w2.shape[2:]
    ho, wo = out
    sh, sw = strides
    dh, dw = dilations
    width = panel_width(np.float32)
    panels = pack_weights(np.ascontiguousarray(w1.reshape(m, c).T, dtype=np.float32)[None])[0]
    count = panels.shape[0]
    bias1 = _on_lines((count * width,))
    if b1 is not None:
        bias1[:m] = b1
    channels_last = depthwise_taps(w2, CHANNELS_LAST, np.dtype(np.float32))
    taps = _on_lines((kh, kw, max(count * width, channels_last.shape[2])))  # (a vector of taps for each of a panel's)
    taps[:, :, :channels_last.shape[2]] = channels_last
    bias2 = np.zeros(m, np.float32) if b2 is None else np.ascontiguousarray(b2, dtype=np.float32)
    row_bytes = 4 * width * ((wo - 1) * sw + (kw - 1) * dw + 1)
    band = max(1, min(ho, (BAND_BYTES // row_bytes - (kh - 1) * dh - 1) // sh + 1))
    macs = n * m * (c * h * wd + ho * wo * kh * kw)
    team = macs >= TEAM_MIN_MACS and sharers > 1
    parts = _parts(n, count, ho, h, kh, sh, dh, begin[0], sharers if team else 1)
    band = min(band, max(part[5] - part[4] for part in parts))
    size = -(-scratch_floats(band, wo, kh, kw, sh, sw, dh, dw) // 16) * 16
    geometry = (sh, sw, dh, dw, begin[0], begin[1])
    activations = (first.kind, first.a, first.b, second.kind, second.a, second.b)
    alone = tuple(tuple(int(v) for v in part) + (band,) + tuple(int(v) for v in geometry) + activations
                  for part in parts)
    return ExpandDepthwisePlan(
        tuple(x_shape), (n, m, ho, wo), panels, bias1, taps, bias2, np.array([first.kind, second.kind], np.int64),
        np.array([first.a, first.b, second.a, second.b], np.float64), first, second, np.array(geometry, np.int64),
        band, np.array(parts, np.int64).reshape(-1, 6), size, team and len(parts) > 1, alone)


def _on_lines(shape: tuple[int, ...]) -> np.ndarray:
    """Zeros of ``shape`` (float32) starting on a cache line: the blocks load them whole vectors
    at a time, and a vector off a line costs two (`concurrency.aligned`)."""
    zeros = aligned_bytes(4 * math.prod(shape)).view(np.float32).reshape(shape)
    zeros[...] = 0.0
    return zeros


def _parts(n: int, count: int, ho: int, h: int, kh: int, sh: int, dh: int, top: int,
           sharers: int) -> list[tuple[int, ...]]:
    """The parts (i0, i1, q0, q1, oh0, oh1) for ``sharers`` threads: images, else panels of
    channels (``count`` of them) or bands of output rows, whichever gives the largest part the
    smaller share of the 1x1's work (a band's share: the input rows its windows read; a panel's
    range: its panels, the last one computed whole), panels on a tie."""
    if sharers == 1 or n >= sharers:
        cuts = [n * i // sharers for i in range(sharers + 1)]
        return [(cuts[i], cuts[i + 1], 0, count, 0, ho) for i in range(sharers) if cuts[i] < cuts[i + 1]]
    by_panels = -(-count // sharers) / count if count >= sharers else 1.0
    rows = [ho * i // sharers for i in range(sharers + 1)]

    def read(oh0: int, oh1: int) -> int:  # input rows the windows of output rows oh0:oh1 read
        first = oh0 * sh - top
        return min(h, first + (oh1 - oh0 - 1) * sh + (kh - 1) * dh + 1) - max(0, first)
    by_rows = max(read(rows[i], rows[i + 1]) for i in range(sharers)) / h if ho >= sharers else 1.0
    if by_panels <= by_rows:
        cuts = [count * i // sharers for i in range(sharers + 1)]
        return [(0, n, cuts[i], cuts[i + 1], 0, ho) for i in range(sharers) if cuts[i] < cuts[i + 1]]
    return [(0, n, 0, count, rows[i], rows[i + 1]) for i in range(sharers) if rows[i] < rows[i + 1]]


def run_expand_depthwise(plan: ExpandDepthwisePlan, x: np.ndarray) -> np.ndarray:
    """The two convs of ``x`` (the plan's input shape) as planned: a fresh (N, M, Ho, Wo) array."""
    x = np.ascontiguousarray(x)
    y = np.empty(plan.y_shape, np.float32)
    parts, geometry, acts, numbers = plan.parts, plan.geometry, plan.acts, plan.numbers
    own = scratch((plan.scratch,), np.float32, "expand_depthwise")
    team = parallel.team(EXPAND_DEPTHWISE_PART) if plan.team else None
    control = None if team is None or len(parts) - 1 > team.helpers else team.claim()
    if control is None:  # alone, or the team busy (every core is): every part here
        for part in plan.alone:
            expand_depthwise_range(plan.panels, x, plan.taps, plan.bias1, plan.bias2, y, own, *part)
        return y
    try:
        helpers = team.scratch((len(parts) - 1, plan.scratch), np.float32)  # type: ignore[union-attr]
        arguments = (control, plan.panels, x, plan.taps, plan.bias1, plan.bias2, y, parts, geometry, plan.band)
        status = post_and_finish_expand_depthwise(*arguments, helpers, own, acts, numbers, spin_team.WAIT_ROUNDS)
        if status != spin_team.PARTS_DONE:  # (the common case: nothing to settle, no tuple built)
            team.settle(status, finish_expand_depthwise,  # type: ignore[union-attr]
                        (*arguments, own, acts, numbers, spin_team.WAIT_ROUNDS), len(parts) - 1)
    finally:
        team.release()  # type: ignore[union-attr]
    return y


@register("ExpandDepthwise", versions=(1,), domain=FUSED_DOMAIN)
class ExpandDepthwise(Op):
    """``Conv_dw(Conv_1x1(X, W1, B1), W2, B2)``, each conv's fused activations after it.

    Inputs ``X``, ``W1``, ``B1`` (optional), ``W2``, ``B2`` (optional), then the extra inputs of
    the 1x1's activations in order (a Clip's bounds); the two convs' attributes and activations
    are those of the layer's expansion (the 1x1 conv, then the depthwise one, whose activations
    are the layer's). A float32 pair the kernel takes runs fused (the module docstring), any
    other as the two layers."""

    multithreaded = True  # as the convs it replaces
    takes_activations = True

    def check(self) -> None:
        expansion = self.layer.expansion
        fused = expansion[0].fused if len(expansion) == 2 else []
        if (len(expansion) != 2 or any(layer.op_type != "Conv" for layer in expansion)
                or len(self.layer.inputs) != 5 + sum(len(f.inputs) - 1 for f in fused)):
            self.unsupported("an ExpandDepthwise layer is made by the loader from a 1x1 Conv and the depthwise Conv "
                             "after it")
        self.expand, self.depthwise = (create(layer, self.limits) for layer in expansion)
        self._expand_ops = [(create(f, self.limits), len(f.inputs) - 1) for f in fused]
        self._expand_activations: tuple = (None, ())  # (their extra inputs, the 1x1's activations with them)
        self._known: tuple | None = None  # the last case (x shape, x dtype, w1, b1, w2, b2, activations) and its plan

    def run(self, x: np.ndarray, w1: np.ndarray, b1: np.ndarray | None, w2: np.ndarray,  # type: ignore[override]
            b2: np.ndarray | None, *extras: np.ndarray | None, activations: Activations = ()) -> np.ndarray:
        first = self._first_activations(extras)
        known = self._known
        if not (known is not None and x.shape == known[0] and x.dtype == known[1] and w1 is known[2]
                and b1 is known[3] and w2 is known[4] and b2 is known[5] and activations is known[6]
                and first is known[7]):
            known = self._known = (x.shape, x.dtype, w1, b1, w2, b2, activations, first,
                                   self._plan(x, w1, b1, w2, b2, first, activations))
        if known[8] is not None:
            return run_expand_depthwise(known[8], x)
        y = self.expand.run(x, w1, b1, activations=first)
        return self.depthwise.run(y, w2, b2, activations=activations)

    def _first_activations(self, extras: tuple) -> Activations:
        """The 1x1's activations with their extra inputs ``extras``: the same tuple while those are
        the same objects (a model's constant bounds), so the plan and the convs' short ways keep."""
        kept, activations = self._expand_activations
        if kept is not None and len(kept) == len(extras) and all(a is b for a, b in zip(kept, extras)):
            return activations
        parts, at = [], 0
        for op, count in self._expand_ops:
            parts.append((op, list(extras[at:at + count])))
            at += count
        self._expand_activations = (extras, tuple(parts))
        return self._expand_activations[1]

    def _plan(self, x: np.ndarray, w1: np.ndarray, b1: np.ndarray | None, w2: np.ndarray, b2: np.ndarray | None,
              first_activations: Activations, activations: Activations) -> ExpandDepthwisePlan | None:
        """The fused plan of this case, or None where the kernel does not take it."""
        f32 = np.dtype(np.float32)
        if (x.ndim != 4 or w1.ndim != 4 or w2.ndim != 4 or any(a.dtype != f32 for a in (x, w1, w2))
                or any(b is not None and (b.dtype != f32 or b.shape != (w.shape[0],)) for b, w in ((b1, w1), (b2, w2)))
                or x.shape[0] == 0 or w1.shape[1:] != (x.shape[1], 1, 1) or w2.shape[:2] != (w1.shape[0], 1)
                or int(self.expand.attr("group")) != 1 or int(self.depthwise.attr("group")) != w1.shape[0]):
            return None
        first = Epilogue.of(first_activations, f32)
        second = Epilogue.of(activations, f32)
        if first is None or second is None:
            return None
        _, strides, dilations, begin, end, out = self.expand._windows(x.shape, w1.shape)  # type: ignore[attr-defined]
        if any(begin) or any(end) or any(s != 1 for s in strides) or tuple(out) != x.shape[2:]:
            return None
        y_shape = (x.shape[0], w1.shape[0], *x.shape[2:])
        _, strides, dilations, begin, _, out = self.depthwise._windows(y_shape, w2.shape)  # type: ignore[attr-defined]
        if not math.prod(out):
            return None
        return expand_depthwise_plan(x.shape, w1, b1, w2, b2, strides, dilations, begin, out, first, second,
                                     parallel.team_size())

