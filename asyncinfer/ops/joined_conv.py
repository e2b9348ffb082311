"""Convs of one input side by side, their results concatenated: computed as one conv.

Each of SqueezeNet's fire modules ends in a 1x1 and a 3x3 conv of the same squeezed map, whose
results a Concat joins along the channels: three layers, the last a copy of both results (8
Concats a run, 0.13 ms of SqueezeNet's 2.2 on two cores), and two convs each handed to the spinning
helpers and waited for. The loader joins them (`loader.patterns.fuse_joined_convs`) into one
layer that the direct panel kernel (`conv_direct.joined_panel_plan`) runs as one conv: each panel
of output channels sums its own conv's taps, read in one zero-padded copy of the input, and
stores its channels straight into their place in the joined result. A 1x1 conv's panels sum a
ninth of the 3x3's taps, about as fast a multiply-add as the 1x1 kernel (`conv_pointwise`) on
these maps (16 -> 64 at 55x55 37 against 31 µs, 64 -> 256 at 13x13 25 against 24, one core).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .base import Op
from .conv import DIRECT_PANELS, Conv, route_2d
from .conv_direct import PANEL_WIDTH, PanelConv, PanelPlan, joined_panel_plan, run_direct_panels
from .epilogue import Epilogue
from .fused import FUSED_DOMAIN
from .registry import create, register


@register("JoinedConv", versions=(1,), domain=FUSED_DOMAIN)
class JoinedConv(Op):
    """``Concat(Conv(X, W_1, B_1), …, Conv(X, W_k, B_k), axis=1)``, each conv with its fused
    activations.

    Inputs: ``X``, then each conv's weight and bias (an omitted bias stays omitted). The convs
    (their attributes and activations) and the Concat are the layer's expansion, which backends
    without this kernel run. Where the convs are float32 2-D convs of one group with the same
    strides onto the same output map and the same activation, every conv's channels but the
    last's fill whole panels of the kernel (`conv_direct.PANEL_WIDTH`), and the conv with the most
    taps takes the direct panel kernel anyway (not Winograd, not another kernel), one
    `joined_panel_plan` runs them all: each value summed over its own conv's taps, in (channel,
    row, column) order, then its conv's bias and activation. Any other case runs the convs one by
    one, then the Concat."""

    multithreaded = True

    def check(self) -> None:
        *convs, concat = self._joined_layers() or [None]
        if (not convs or concat is None or concat.op_type != "Concat" or any(c.op_type != "Conv" for c in convs)
                or len(self.layer.inputs) != 1 + 2 * len(convs)):
            self.unsupported("a JoinedConv layer is made by the loader from convs of one input and their Concat")
        self.convs: list[Conv] = [create(conv, self.limits) for conv in convs]  # type: ignore[misc]
        self.activations = [tuple((create(f, self.limits), []) for f in conv.fused) for conv in convs]
        self.concat = create(concat, self.limits)
        # the last case the panel kernel runs: (x shape, x dtype, weights and biases) and its plan;
        # the last case that runs the convs, not looked at again
        self._joined: tuple[tuple, PanelPlan] | None = None
        self._apart: tuple | None = None

    def bind_constants(self, constants: Mapping[int, np.ndarray]) -> None:
        super().bind_constants(constants)
        for i, conv in enumerate(self.convs):  # (each conv's own kept weights, where it runs alone)
            conv.bind_constants({j: constants[2 * i + j] for j in (1, 2) if 2 * i + j in constants})

    def _joined_layers(self) -> list:
        """The layers this one joins: the convs and their Concat (its expansion)."""
        return list(self.layer.expansion)

    def run(self, x: np.ndarray, *operands: np.ndarray | None) -> np.ndarray:
        plan = self.panel_plan(x, operands)
        if plan is not None:
            return run_direct_panels(plan, x)
        return self._run_apart(x, operands)

    def panel_plan(self, x: np.ndarray, operands: tuple[np.ndarray | None, ...]) -> PanelPlan | None:
        """The panel kernel's plan for this input and these weights (None: the convs run apart),
        the last case's kept."""
        case = (x.shape, x.dtype, *operands)
        joined = self._joined
        if joined is not None and _same(joined[0], case):
            return joined[1]
        if self._apart is not None and _same(self._apart, case):
            return None
        plan = self._plan(x, operands)
        if plan is None:
            self._apart = case
        else:
            self._joined = (case, plan)
        return plan

    def _run_apart(self, x: np.ndarray, operands: tuple[np.ndarray | None, ...]) -> np.ndarray:
        """The convs one by one, then their Concat."""
        results = [conv.run(x, operands[2 * i], operands[2 * i + 1], activations=self.activations[i])
                   for i, conv in enumerate(self.convs)]
        return self.concat.run(*results)

    def _plan(self, x: np.ndarray, operands: tuple[np.ndarray | None, ...]) -> PanelPlan | None:
        """The joined plan of this case, or None where the convs run apart (see the class)."""
        epilogues = {Epilogue.of(activations, np.dtype(np.float32)) for activations in self.activations}
        if x.dtype != np.float32 or x.ndim != 4 or None in epilogues or len(epilogues) != 1 or 0 in x.shape:
            return None
        convs, geometry, deepest = [], set(), None
        for i, conv in enumerate(self.convs):
            w, b = operands[2 * i], operands[2 * i + 1]
            if (w is None or w.dtype != np.float32 or w.ndim != 4 or w.shape[1] != x.shape[1]
                    or int(conv.attr("group")) != 1
                    or (b is not None and (b.dtype != np.float32 or b.shape != (w.shape[0],)))):
                return None
            if i < len(self.convs) - 1 and w.shape[0] % PANEL_WIDTH:
                return None
            _, strides, dilations, begin, end, out = conv._windows(x.shape, w.shape)
            if min(begin) < 0 or min(out) <= 0:
                return None
            geometry.add((strides, out))
            convs.append(PanelConv(w, b, dilations, begin))
            if deepest is None or w[0].size > convs[deepest].weight[0].size:
                deepest = i
        if len(geometry) != 1 or deepest is None:
            return None
        (strides, out), = geometry
        conv, w = self.convs[deepest], convs[deepest].weight
        _, _, dilations, begin, end, _ = conv._windows(x.shape, w.shape)
        if (route_2d(x.shape, w.shape, 1, strides, dilations, begin, end, out, x.dtype) != DIRECT_PANELS
                or conv._winograd_tile(x, w)):
            return None
        weights = {1 + 2 * i: operand for i, operand in enumerate(operands[::2])}
        return joined_panel_plan(x.shape, convs, strides, out, epilogues.pop(),
                                 lambda name, work_out: self.derived(name, weights, work_out))


def _same(known: tuple, case: tuple) -> bool:
    """Whether ``case`` is ``known``'s: equal input shape and dtype, the very same weights and
    biases (a model's constants)."""
    return case[:2] == known[:2] and len(case) == len(known) and all(a is k for a, k in zip(case[2:], known[2:]))

