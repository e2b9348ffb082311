"""Sums of two float32 arrays of one shape, with the layer's fused activation, in one pass.

A residual connection adds a block's output to its input and (ResNet, ShuffleNet) applies a ReLU:
as NumPy passes, ``np.add`` reads two maps and writes a third, then the activation reads and
writes it again, on one thread. ResNet-50's 256 x 56 x 56 ones (3.2 MB each) took 0.6 ms apiece,
a tenth of the model. Here each value is ``act(a + b)`` stored once, and a large sum is shared
with the CPU backend's spinning helpers by ranges of the flat arrays (`add_part`).

The activations are `compiled.epilogue`'s codes (``NONE`` ... ``SWISH``) and its scalar forms
(`compiled.activations`), with Relu and Clip as NumPy's maximum and minimum pick (a -0 sum gives
Relu's +0; the conv epilogue's Relu keeps -0), so the bits are those of ``np.add`` followed by the
standalone op.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import ARGS, address_as_pointer, addresses
from . import kernel
from .activations import hard_sigmoid1, hard_swish1, sigmoid1, swish1
from .epilogue import CLIP, HARD_SIGMOID, HARD_SWISH, LEAKY_RELU, NONE, RELU, SIGMOID

#: The kind of a spin-team part that is an `add_range`.
PART_KIND = 10

_U = np.uint64


@kernel(contract=False)  # (HardSigmoid's alpha·x + beta rounded twice, as the standalone op)
def add_range(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, hi: int, act: int, av: float,
              bv: float) -> None:
    """``out[j] = act(a[j] + b[j])`` for ``j`` in ``[lo, hi)`` of the flat float32 arrays (``act``,
    ``av``, ``bv``: an epilogue code and its parameters). Each activation has its own loop, so
    every loop vectorises."""
    x, y, z = a[lo:hi], b[lo:hi], out[lo:hi]
    zero = np.float32(0.0)
    af, bf = np.float32(av), np.float32(bv)
    n = z.size
    if act == NONE:
        for j in range(n):
            z[_U(j)] = x[_U(j)] + y[_U(j)]
    elif act == RELU:  # np.maximum(v, 0) as the op computes it: NaN passes, -0 gives +0
        for j in range(n):
            v = x[_U(j)] + y[_U(j)]
            z[_U(j)] = v if (v > zero) | (v != v) else zero
    elif act == CLIP:  # np.maximum with the low bound, then np.minimum with the high one (the op's order)
        for j in range(n):
            v = x[_U(j)] + y[_U(j)]
            v = v if (v > af) | (v != v) else af
            z[_U(j)] = v if (v < bf) | (v != v) else bf
    elif act == LEAKY_RELU:
        for j in range(n):
            v = x[_U(j)] + y[_U(j)]
            z[_U(j)] = v if v >= zero else af * v
    elif act == HARD_SIGMOID:
        for j in range(n):
            z[_U(j)] = hard_sigmoid1(x[_U(j)] + y[_U(j)], af, bf)
    elif act == HARD_SWISH:
        for j in range(n):
            z[_U(j)] = hard_swish1(x[_U(j)] + y[_U(j)])
    elif act == SIGMOID:
        for j in range(n):
            z[_U(j)] = sigmoid1(x[_U(j)] + y[_U(j)])
    else:  # SWISH
        for j in range(n):
            z[_U(j)] = swish1(x[_U(j)] + y[_U(j)], af)


def part_arguments(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, hi: int, act: int,
                   numbers: np.ndarray) -> list[int]:
    """The integers of a part `add_part` runs as ``add_range(a, b, out, lo, hi, act, *numbers)``
    on flat float32 arrays (``numbers``: the epilogue's two parameters as a float64 array), for
    `SpinTeam.try_run`; the caller keeps every array alive until the part is done."""
    return [PART_KIND, a.size, *addresses(a, b, out, numbers)[:4], lo, hi, act]


@numba.njit(inline="always")
def add_part(control: np.ndarray) -> None:
    """Run the `add_range` part posted in a spin team's ``control`` row (`part_arguments`): the
    helper's side (`team_parts.serve_parts`)."""
    at = ARGS
    n = control[at]
    a = numba.carray(address_as_pointer(control[at + 1], np.float32), (n,))
    b = numba.carray(address_as_pointer(control[at + 2], np.float32), (n,))
    out = numba.carray(address_as_pointer(control[at + 3], np.float32), (n,))
    numbers = numba.carray(address_as_pointer(control[at + 4], np.float64), (2,))
    add_range(a, b, out, control[at + 5], control[at + 6], control[at + 7], numbers[0], numbers[1])
