"""A grouped conv followed by ShuffleNet's channel shuffle, the shuffle stored by the conv itself.

ShuffleNet mixes the groups of each grouped 1x1 conv with a channel shuffle, exported as three
layers: ``Reshape(N, G, M/G, H, W) → Transpose(0, 2, 1, 3, 4) → Reshape(N, M, H, W)``. The
Transpose is a view and the second Reshape copies it: a pass over the map per shuffle, 16 a
ShuffleNet run (about 0.5 ms of its 5-6 on two cores here, two layers' overhead each included).
After the shuffle, the conv's channel ``g·M/G + j`` sits at ``j·G + g``: each group's channels
are every G-th row of the output, which the panel GEMM of a 1x1 conv stores directly
(`compiled.pointwise`'s ``shuffled``), so the shuffle costs nothing.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .conv import POINTWISE, Conv, route_2d
from .conv_pointwise import PointwisePlan, pointwise_plan, run_pointwise
from .epilogue import Activations, Epilogue
from .fused import FUSED_DOMAIN
from .registry import register
from .shape import int_list, reshape_dims, reshape_to, transpose_by

#: The Transpose of a channel shuffle: the group axis and the channels-in-a-group axis swapped.
SHUFFLE_PERM = [0, 2, 1, 3, 4]


@register("ShuffledConv", versions=(1,), domain=FUSED_DOMAIN)
class ShuffledConv(Conv):
    """``Reshape(Transpose(Reshape(Conv(X, W, B), shape), perm), shape_after)``, the conv's fused
    activations applied to its result (before the reshapes, which move values only).

    Inputs ``X``, ``W``, ``B`` (optional), ``shape`` and ``shape_after`` (the Reshapes' targets);
    attributes: the Conv's, ``perm`` (the Transpose's), ``allowzero`` and ``allowzero_after`` (the
    Reshapes'). Where the three layers are the channel shuffle of the conv's G groups (``shape``
    resolves to ``(N, G, M/G, Ho, Wo)``, ``perm`` is `SHUFFLE_PERM`, ``shape_after`` to ``(N, M,
    Ho, Wo)``) and the conv runs on the panel GEMM, the GEMM stores the shuffled channels: the
    very values of the layers, none copied. Any other case runs the conv, then the layers."""

    value_inputs = (3, 4)  # the Reshapes' targets

    def check(self) -> None:
        super().check()
        if len(self.layer.inputs) != 5 or not all(self.layer.inputs[3:]):
            self.unsupported("a ShuffledConv layer is made by the loader, with both Reshape targets")
        self.perm = [int(p) for p in self.attr("perm")]
        self.allowzero = bool(int(self.attr("allowzero", 0)))
        self.allowzero_after = bool(int(self.attr("allowzero_after", 0)))
        # the last case the GEMM stores shuffled: (x shape, x dtype, w, b, activations, shape,
        # shape_after) and its plan; the last case that runs the layers, not looked at again
        self._shuffled: tuple | None = None
        self._layers: tuple | None = None

    def run(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, shape: np.ndarray,  # type: ignore[override]
            shape_after: np.ndarray, *, activations: Activations = ()) -> np.ndarray:
        case = (x.shape, x.dtype, w, b, activations, shape, shape_after)
        known = self._shuffled
        if known is not None and _same(known[0], case):
            return run_pointwise(known[1], x)
        if self._layers is None or not _same(self._layers, case):
            plan = self._plan(x, w, b, shape, shape_after, activations)
            if plan is not None:
                self._shuffled = (case, plan)
                return run_pointwise(plan, x)
            self._layers = case
        y = Conv.run(self, x, w, b, activations=activations)
        y = transpose_by(self, reshape_to(self, y, int_list(shape), self.allowzero), self.perm)
        return reshape_to(self, y, int_list(shape_after), self.allowzero_after)

    def _plan(self, x: np.ndarray, w: np.ndarray, b: np.ndarray | None, shape: np.ndarray, shape_after: np.ndarray,
              activations: Activations) -> PointwisePlan | None:
        """The panel GEMM's plan storing the shuffled channels, or None where the layers do not
        shuffle the conv's groups or the conv takes another kernel."""
        group = int(self.attr("group"))
        epilogue = Epilogue.of(activations, np.dtype(np.float32))
        if (epilogue is None or group < 2 or self.perm != SHUFFLE_PERM
                or x.ndim != 4 or w.ndim != 4 or x.dtype != np.float32 or w.dtype != np.float32
                or (b is not None and (b.dtype != np.float32 or b.shape != (w.shape[0],)))
                or x.shape[1] != w.shape[1] * group or w.shape[0] % group):
            return None
        _, strides, dilations, begin, end, out = self._windows(x.shape, w.shape)
        n, m = x.shape[0], w.shape[0]
        if math.prod(out) == 0 or n == 0 or route_2d(x.shape, w.shape, group, strides, dilations, begin, end, out,
                                                    x.dtype) != POINTWISE:
            return None
        grouped = _resolved((n, m, *out), int_list(shape), self.allowzero)
        after = _resolved((n, m // group, group, *out), int_list(shape_after), self.allowzero_after)
        if grouped != [n, group, m // group, *out] or after != [n, m, *out]:
            return None
        keep: Callable = lambda name, work_out: self.derived(name, {1: w}, work_out)  # noqa: E731
        return pointwise_plan(x.shape, w, b, group, strides, out, epilogue, keep, shuffled=True)


def _resolved(shape: tuple[int, ...], target: list[int], allowzero: bool) -> list[int] | None:
    """Reshape's ``target`` for an input of ``shape`` with its 0s and a -1 resolved, or None where
    it cannot be (the layers then say why)."""
    dims = reshape_dims(shape, target, allowzero)
    known, total = math.prod(d for d in dims if d != -1), math.prod(shape)
    if dims.count(-1) > 1 or any(d < -1 for d in dims) or (-1 in dims and (known == 0 or total % known)):
        return None
    return [total // known if d == -1 else d for d in dims]


def _same(known: tuple, case: tuple) -> bool:
    """Whether ``case`` is ``known``'s: equal input shape and dtype, the very same weight, bias,
    activations and target objects (a model's constants)."""
    return case[:2] == known[:2] and all(a is k for a, k in zip(case[2:], known[2:]))
