"""A conv whose result only a 3x3/2 MaxPool reads: the two as one layer (a stem conv,
`ConvMaxPool`; joined convs, `JoinedConvMaxPool`).

SqueezeNet and ShuffleNet begin ``MaxPool(Relu(Conv(image)))`` with a 3x3 stem (`MAX_TAPS`; a
BatchNormalization folded into the conv). As two layers, the conv stores its whole output (64 x
111x111 floats, 3.2 MB: past a core's L2) and the pool reads it back. The loader joins the two
(`loader.patterns.fuse_conv_max_pools`) into one layer.

Which way it runs depends on what the other cores do. While this backend runs other work too
(concurrent requests: `parallel.crowded`), each core runs its own request's kernels, and the
cores share the L3 and the memory: then the conv's output is made a block of channels at a time
in a buffer that stays in this core's L2 and pooled from there (`compiled.conv_pool`, the very
bits of the two layers). On 2 cores, fused against unfused in one process: 8 awaiting tasks
1.013-1.017x the runs/s on SqueezeNet, 1.009x on ShuffleNet (median of 10 rounds each); two
blocking callers on SqueezeNet 1.003-1.084x in three runs. A request alone runs the two
layers, each split across the spinning helpers: the fused loop measured no faster there (alone
on one core, hot: SqueezeNet's stem and pool 306 against 311 µs; its blocks shared out on two
cores, SqueezeNet 1.002x, and cut into bands of rows, ShuffleNet 0.976x). Where the conv takes
another kernel than the stem's direct one (`conv_direct`), or the pool another loop than the
3x3/2 one, the layer always runs as the two do.

SqueezeNet 1.1's third and fifth fire modules end the same way: their 1x1 and 3x3 expand convs,
one `JoinedConv` (128 x 55x55, 256 x 27x27: 1.5 and 0.75 MB), then a 3x3/2 pool. The loader joins
those too (`loader.patterns.fuse_joined_conv_max_pools`), and wherever the joined conv would run
on one thread (other requests keep the other cores busy, the worker has one thread, the conv is
too small to split) each panel of its channels is summed into a buffer in the core's L2 and pooled
from there (`compiled.conv_pool.panel_conv_max_pool`). One thread, the two SqueezeNet layers
against the joined conv and the pool, median of 60 alternating calls: 851 against 911 µs and 743
against 800 hot; 971 against 1233 and 854 against 1043 after 64 MB of other memory was touched
(in a run, the pool's input comes from the L3 or memory: 3-4x its hot time).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..concurrency import parallel
from .compiled.conv_pool import buffer_size, conv_max_pool, panel_conv_max_pool
from .compiled.direct_panels import BLOCK_POSITIONS
from .compiled.direct_panels import PART_KIND as PANELS_PART
from .compiled.panels import BLOCK_ROWS
from .compiled.pool import THREE_BY_TWO
from .conv import Conv, same_case
from .conv_direct import (PANEL_WIDTH, DirectPlan, PanelPlan, direct_plan, padded_input, run_direct_panels,
                          takes_direct)
from .conv_kernels import scratch
from .epilogue import Activations, Epilogue
from .fused import FUSED_DOMAIN
from .joined_conv import JoinedConv
from .pool import MaxPool
from .registry import create, register

#: Most taps (C·kh·kw) of a stem conv the loader fuses with its pool: a 3x3 stem's 27. A 7x7
#: stem's 147 taps a block re-read its input from L2 for every block of channels, where the
#: unfused conv takes a band of rows through all of them: 8 ResNet-50 tasks 0.987x the runs/s
#: fused (0.977-1.006 in 8 rounds), its stem and pool alone on 2 cores 792 against 719 µs.
MAX_TAPS = 27


@dataclass(frozen=True)
class ConvPoolPlan:
    """What `run_conv_pool` does with an input: the conv's `DirectPlan`, its weights by blocks of
    channels, and the pool's output size and padding."""

    conv: DirectPlan
    columns: np.ndarray                 # (B, taps, BLOCK_ROWS): the conv's weights by blocks of channels
    bias: np.ndarray                    # (B, BLOCK_ROWS)
    pooled: tuple[int, int]             # (Hq, Wq)
    top: int                            # the pool's rows and columns of padding before the map
    left: int
    lowest: float                       # what the padding holds


