"""Element-wise layers of float32 maps with the layer's fused activation, in one pass.

- `add_range`: ``act(a + b)``, two maps of one shape. A residual connection adds a block's output
  to its input and (ResNet, ShuffleNet) applies a ReLU: as NumPy passes, ``np.add`` read two maps
  and wrote a third, then the activation read and wrote it again. ResNet-50's 256 x 56 x 56 ones
  (3.2 MB each) took 0.6 ms apiece, a tenth of the model.
- `activate_range`: ``act(x)``, a standalone activation layer (ShuffleNet's ReLU after a
  Concat): NumPy copied the map, then applied the activation in place.
- `affine_rows`: ``act(x · scale[c] + shift[c])`` over channel planes, an inference-mode
  BatchNormalization that no conv before it could take (DenseNet's pre-activation BN + ReLU on
  concatenated features): as NumPy passes, a multiply, an add and the activation, three trips
  through the map.

Each is shared with the CPU backend's spinning helpers in ranges (`add_part`, `affine_part`).
The activations are `compiled.epilogue`'s codes (``NONE`` ... ``SWISH``) and its scalar forms
(`compiled.activations`), with Relu and Clip as NumPy's maximum and minimum pick (a -0 sum gives
Relu's +0; the conv epilogue's Relu keeps -0); nothing is contracted into an FMA. So the bits are
those of the NumPy ops followed by the standalone activation op.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import ARGS, KIND, address_as_pointer, post_and_count_asleep, wait_all
from . import inline, kernel
from .activations import gelu1, gelu_tanh1, hard_sigmoid1, hard_swish1, sigmoid1, swish1
from .epilogue import CLIP, HARD_SIGMOID, HARD_SWISH, LEAKY_RELU, RELU, SIGMOID, SWISH

#: Activation codes past the epilogue's that only `activate_range` (and its parts) takes: Gelu
#: (erf) and Gelu's tanh form, which no register block applies as it stores.
GELU, GELU_TANH = SWISH + 1, SWISH + 2

#: The kinds of spin-team part that are an `add_range`, an `affine_rows` and an `activate_range`.
ADD_PART_KIND, AFFINE_PART_KIND, ACTIVATE_PART_KIND = 10, 11, 12

_U = np.uint64


#: Values `add_range` sums before it applies the activation to them, while they are in L1.
CHUNK = 2048


@inline
def _relu(v: float) -> float:
    """``np.maximum(v, 0)`` as the Relu op computes it: NaN passes, -0 gives +0."""
    zero = np.float32(0.0)
    return v if (v > zero) | (v != v) else zero


@inline
def _activate_run(run: np.ndarray, act: int, af: float, bf: float) -> None:
    """``run[j] = act(run[j])`` in place over one contiguous run (an epilogue code and its float32
    parameters); each activation has its own loop, so each vectorises."""
    zero = np.float32(0.0)
    n = run.size
    if act == RELU:
        for j in range(n):
            run[_U(j)] = _relu(run[_U(j)])
    elif act == CLIP:  # np.maximum with the low bound, then np.minimum with the high one (the op's order)
        for j in range(n):
            v = run[_U(j)]
            v = v if (v > af) | (v != v) else af
            run[_U(j)] = v if (v < bf) | (v != v) else bf
    elif act == LEAKY_RELU:
        for j in range(n):
            v = run[_U(j)]
            run[_U(j)] = v if v >= zero else af * v
    elif act == HARD_SIGMOID:
        for j in range(n):
            run[_U(j)] = hard_sigmoid1(run[_U(j)], af, bf)
    elif act == HARD_SWISH:
        for j in range(n):
            run[_U(j)] = hard_swish1(run[_U(j)])
    elif act == SIGMOID:
        for j in range(n):
            run[_U(j)] = sigmoid1(run[_U(j)])
    elif act == SWISH:
        for j in range(n):
            run[_U(j)] = swish1(run[_U(j)], af)
    elif act == GELU:
        for j in range(n):
            run[_U(j)] = gelu1(run[_U(j)])
    elif act == GELU_TANH:
        for j in range(n):
            run[_U(j)] = gelu_tanh1(run[_U(j)])


@kernel(contract=False)  # (x · scale + shift and HardSigmoid's alpha·x + beta rounded twice, as NumPy)
def affine_rows(x: np.ndarray, scale: np.ndarray, shift: np.ndarray, out: np.ndarray, r0: int, r1: int, act: int,
                av: float, bv: float) -> None:
    """``out[r, j] = act(x[r, j] · scale[r % C] + shift[r % C])`` for rows ``r0:r1`` of the float32
    planes ``x`` and ``out`` (N·C, H·W), ``scale`` and ``shift`` (C,), or (N·C,): one value a row
    (``act``, ``av``, ``bv``: an epilogue code and its parameters)."""
    channels = scale.shape[0]
    af, bf = np.float32(av), np.float32(bv)
    for r in range(r0, r1):
        src, dst = x[r], out[r]
        a, b = scale[r % channels], shift[r % channels]
        for j in range(src.size):
            dst[_U(j)] = src[_U(j)] * a + b
        _activate_run(dst, act, af, bf)  # (a plane is in L1 or L2 still)


@kernel(contract=False)
def add_range(a: np.ndarray, b: np.ndarray, out: np.ndarray, lo: int, hi: int, act: int, av: float,
              bv: float) -> None:
    """``out[j] = act(a[j] + b[j])`` for ``j`` in ``[lo, hi)`` of the flat float32 arrays (``act``,
    ``av``, ``bv``: an epilogue code and its parameters): with Relu in the one loop (a residual
    connection's), else `CHUNK` values at a time, summed and then activated. ``out`` may be ``a``
    itself (a conv's result taking its residual, `ops/residual_conv.py`): a loop of its own, as
    LLVM's vector loop for three arrays checks that they do not overlap and, where they do, runs
    value by value (4.5x the time)."""
    in_place = out.ctypes.data == a.ctypes.data
    if act == RELU:  # (the common case: 20% faster than summing and activating by chunks)
        x, y, z = a[lo:hi], b[lo:hi], out[lo:hi]
        if in_place:  # (read and written through ``out``: ``a`` may be typed read-only)
            for j in range(z.size):
                z[_U(j)] = _relu(z[_U(j)] + y[_U(j)])
        else:
            for j in range(z.size):
                z[_U(j)] = _relu(x[_U(j)] + y[_U(j)])
        return
    af, bf = np.float32(av), np.float32(bv)
    for c0 in range(lo, hi, CHUNK):
        c1 = min(hi, c0 + CHUNK)
        x, y, z = a[c0:c1], b[c0:c1], out[c0:c1]
        if in_place:
            for j in range(z.size):
                z[_U(j)] = z[_U(j)] + y[_U(j)]
        else:
            for j in range(z.size):
                z[_U(j)] = x[_U(j)] + y[_U(j)]
        _activate_run(z, act, af, bf)


@kernel(contract=False)
def activate_range(x: np.ndarray, out: np.ndarray, lo: int, hi: int, act: int, av: float, bv: float) -> None:
    """``out[j] = act(x[j])`` for ``j`` in ``[lo, hi)`` of the flat float32 arrays: Relu in one
    loop, the others `CHUNK` values at a time, copied and then activated; ``out`` may be ``x``
    itself (an activation fused into a layer without an epilogue of its own, on its fresh
    result), then in place, one loop (`add_range` says why)."""
    af, bf = np.float32(av), np.float32(bv)
    if out.ctypes.data == x.ctypes.data:  # (through ``out``: ``x`` may be typed read-only)
        _activate_run(out[lo:hi], act, af, bf)
        return
    if act == RELU:
        src, dst = x[lo:hi], out[lo:hi]
        for j in range(dst.size):
            dst[_U(j)] = _relu(src[_U(j)])
        return
    for c0 in range(lo, hi, CHUNK):
        c1 = min(hi, c0 + CHUNK)
        src, dst = x[c0:c1], out[c0:c1]
        for j in range(dst.size):
            dst[_U(j)] = src[_U(j)]
        _activate_run(dst, act, af, bf)


@kernel(contract=False)
def post_add(control: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, cuts: np.ndarray, act: int,
             numbers: np.ndarray) -> int:
    """Post range ``i + 1`` of ``cuts`` (``cuts[i + 1]:cuts[i + 2]``) to helper ``i`` of a claimed
    team's ``control``, for `add_part` to run as ``add_range(a, b, out, lo, hi, act, *numbers)`` on
    flat float32 arrays (``numbers``: the epilogue's two parameters, float64); how many of those
    helpers were asleep (the caller wakes them). The caller keeps the arrays alive until the parts
    are done. Posted in one compiled call, as `finish_add` runs and waits: the parts' integers
    built in Python and posted through `SpinTeam.try_run` cost several microseconds a layer."""
    sleeping = 0
    for i in range(cuts.shape[0] - 2):
        row = control[i]
        row[KIND] = ADD_PART_KIND
        at = ARGS
        row[at], row[at + 1], row[at + 2], row[at + 3] = a.size, a.ctypes.data, b.ctypes.data, out.ctypes.data
        row[at + 4], row[at + 5], row[at + 6], row[at + 7] = numbers.ctypes.data, cuts[i + 1], cuts[i + 2], act
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel(contract=False)
def finish_add(control: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, cuts: np.ndarray, act: int,
               av: float, bv: float, rounds: int) -> bool:
    """Run range 0 of ``cuts`` here, then wait for the ranges `post_add` posted; False when a
    helper is not done within ``rounds`` spins (the caller then waits the slow way)."""
    add_range(a, b, out, cuts[0], cuts[1], act, av, bv)
    return wait_all(control, cuts.shape[0] - 2, rounds)


@numba.njit(inline="always")
def add_part(control: np.ndarray) -> None:
    """Run the `add_range` part posted in a spin team's ``control`` row (`post_add`): the
    helper's side (a `team_parts` runner)."""
    at = ARGS
    n = control[at]
    a = numba.carray(address_as_pointer(control[at + 1], np.float32), (n,))
    b = numba.carray(address_as_pointer(control[at + 2], np.float32), (n,))
    out = numba.carray(address_as_pointer(control[at + 3], np.float32), (n,))
    numbers = numba.carray(address_as_pointer(control[at + 4], np.float64), (2,))
    add_range(a, b, out, control[at + 5], control[at + 6], control[at + 7], numbers[0], numbers[1])


@kernel(contract=False)
def post_affine(control: np.ndarray, x: np.ndarray, scale: np.ndarray, shift: np.ndarray, out: np.ndarray,
                cuts: np.ndarray, act: int, numbers: np.ndarray) -> int:
    """`post_add` for `affine_rows` (rows ``cuts[i + 1]:cuts[i + 2]`` of ``x`` and ``out`` (rows,
    width), C-contiguous float32), for `affine_part` to run."""
    sleeping = 0
    for i in range(cuts.shape[0] - 2):
        row = control[i]
        row[KIND] = AFFINE_PART_KIND
        at = ARGS
        row[at], row[at + 1], row[at + 2] = x.shape[0], x.shape[1], scale.shape[0]
        row[at + 3], row[at + 4], row[at + 5] = x.ctypes.data, scale.ctypes.data, shift.ctypes.data
        row[at + 6], row[at + 7] = out.ctypes.data, numbers.ctypes.data
        row[at + 8], row[at + 9], row[at + 10] = cuts[i + 1], cuts[i + 2], act
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel(contract=False)
def finish_affine(control: np.ndarray, x: np.ndarray, scale: np.ndarray, shift: np.ndarray, out: np.ndarray,
                  cuts: np.ndarray, act: int, av: float, bv: float, rounds: int) -> bool:
    """`finish_add` for `affine_rows`."""
    affine_rows(x, scale, shift, out, cuts[0], cuts[1], act, av, bv)
    return wait_all(control, cuts.shape[0] - 2, rounds)


@numba.njit(inline="always")
def affine_part(control: np.ndarray) -> None:
    """Run the `affine_rows` part posted in a spin team's ``control`` row (`post_affine`)."""
    at = ARGS
    rows, width, channels = control[at], control[at + 1], control[at + 2]
    x = numba.carray(address_as_pointer(control[at + 3], np.float32), (rows, width))
    scale = numba.carray(address_as_pointer(control[at + 4], np.float32), (channels,))
    shift = numba.carray(address_as_pointer(control[at + 5], np.float32), (channels,))
    out = numba.carray(address_as_pointer(control[at + 6], np.float32), (rows, width))
    numbers = numba.carray(address_as_pointer(control[at + 7], np.float64), (2,))
    affine_rows(x, scale, shift, out, control[at + 8], control[at + 9], control[at + 10], numbers[0], numbers[1])


@kernel(contract=False)
def post_activate(control: np.ndarray, x: np.ndarray, out: np.ndarray, cuts: np.ndarray, act: int,
                  numbers: np.ndarray) -> int:
    """`post_add` for `activate_range`, for `activate_part` to run."""
    sleeping = 0
    for i in range(cuts.shape[0] - 2):
        row = control[i]
        row[KIND] = ACTIVATE_PART_KIND
        at = ARGS
        row[at], row[at + 1], row[at + 2], row[at + 3] = x.size, x.ctypes.data, out.ctypes.data, numbers.ctypes.data
        row[at + 4], row[at + 5], row[at + 6] = cuts[i + 1], cuts[i + 2], act
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel(contract=False)
def finish_activate(control: np.ndarray, x: np.ndarray, out: np.ndarray, cuts: np.ndarray, act: int, av: float,
                    bv: float, rounds: int) -> bool:
    """`finish_add` for `activate_range`."""
    activate_range(x, out, cuts[0], cuts[1], act, av, bv)
    return wait_all(control, cuts.shape[0] - 2, rounds)


@numba.njit(inline="always")
def activate_part(control: np.ndarray) -> None:
    """Run the `activate_range` part posted in a spin team's ``control`` row (`post_activate`)."""
    at = ARGS
    n = control[at]
    x = numba.carray(address_as_pointer(control[at + 1], np.float32), (n,))
    out = numba.carray(address_as_pointer(control[at + 2], np.float32), (n,))
    numbers = numba.carray(address_as_pointer(control[at + 3], np.float64), (2,))
    activate_range(x, out, control[at + 4], control[at + 5], control[at + 6], numbers[0], numbers[1])
