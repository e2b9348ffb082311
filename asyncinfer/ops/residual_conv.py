"""A conv whose result only a residual Add reads: the Add and its activation done in place.

A residual block ends in ``Relu(Add(Conv(x), shortcut))``: ResNet-50's 16 bottlenecks, ShuffleNet's
13 stride-1 units. As two layers, the Add is a layer of its own, with its scheduling, its own
hand-off to the spinning helpers and a third map for its result, after a conv that has just
written its own. The loader joins the two (`loader.patterns.fuse_residual_adds`) into one layer
that runs the conv, then adds the shortcut into the conv's fresh result, in place and with the
Add's activation (`one_pass.fused_add`): the very bits of the two layers, one layer fewer.
"""
from __future__ import annotations

import numpy as np

from .conv import Conv
from .epilogue import Activations
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

    def run(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, r: np.ndarray,  # type: ignore[override]
            *, activations: Activations = ()) -> np.ndarray:
        y = Conv.run(self, x, w, b)
        if type(y) is np.ndarray and y.flags.writeable and fused_add(y, r, activations, into=y) is not None:
            return y
        return self.add.run(*((y, r) if self.conv_first else (r, y)), activations=activations)
