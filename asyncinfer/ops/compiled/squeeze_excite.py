"""Squeeze-and-excitation in two compiled phases, each shared by channels with the spinning helpers.

MobileNetV3's and EfficientNet's SE blocks do little arithmetic (a 576-channel block: 28 K values
pooled, two products of 83 K multiply-adds, 28 K values scaled) but read 660 KB of weights that
the layers before pushed out of the core's caches. As one call on one core a 576-channel block
took 30 µs in MobileNetV3-small's run, and 41 on two cores (its map written by both, read by
one); row by row dot products (a sum across the lanes per weight row) ran the products at a
quarter of the core's rate.

Phase one (`squeeze_range`), a range of chunks of `CHUNK` channels each: each channel's mean
(GlobalAveragePool's own: summed in float64), and the first product's partial sums over the
chunk's channels, ``partials[i, k] = W1[:, chunk k] · mean[chunk k]``: the weights stored
transposed (C, R), so a channel's row of weights scales the chunk's running sums, a vector of
them at a time. Phase two (`excite_range`), a range of channels: ``hidden = act1(Σ_k
partials[i, k] + b1)`` (each thread sums the few partials itself), the second product for those
channels, ``gate[c] = act2(b2[c] + Σ_j W2[c, j] · hidden[j])`` (W2 transposed, (R, C): a vector of
channels at a time), and the scaling ``out[i, c] = x[i, c] · gate[c]``. Between the phases every
partial sum is in. The chunks fix the order of every sum, so the result has the same bits however
many threads share it; the products' sums differ from the unfused convs' GEMV by rounding alone.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import (ARGS, HELPERS_ASLEEP, KIND, PARTS_DONE, PARTS_RUNNING, address_as_pointer,
                                      post_and_count_asleep, wait_all)
from . import inline, kernel
from .epilogue import _apply_run
from .rows import row_sum

PART_KIND = 25  # (after the pool loops' kinds, 17-24)
#: Channels a partial sum of the first product covers (and the grain of a thread's range).
CHUNK = 16
#: The phases, the first argument of a posted part.
SQUEEZE, EXCITE = 0, 1

_U = np.uint64
_NEGATIVE_ZERO = np.float32(-0.0)  # (an activation alone: the bias is in already)


def chunks_of(channels: int) -> int:
    """How many chunks of `CHUNK` channels make ``channels`` (the last may be short)."""
    return -(-channels // CHUNK)


def _lines(floats: int) -> int:
    """``floats`` rounded up to whole cache lines of float32."""
    return -(-floats // CHUNK) * CHUNK


def scratch_floats(n: int, c: int, r: int, threads: int) -> int:
    """Float32 values of scratch a block of ``n`` images, ``c`` channels and ``r`` hidden values
    needs on ``threads`` threads: the partial sums, the gates and each thread's hidden vector
    (`_carve`), each thread's share on cache lines of its own."""
    return n * chunks_of(c) * _lines(r) + n * _lines(c) + threads * _lines(r)


