"""Squeeze-and-excitation as one layer: ``x · act2(W2 · act1(W1 · mean(x) + b1) + b2)``.

MobileNetV3's and EfficientNet's SE blocks are five layers (a global average pool, two 1x1 convs
on the pooled vector with their activations, the Mul scaling ``x``) that cost a model of small
layers more in per-layer overhead than in arithmetic, and whose weights (660 KB for a 576-channel
block) come from L3 every run. The loader joins them (`loader.patterns.fuse_squeeze_excite`) into
one `SqueezeExcite` layer; float32 blocks with activations the epilogue has run in two compiled
phases (`compiled.squeeze_excite`), shared by channels with the CPU backend's spinning helpers so
that each core reads half of the weights and scales its own channels. Other blocks take the steps
of the layers they replace, which are the layer's expansion (for other backends too).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..concurrency import parallel, spin_team
from .base import Op
from .compiled.squeeze_excite import EXCITE, chunks_of, finish_squeeze_excite, post_and_finish_squeeze_excite
from .compiled.squeeze_excite import PART_KIND as SQUEEZE_EXCITE_PART
from .compiled.squeeze_excite import scratch_floats, squeeze_excite
from .conv_kernels import scratch
from .epilogue import Activations, Epilogue, apply_activations
from .fused import FUSED_DOMAIN
from .pool import global_average
from .registry import create, register
from .shape import op_error

#: From this much work (values of ``x`` plus weights of the two products) a block is shared with
#: the spinning helpers.
TEAM_MIN_VALUES = 1 << 14


@register("SqueezeExcite", versions=(1,), domain=FUSED_DOMAIN)
class SqueezeExcite(Op):
    """The gated map ``x · act2(W2 · act1(W1 · mean(x) + b1) + b2)`` per image and channel.

    Inputs: ``x (N, C, H, W)``, ``W1 (R, C, 1, 1)``, ``b1 (R,)`` or none, ``W2 (C, R, 1, 1)``,
    ``b2 (C,)`` or none. The activations are those fused into the two convs of the expansion.
    A float32 block whose activations the epilogue has runs compiled: the same bits on any
    number of threads, its products' sums differing from the unfused convs' GEMV by rounding
    alone; given ``x`` (the runtime's donation), it scales ``x`` in place. Other blocks take the
    steps of the layers they replace.
    """

    #: ``x``, written over where the runtime gives it up (`donating_run`).
    donatable_inputs = (0,)

    _known: tuple | None = None  # (x shape, w1, b1, w2, b2, plan): the last case, its weights constants

    def check(self) -> None:
        convs = [layer for layer in self.layer.expansion if layer.op_type == "Conv"]
        if len(convs) != 2 or len(self.layer.inputs) != 5:
            self.unsupported("a SqueezeExcite layer is made by the loader from a pool, two convs and a Mul")
        self.activations: list[Activations] = [tuple((create(f, self.limits), []) for f in conv.fused)
                                               for conv in convs]
        # each conv's float32 bias-and-activation epilogue, made once (None: applied after)
        first, second = (Epilogue.of(activations, np.dtype(np.float32)) for activations in self.activations)
        self.compiled = first is not None and second is not None
        if first is not None and second is not None:
            self.acts = np.array([first.kind, second.kind], np.int64)
            self.numbers = np.array([first.a, first.b, second.a, second.b], np.float64)

    def run(self, x: np.ndarray, w1: np.ndarray, b1: np.ndarray | None, w2: np.ndarray,
            b2: np.ndarray | None, *, in_place: bool = False) -> np.ndarray:
        """The gated map; with ``in_place`` (``x`` donated: nothing else reads it) written over
        ``x`` where the compiled block runs."""
        if x.ndim != 4 or w1.ndim != 4 or w2.ndim != 4 or w1.shape[1] != x.shape[1] or w2.shape[:2] != w1.shape[1::-1]:
            raise op_error(self, f"input of shape {x.shape} does not fit weights of shapes {w1.shape} and {w2.shape}")
        plan = self._plan(x, w1, b1, w2, b2)
        if plan is not None:
            return plan.run(x, in_place)
        n, c = x.shape[:2]
        pooled = global_average(x).reshape(n, c).T  # (C, N): the pooled images as columns
        gate = np.ascontiguousarray(self._conv(self._conv(pooled, w1, b1, 0), w2, b2, 1).T, x.dtype).reshape(-1)
        return np.multiply(x, gate.reshape(n, c, 1, 1))

    def bound_run(self, activations: Activations = ()) -> Callable[[list], list]:
        return self._bound(False)

    def donating_run(self, activations: Activations, donated: tuple[int, ...]) -> Callable[[list], list] | None:
        return self._bound(True) if 0 in donated else None

    def _bound(self, in_place: bool) -> Callable[[list], list]:
        """`run` from a job's list of inputs, this case's plan taken straight where the input's
        shape and the weight objects are the last run's (a model's constants): the checks and
        lookups of the full way were 6 of a 576-channel block's 26 µs on one core."""
        run = self.run

        def outputs(args: list) -> list:
            x = args[0]
            known = self._known
            if (known is not None and x.shape == known[0] and args[1] is known[1] and args[2] is known[2]
                    and args[3] is known[3] and args[4] is known[4] and x.dtype == np.float32):
                return [known[5].run(x, in_place)]
            return [run(*args, in_place=in_place)]

        return outputs

    def _plan(self, x: np.ndarray, w1: np.ndarray, b1: np.ndarray | None, w2: np.ndarray,
              b2: np.ndarray | None) -> SqueezeExcitePlan | None:
        """The compiled block's plan for this case (kept for the next run where the weights are
        the model's constants), or None: not a float32 block of the epilogue's activations."""
        if not (self.compiled and x.dtype == w1.dtype == w2.dtype == np.float32 and x.size
                and all(b is None or b.dtype == np.float32 for b in (b1, b2))):
            return None
        plan = SqueezeExcitePlan(x.shape, *self.derived("first", {1: w1, 2: b1}, lambda: _transposed_and_bias(w1, b1)),
                                 *self.derived("second", {3: w2, 4: b2}, lambda: _transposed_and_bias(w2, b2)),
                                 self.acts, self.numbers)
        if all(self.bound_constant(i) is value for i, value in ((1, w1), (2, b1), (3, w2), (4, b2))):
            self._known = (x.shape, w1, b1, w2, b2, plan)
        return plan

    def _conv(self, columns: np.ndarray, w: np.ndarray, b: np.ndarray | None, which: int) -> np.ndarray:
        """``act(W · columns + b)`` for columns ``(C, N)``: conv ``which`` (0 or 1) of N one-pixel images."""
        y = np.matmul(w.reshape(w.shape[0], -1), np.ascontiguousarray(columns))
        if b is not None:
            y += b.reshape(-1, 1)
        return apply_activations(y, self.activations[which], ())