@dataclass(frozen=True)
class PoolPlan:
    """A 3x3/2 max pool of a conv's float32 output: its output size and padding."""

    pooled: tuple[int, int]             # (Hq, Wq)
    top: int                            # the pool's rows and columns of padding before the map
    left: int
    lowest: float                       # what the padding holds


def three_by_two_pool(pool: MaxPool, y_shape: tuple[int, ...]) -> PoolPlan | None:
    """How ``pool`` runs on a float32 map of ``y_shape``, or None where it does not take the
    3x3/2 loop there (the conv and the pool then run as the two layers)."""
    pooling = pool.plan_2d(y_shape, np.dtype(np.float32))
    if pooling.loop != THREE_BY_TWO:
        return None
    return PoolPlan(pooling.out, pooling.geometry[6], pooling.geometry[7], float(pooling.lowest[0]))


def conv_pool_plan(conv: DirectPlan, pool: MaxPool) -> ConvPoolPlan | None:
    """The plan of the conv (planned as ``conv``) and ``pool`` on its output, or None where the
    pool does not take the 3x3/2 loop on that output (the two layers then run as they are)."""
    pooling = three_by_two_pool(pool, conv.y_shape)
    if pooling is None:
        return None
    taps, padded_m = conv.columns.shape
    blocks = padded_m // BLOCK_ROWS
    columns = np.ascontiguousarray(conv.columns.reshape(taps, blocks, BLOCK_ROWS).transpose(1, 0, 2))
    return ConvPoolPlan(conv, columns, conv.bias.reshape(blocks, BLOCK_ROWS), pooling.pooled, pooling.top,
                        pooling.left, pooling.lowest)


def run_conv_pool(plan: ConvPoolPlan, x: np.ndarray) -> np.ndarray:
    """The pooled conv of ``x`` (the plan's input shape) on this thread: a fresh (N, M, Hq, Wq) array."""
    conv = plan.conv
    padded = padded_input(conv.padded, conv.top, conv.left, conv.x_shape, x, conv.stride)
    n, m, ho, wo = conv.y_shape
    y = np.empty((n, m, *plan.pooled), np.float32)
    buffer = scratch((buffer_size(ho, wo),), np.float32, "conv_pool")
    epilogue = conv.epilogue
    conv_max_pool(plan.columns, padded, conv.offsets, buffer, plan.bias, y, ho, wo, conv.stride, epilogue.kind,
                  epilogue.a, epilogue.b, plan.top, plan.left, plan.lowest)
    return y


@register("ConvMaxPool", versions=(1,), domain=FUSED_DOMAIN)
class ConvMaxPool(Conv):
    """``MaxPool(Conv(X, W, B))``, the Conv's fused activations between them.

    Inputs and attributes: the Conv's. The layer's expansion is the Conv (its activations fused
    into it) and the MaxPool, for backends without this kernel. A float32 stem the direct kernel
    takes, pooled 3x3/2, runs fused while other requests keep the other cores busy
    (`compiled.conv_pool`); any other case as the two layers (see the module docstring)."""

    def check(self) -> None:
        super().check()
        expansion = self.layer.expansion
        if len(expansion) != 2 or expansion[0].op_type != "Conv" or expansion[1].op_type != "MaxPool":
            self.unsupported("a ConvMaxPool layer is made by the loader from a Conv and the MaxPool after it")
        self.pool = create(expansion[1], self.limits)
        # the last case and its fused plan (None: only ever the two layers' way), as `Conv` keeps its short way
        self._fused: tuple | None = None

    def run(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, *,  # type: ignore[override]
            activations: Activations = ()) -> np.ndarray:
        case = (x.shape, x.dtype, w, b, activations)
        known = self._fused
        if known is None or not same_case(known, case):
            known = self._fused = case + (self._plan(x, w, b, activations),)
        if known[5] is not None and parallel.crowded():
            return run_conv_pool(known[5], x)
        return self.pool.run(Conv.run(self, x, w, b, activations=activations))

    def _plan(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
              activations: Activations) -> ConvPoolPlan | None:
        if (x.ndim != 4 or w.ndim != 4 or x.dtype != np.float32 or w.dtype != np.float32
                or (b is not None and (b.dtype != np.float32 or b.shape != (w.shape[0],)))):
            return None
        epilogue = Epilogue.of(activations, np.dtype(np.float32))
        group = int(self.attr("group"))
        if epilogue is None or group != 1 or x.shape[0] == 0 or x.shape[1] != w.shape[1]:
            return None
        _, strides, dilations, begin, _, out = self._windows(x.shape, w.shape)
        if math.prod(out) == 0 or not takes_direct(x.shape, w.shape, group, strides, dilations, out, x.dtype):
            return None
        conv = direct_plan(x.shape, w, b, strides, begin, out, epilogue,
                           lambda name, work_out: self.derived(name, {1: w}, work_out))
        return conv_pool_plan(conv, self.pool)  # type: ignore[arg-type]