@numba.njit(inline="always")
def _carve(scratch: np.ndarray, n: int, c: int, r: int, threads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`scratch_floats`'s views: the partial sums (N, chunks, R'), the gates (N, C') and the
    hidden vectors (threads, R'), R' and C' rounded up to whole lines."""
    rp, cp = -(-r // CHUNK) * CHUNK, -(-c // CHUNK) * CHUNK
    chunks = -(-c // CHUNK)
    a = n * chunks * rp
    b = a + n * cp
    return (scratch[:a].reshape((n, chunks, rp)), scratch[a:b].reshape((n, cp)),
            scratch[b:b + threads * rp].reshape((threads, rp)))


@kernel
def squeeze_range(x: np.ndarray, w1t: np.ndarray, partials: np.ndarray, k0: int, k1: int) -> None:
    """Phase one for chunks ``k0:k1`` of every image of ``x`` (N, C, HW), float32: the means of
    their channels and ``partials[i, k, :R] = Σ_{c in chunk k} w1t[c, :] · mean[i, c]`` (``w1t``
    (C, R)), from zero, one multiply-add after another in channel order."""
    n, c, hw = x.shape
    r = w1t.shape[1]
    means = np.empty(CHUNK, np.float32)
    for i in range(n):
        for k in range(k0, k1):
            c0 = k * CHUNK
            c1 = min(c0 + CHUNK, c)
            for ch in range(c0, c1):
                means[ch - c0] = row_sum(x[i, ch]) / hw  # (GlobalAveragePool's own mean)
            acc = partials[i, k, :r]
            for j in range(r):
                acc[_U(j)] = 0.0
            _add_rows(acc, w1t, 0, means, c0, c1)


@inline
def _add_rows(acc: np.ndarray, rows: np.ndarray, column: int, factors: np.ndarray, r0: int, r1: int) -> None:
    """``acc[j] += Σ_{r0 <= r < r1} rows[r, column + j] · factors[r - r0]``, one multiply-add after
    another in row order; eight rows a pass over ``acc`` (each value of it loaded and stored once
    for eight multiply-adds: a pass per row is bound by those loads and stores)."""
    w = acc.size
    c0, c1 = column, column + w
    r = r0
    while r + 8 <= r1:
        f0, f1, f2, f3 = factors[r - r0], factors[r - r0 + 1], factors[r - r0 + 2], factors[r - r0 + 3]
        f4, f5, f6, f7 = factors[r - r0 + 4], factors[r - r0 + 5], factors[r - r0 + 6], factors[r - r0 + 7]
        b0, b1, b2, b3 = rows[r, c0:c1], rows[r + 1, c0:c1], rows[r + 2, c0:c1], rows[r + 3, c0:c1]
        b4, b5, b6, b7 = rows[r + 4, c0:c1], rows[r + 5, c0:c1], rows[r + 6, c0:c1], rows[r + 7, c0:c1]
        for j in range(w):
            acc[_U(j)] = (acc[_U(j)] + f0 * b0[_U(j)] + f1 * b1[_U(j)] + f2 * b2[_U(j)] + f3 * b3[_U(j)]
                          + f4 * b4[_U(j)] + f5 * b5[_U(j)] + f6 * b6[_U(j)] + f7 * b7[_U(j)])
        r += 8
    while r < r1:
        f0, b0 = factors[r - r0], rows[r, c0:c1]
        for j in range(w):
            acc[_U(j)] = acc[_U(j)] + f0 * b0[_U(j)]
        r += 1


@kernel
def excite_range(x: np.ndarray, partials: np.ndarray, b1: np.ndarray, w2t: np.ndarray, b2: np.ndarray,
                 kind1: int, a1: float, c1: float, kind2: int, a2: float, c2: float, hidden: np.ndarray,
                 gate: np.ndarray, out: np.ndarray, ch0: int, ch1: int) -> None:
    """Phase two for channels ``ch0:ch1`` of every image: the hidden vector from the partial sums
    (into ``hidden``, this thread's own), each channel's gate (into ``gate``) and ``out[i, c] =
    x[i, c] · gate[i, c]`` (``out`` may be ``x`` itself). ``kind``/``a``/``c``: each activation's
    `compiled.epilogue` code and parameters."""
    n, c, hw = x.shape
    r = b1.shape[0]
    chunks = partials.shape[1]
    h = hidden[:r]
    in_place = out.ctypes.data == x.ctypes.data
    for i in range(n):
        for j in range(r):
            h[_U(j)] = partials[i, 0, j]
        for k in range(1, chunks):
            part = partials[i, k, :r]
            for j in range(r):
                h[_U(j)] += part[_U(j)]
        for j in range(r):
            h[_U(j)] += b1[_U(j)]
        _apply_run(h, _NEGATIVE_ZERO, kind1, np.float32(a1), np.float32(c1))
        g = gate[i, ch0:ch1]
        bias = b2[ch0:ch1]
        for q in range(g.size):
            g[_U(q)] = bias[_U(q)]
        _add_rows(g, w2t, ch0, h, 0, r)
        _apply_run(g, _NEGATIVE_ZERO, kind2, np.float32(a2), np.float32(c2))
        _scale_planes(x[i], g, out[i], ch0, in_place)


@kernel
def _scale_planes(x: np.ndarray, factors: np.ndarray, out: np.ndarray, ch0: int, in_place: bool) -> None:
    """``out[c] = x[c] · factors[c - ch0]`` for the ``factors.size`` planes of ``x`` (C, HW) from
    ``ch0`` (``out`` may be ``x``). A function of its own: inlined into `excite_range`, LLVM
    compiled these loops three times slower (576 planes of 49 values: 8.5 against 3.3 µs)."""
    hw = x.shape[1]
    for ch in range(ch0, ch0 + factors.size):
        factor = factors[ch - ch0]
        scaled = out[ch]
        if in_place:  # (one array read and written: a loop over two that may overlap runs scalar)
            for p in range(hw):
                scaled[_U(p)] = scaled[_U(p)] * factor
        else:
            plane = x[ch]
            for p in range(hw):
                scaled[_U(p)] = plane[_U(p)] * factor


@numba.njit(inline="always")
def _run_phase(phase: int, x: np.ndarray, w1t: np.ndarray, b1: np.ndarray, w2t: np.ndarray, b2: np.ndarray,
               acts: np.ndarray, numbers: np.ndarray, scratch: np.ndarray, out: np.ndarray, threads: int,
               thread: int, k0: int, k1: int) -> None:
    """Phase ``phase`` for chunks ``k0:k1`` (phase two: their channels) as thread ``thread`` of
    ``threads`` (its hidden vector in ``scratch``), ``x`` and ``out`` (N, C, H, W)."""
    n, c = x.shape[0], x.shape[1]
    planes = x.reshape((n, c, x.shape[2] * x.shape[3]))
    partials, gate, hidden = _carve(scratch, n, c, b1.shape[0], threads)
    if phase == SQUEEZE:
        squeeze_range(planes, w1t, partials, k0, k1)
    else:
        excite_range(planes, partials, b1, w2t, b2, acts[0], numbers[0], numbers[1], acts[1], numbers[2], numbers[3],
                     hidden[thread], gate, out.reshape(planes.shape), k0 * CHUNK, min(k1 * CHUNK, c))


@kernel
def squeeze_excite(x: np.ndarray, w1t: np.ndarray, b1: np.ndarray, w2t: np.ndarray, b2: np.ndarray,
                   acts: np.ndarray, numbers: np.ndarray, scratch: np.ndarray, out: np.ndarray) -> None:
    """Both phases over every channel on this thread: ``out = x · act2(W2 · act1(W1 · mean(x) +
    b1) + b2)`` per image and channel, ``x`` and ``out`` (N, C, H, W) float32 C-contiguous
    (``out`` may be ``x``), ``w1t`` (C, R) and ``w2t`` (R, C) the products' weights transposed,
    ``b1`` (R,) and ``b2`` (C,) their biases, ``acts`` the two activations' `compiled.epilogue`
    codes and ``numbers`` their float64 parameters (a1, c1, a2, c2), ``scratch`` at least
    `scratch_floats` values for one thread."""
    chunks = -(-x.shape[1] // CHUNK)
    _run_phase(SQUEEZE, x, w1t, b1, w2t, b2, acts, numbers, scratch, out, 1, 0, 0, chunks)
    _run_phase(EXCITE, x, w1t, b1, w2t, b2, acts, numbers, scratch, out, 1, 0, 0, chunks)


@kernel
def post_squeeze_excite(control: np.ndarray, phase: int, x: np.ndarray, w1t: np.ndarray, b1: np.ndarray,
                        w2t: np.ndarray, b2: np.ndarray, acts: np.ndarray, numbers: np.ndarray, scratch: np.ndarray,
                        out: np.ndarray, cuts: np.ndarray) -> int:
    """Post phase ``phase`` of chunks ``cuts[i + 1]:cuts[i + 2]`` to helper ``i`` of a claimed
    team's ``control``, for `squeeze_excite_part` to run (the operands as `squeeze_excite` takes
    them, ``scratch`` for ``len(cuts) - 1`` threads); the number of those helpers found asleep
    (the caller wakes them)."""
    sleeping = 0
    for i in range(cuts.shape[0] - 2):
        row = control[i]
        row[KIND] = PART_KIND
        at = ARGS
        for d in range(4):
            row[at + d] = x.shape[d]
        row[at + 4], row[at + 5], row[at + 6] = b1.shape[0], phase, cuts.shape[0] - 1
        row[at + 7], row[at + 8], row[at + 9] = i + 1, cuts[i + 1], cuts[i + 2]
        row[at + 10], row[at + 11], row[at + 12] = x.ctypes.data, w1t.ctypes.data, b1.ctypes.data
        row[at + 13], row[at + 14], row[at + 15] = w2t.ctypes.data, b2.ctypes.data, acts.ctypes.data
        row[at + 16], row[at + 17], row[at + 18] = numbers.ctypes.data, scratch.ctypes.data, scratch.size
        row[at + 19] = out.ctypes.data
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel
def finish_squeeze_excite(control: np.ndarray, phase: int, x: np.ndarray, w1t: np.ndarray, b1: np.ndarray,
                          w2t: np.ndarray, b2: np.ndarray, acts: np.ndarray, numbers: np.ndarray,
                          scratch: np.ndarray, out: np.ndarray, cuts: np.ndarray, rounds: int) -> bool:
    """Run phase ``phase`` of chunks ``cuts[0]:cuts[1]`` here, then wait for the parts
    `post_squeeze_excite` posted; False when a helper is not done within ``rounds`` spins (the
    caller then waits the slow way, `SpinTeam.wait`)."""
    _run_phase(phase, x, w1t, b1, w2t, b2, acts, numbers, scratch, out, cuts.shape[0] - 1, 0, cuts[0], cuts[1])
    return wait_all(control, cuts.shape[0] - 2, rounds)


@kernel
def post_and_finish_squeeze_excite(control: np.ndarray, phase: int, x: np.ndarray, w1t: np.ndarray, b1: np.ndarray,
                                   w2t: np.ndarray, b2: np.ndarray, acts: np.ndarray, numbers: np.ndarray,
                                   scratch: np.ndarray, out: np.ndarray, cuts: np.ndarray, rounds: int) -> int:
    """Phases ``phase`` and on, each `post_squeeze_excite` then `finish_squeeze_excite`, while the
    helpers keep up: ``4 · p + status`` for the phase ``p`` that returned ``status``
    (`spin_team.HELPERS_ASLEEP`: a helper was asleep, nothing of ``p`` run here yet;
    `PARTS_RUNNING`: a helper not done within ``rounds``), or for the last phase with
    `PARTS_DONE`: the block is done."""
    for p in range(phase, EXCITE + 1):
        if post_squeeze_excite(control, p, x, w1t, b1, w2t, b2, acts, numbers, scratch, out, cuts):
            return 4 * p + HELPERS_ASLEEP
        if not finish_squeeze_excite(control, p, x, w1t, b1, w2t, b2, acts, numbers, scratch, out, cuts, rounds):
            return 4 * p + PARTS_RUNNING
    return 4 * EXCITE + PARTS_DONE


@numba.njit(inline="always")
def squeeze_excite_part(control: np.ndarray) -> None:
    """Run the phase posted in a spin team's ``control`` row (`post_squeeze_excite`): the helper's
    side (a `team_parts` runner)."""
    at = ARGS
    n, c, h, w, r = control[at], control[at + 1], control[at + 2], control[at + 3], control[at + 4]
    x = numba.carray(address_as_pointer(control[at + 10], np.float32), (n, c, h, w))
    w1t = numba.carray(address_as_pointer(control[at + 11], np.float32), (c, r))
    b1 = numba.carray(address_as_pointer(control[at + 12], np.float32), (r,))
    w2t = numba.carray(address_as_pointer(control[at + 13], np.float32), (r, c))
    b2 = numba.carray(address_as_pointer(control[at + 14], np.float32), (c,))
    acts = numba.carray(address_as_pointer(control[at + 15], np.int64), (2,))
    numbers = numba.carray(address_as_pointer(control[at + 16], np.float64), (4,))
    scratch = numba.carray(address_as_pointer(control[at + 17], np.float32), (control[at + 18],))
    out = numba.carray(address_as_pointer(control[at + 19], np.float32), (n, c, h, w))
    _run_phase(control[at + 5], x, w1t, b1, w2t, b2, acts, numbers, scratch, out, control[at + 6], control[at + 7],
               control[at + 8], control[at + 9])