class SqueezeExcitePlan:
    """How `SqueezeExcite` runs a float32 block of one input shape: the weights transposed as
    `compiled.squeeze_excite` reads them, the scratch it needs, whether it is large enough to
    share with the spinning helpers (`TEAM_MIN_VALUES`)."""

    def __init__(self, shape: tuple[int, ...], w1t: np.ndarray, b1: np.ndarray, w2t: np.ndarray, b2: np.ndarray,
                 acts: np.ndarray, numbers: np.ndarray):
        n, c = shape[0], shape[1]
        r = b1.shape[0]
        self.w1t, self.b1, self.w2t, self.b2, self.acts, self.numbers = w1t, b1, w2t, b2, acts, numbers
        self.chunks = chunks_of(c)
        self.shared = self.chunks > 1 and math.prod(shape) + 2 * c * r >= TEAM_MIN_VALUES
        # room for a hidden vector per chunk: as many threads as ever share the block
        self.scratch_shape = (scratch_floats(n, c, r, self.chunks),)

    def run(self, x: np.ndarray, in_place: bool) -> np.ndarray:
        """``x`` (float32, the plan's shape) gated: into a fresh array, or with ``in_place`` over
        ``x`` (or the contiguous copy of it this makes)."""
        x = np.ascontiguousarray(x)  # (x itself, or a copy of it: ours to write)
        out = x if in_place and x.flags.writeable else np.empty(x.shape, np.float32)
        own = scratch(self.scratch_shape, np.float32, "squeeze_excite")
        team = parallel.team(SQUEEZE_EXCITE_PART) if self.shared else None
        count = 1 if team is None else min(team.helpers + 1, self.chunks)
        control = team.claim() if count > 1 else None  # type: ignore[union-attr]
        if control is None:
            squeeze_excite(x, self.w1t, self.b1, self.w2t, self.b2, self.acts, self.numbers, own, out)
            return out
        try:
            cuts = spin_team.range_cuts(self.chunks, count, 1)
            arguments = (x, self.w1t, self.b1, self.w2t, self.b2, self.acts, self.numbers, own, out, cuts,
                         spin_team.WAIT_ROUNDS)
            phase = 0
            while True:  # the phases posted, run and waited for in one compiled call while the helpers keep up
                phase, status = divmod(post_and_finish_squeeze_excite(control, phase, *arguments), 4)
                if status != spin_team.PARTS_DONE:
                    team.settle(status, finish_squeeze_excite, (control, phase, *arguments),  # type: ignore[union-attr]
                                count - 1)
                if phase == EXCITE:
                    return out
                phase += 1
        finally:
            team.release()  # type: ignore[union-attr]


def _transposed_and_bias(w: np.ndarray, b: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """A 1x1 conv's weights (O, I, 1, 1) transposed, contiguous float32 (I, O), and its bias (zeros
    where it has none): as `compiled.squeeze_excite` reads them."""
    rows = np.ascontiguousarray(w.reshape(w.shape[0], -1).T, np.float32)
    return rows, np.zeros(w.shape[0], np.float32) if b is None else np.ascontiguousarray(b, np.float32)