def run_panel_conv_pool(conv: PanelPlan, pool: PoolPlan, x: np.ndarray) -> np.ndarray:
    """The pooled panel conv of ``x`` (the conv plan's input shape) on this thread, a panel of
    channels at a time: a fresh (N, M, Hq, Wq) array."""
    padded = padded_input(conv.padded, conv.top, conv.left, conv.x_shape, x)
    n, m, ho, wo = conv.y_shape
    y = np.empty((n, m, *pool.pooled), np.float32)
    buffer = scratch((PANEL_WIDTH * ho * wo,), np.float32, "panel_conv_pool")
    block = scratch((BLOCK_POSITIONS, PANEL_WIDTH), np.float32, "direct_panel_block")
    epilogue = conv.epilogue
    panel_conv_max_pool(conv.panels, padded, conv.tap_sets, conv.panel_taps, buffer, conv.bias, block, y, ho, wo,
                        *conv.strides, epilogue.kind, epilogue.a, epilogue.b, pool.top, pool.left, pool.lowest)
    return y


@register("JoinedConvMaxPool", versions=(1,), domain=FUSED_DOMAIN)
class JoinedConvMaxPool(JoinedConv):
    """``MaxPool(JoinedConv(X, W_1, B_1, …))``: the joined convs' inputs, their expansion then
    the MaxPool's layer. Where the panel kernel takes the joined convs and the pool the 3x3/2
    loop, and the conv would not be split between threads (`parallel.team` gives none, or the
    conv is too small to offer), it runs fused, a panel of channels at a time
    (`run_panel_conv_pool`: the bits of the two layers); else as the two layers."""

    def check(self) -> None:
        expansion = self.layer.expansion
        if not expansion or expansion[-1].op_type != "MaxPool":
            self.unsupported("a JoinedConvMaxPool layer is made by the loader from a JoinedConv's layers "
                             "and the MaxPool after them")
        self.pool = create(expansion[-1], self.limits)
        self._pooled: tuple[PanelPlan, PoolPlan | None] | None = None  # the last conv plan's pool plan
        super().check()

    def _joined_layers(self) -> list:
        return list(self.layer.expansion[:-1])

    def run(self, x: np.ndarray, *operands: np.ndarray | None) -> np.ndarray:
        plan = self.panel_plan(x, operands)
        if plan is None:
            return self.pool.run(self._run_apart(x, operands))
        pooled = self._pooled
        if pooled is None or pooled[0] is not plan:
            pooled = self._pooled = (plan, three_by_two_pool(self.pool, plan.y_shape))  # type: ignore[arg-type]
        if pooled[1] is not None and (not plan.team or parallel.team(PANELS_PART) is None):
            return run_panel_conv_pool(plan, pooled[1], x)
        return self.pool.run(run_direct_panels(plan, x))
