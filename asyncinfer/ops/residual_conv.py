"""A conv whose result only a residual Add reads: the Add and its activation done in place.

A residual block ends in ``Relu(Add(Conv(x), shortcut))``: ResNet-50's 16 bottlenecks, ShuffleNet's
13 stride-1 units. As two layers, the Add is a layer of its own, with its scheduling, its own
hand-off to the spinning helpers and a third map for its result, after a conv that has just
written its own. The loader joins the two (`loader.patterns.fuse_residual_adds`) into one layer
that runs the conv, then adds the shortcut into the conv's fresh result, in place and with the
Add's activation (`one_pass.fused_add`): the very bits of the two layers, one layer fewer.

Where the conv is a 1x1 on `compiled.pointwise` over a map of at most
`conv_pointwise.RESIDUAL_MAX_POSITIONS` (ResNet-50's 28x28 to 7x7 expansions, the projections
of MobileNetV3's and EfficientNet's inverted residuals, ShuffleNet's grouped 1x1s), the shortcut
is added as the conv's results leave the registers, before the Add's activation
(`conv_pointwise.run_pointwise` with a residual): the Add's pass over three maps becomes one
more read in the conv's stores. In ResNet-50's run on the 2-core VM its 1024-channel
ones at 14x14 took 405 µs on average, 387 so; the 2048-channel ones at 7x7 514 and 480. The same
bits: each value is the conv's float32 result plus the shortcut, then the activation as the Add's.

In a run that hands its caller only its outputs, the runtime gives the layer its shortcut where
nothing read later shares it (`runtime.plan.Plan._plan_donations`: a conv's output, no later
reader, not kept), and on `small_map_conv` the result is then written over the shortcut
itself, at any map size (`conv_pointwise.adds_residual` with ``over_residual``): the blocks read
the lines they write, and no third map is read from memory only to be overwritten. ResNet-50's
residual layers at 56x56 (which kept the Add's own pass before) took 22-24% less time in its run,
those at 28x28 14%.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .conv import POINTWISE, Conv, route_2d, same_case
from .conv_pointwise import PointwisePlan, adds_residual, pointwise_plan, run_pointwise
from .epilogue import Activations, Epilogue
from .fused import FUSED_DOMAIN
from .one_pass import fused_add
from .registry import create, register


@register("ResidualConv", versions=(1,), domain=FUSED_DOMAIN)
class ResidualConv(Conv):
    """``Add(Conv(X, W, B), R)`` (or ``Add(R, Conv(...))``, attribute ``conv_first`` 0), then the
    Add's fused activations; ``Add`` from opset 7 on or a ``Sum`` of the two.

    Inputs ``X``, ``W``, ``B`` (optional), ``R``; attributes: the Conv's and ``conv_first``. The
    conv runs as a Conv layer without activations does; a float32 result of ``R``'s shape takes
    the sum and the activations in place (`one_pass.fused_add`, as the Add's CPU kernel), any
    other the Add layer's own way (broadcasting, other types). The Conv and the Add are the
    layer's expansion, for backends without this kernel."""

    def check(self) -> None:
        super().check()
        if (len(self.layer.inputs) != 4 or not self.layer.inputs[3] or len(self.layer.expansion) != 2
                or self.layer.expansion[1].op_type not in ("Add", "Sum")):
            self.unsupported("a ResidualConv layer is made by the loader from a Conv and the Add after it")
        self.add = create(self.layer.expansion[1], self.limits)
        self.conv_first = bool(int(self.attr("conv_first", 1)))
        # the last case looked at for the residual in the conv's stores: (x shape, x dtype, w, b,
        # activations, the plan or None)
        self._stored: tuple | None = None

    #: The residual, written over where the runtime gives it up (`donating_run`).
    donatable_inputs = (3,)

    def run(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, r: np.ndarray,  # type: ignore[override]
            *, activations: Activations = (), over_residual: bool = False) -> np.ndarray:
        """The conv plus ``r``, then the activations; with ``over_residual`` (nothing else reads
        ``r`` or shares its memory: the runtime's donation) written over ``r`` where the kernel
        can (`conv_pointwise.adds_residual`)."""
        plan = self._residual_plan(x, w, b, activations)
        if (plan is not None and type(r) is np.ndarray and r.dtype == np.float32 and r.shape == plan.y_shape
                and r.flags.c_contiguous):
            over = (over_residual and r.flags.writeable and adds_residual(plan, over_residual=True)
                    and not np.may_share_memory(x, r))
            if over or adds_residual(plan):
                return run_pointwise(plan, x, residual=r, over_residual=over)
        y = Conv.run(self, x, w, b)
        if type(y) is np.ndarray and y.flags.writeable and fused_add(y, r, activations, into=y) is not None:
            return y
        return self.add.run(*((y, r) if self.conv_first else (r, y)), activations=activations)

    def donating_run(self, activations: Activations, donated: tuple[int, ...]) -> Callable[[list], list] | None:
        if 3 not in donated:
            return None
        run = self.run

        def outputs(args: list) -> list:
            return [run(*args, activations=activations, over_residual=True)]

        return outputs

    def _residual_plan(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
                       activations: Activations) -> PointwisePlan | None:
        """The plan of a float32 1x1 conv that may add the residual in its stores, with the Add's
        activations as its epilogue (`conv_pointwise.adds_residual` says where, over the residual
        or not), or None: worked out once per case (the same input shape, weight, bias and
        activations objects)."""
        case = (x.shape, x.dtype, w, b, activations)
        stored = self._stored
        if stored is not None and same_case(stored, case):
            return stored[5]
        plan = None
        epilogue = Epilogue.of(activations, np.dtype(np.float32))
        group = int(self.attr("group"))
        if (epilogue is not None and x.ndim == 4 and w.ndim == 4 and x.dtype == np.float32 and w.dtype == np.float32
                and (b is None or (b.dtype == np.float32 and b.shape == (w.shape[0],)))
                and x.shape[1] == w.shape[1] * group and w.shape[0] % group == 0 and x.shape[0] > 0):
            _, strides, dilations, begin, end, out = self._windows(x.shape, w.shape)
            if (math.prod(out) and route_2d(x.shape, w.shape, group, strides, dilations, begin, end, out,
                                            x.dtype) == POINTWISE):
                plan = pointwise_plan(x.shape, w, b, group, strides, out, epilogue,
                                      lambda name, work_out: self.derived(name, {1: w}, work_out))
                plan = plan if adds_residual(plan) or adds_residual(plan, over_residual=True) else None
        self._stored = case + (plan,)
        return plan
