"""Element-wise layers with their fused activation in one compiled pass (`compiled.one_pass`).

- `fused_add`: ``act(a + b)``, the CPU ops ``Add`` and ``Sum`` of two float32 maps of one shape
  (a residual connection and its ReLU);
- `fused_affine`: ``act(x · scale[c] + shift[c])``, an inference-mode ``BatchNormalization`` of a
  float32 map (DenseNet's BN + ReLU before each conv), and with a scale per image and channel, a
  squeeze-and-excitation block's gating ``Mul``;
- `activated`: ``act(x)``, a standalone activation layer of a float32 map (ShuffleNet's ReLU after
  a Concat);
- `row_kernel`: a softmax or a maximum over each row (`compiled.normalization.row_range`: a
  detector's scores), rows shared out.

As NumPy passes these were two or three trips through the map, on one thread. Large ones are
shared with the CPU backend's spinning helpers: ranges of the flat arrays, or of channel planes.
Measured in ResNet-50 and DenseNet-121 on the 2-core VM: see docs/benchmarks.md.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..concurrency import parallel, spin_team
from ..concurrency.spin_team import SpinTeam
from .compiled.normalization import ROWS_PART_KIND, finish_rows, post_rows, row_range
from .compiled.one_pass import (ACTIVATE_PART_KIND, ADD_PART_KIND, AFFINE_PART_KIND, activate_range, add_range,
                                affine_rows, finish_activate, finish_add, finish_affine, post_activate, post_add,
                                post_affine)
from .epilogue import Activations, Epilogue

#: From this many values a pass is offered to the spinning helpers (about 10 µs on one core:
#: posting a part costs a few).
TEAM_MIN_VALUES = 1 << 15
#: A part's range starts on a multiple of this many values (whole cache lines: no two threads
#: write the same line).
ALIGN = 16


def fused_add(a: np.ndarray, b: np.ndarray, activations: Activations,
              into: np.ndarray | None = None) -> np.ndarray | None:
    """A fresh ``act(a + b)`` (``activations``: the layer's fused ones), or with ``into`` (``a``
    itself, or another C-contiguous float32 array of its shape) that array holding it; None when
    this is no case for the compiled pass: other than float32, shapes that differ
    (broadcasting), operands not C-contiguous, activations the epilogue lacks, or a plain sum
    into a fresh array too small for the team (NumPy is as fast alone)."""
    if (type(a) is not np.ndarray or type(b) is not np.ndarray or a.dtype != np.float32 or b.dtype != np.float32
            or a.shape != b.shape or not a.flags.c_contiguous or not b.flags.c_contiguous or not a.size):
        return None
    epilogue = Epilogue.of(activations, a.dtype)
    if epilogue is None:
        return None
    n = a.size
    team = parallel.team(ADD_PART_KIND) if n >= TEAM_MIN_VALUES else None
    if team is None and not activations and into is None:
        return None
    out = np.empty(a.shape, np.float32) if into is None else into
    x, y, z = a.reshape(-1), b.reshape(-1), out.reshape(-1)
    kind, av, bv = epilogue.kind, epilogue.a, epilogue.b
    _in_ranges(n, team, ALIGN, lambda control, cuts: post_add(control, x, y, z, cuts, kind, epilogue.numbers),
               lambda control, cuts, rounds: finish_add(control, x, y, z, cuts, kind, av, bv, rounds),
               lambda lo, hi: add_range(x, y, z, lo, hi, kind, av, bv))
    return out


def activated(x: np.ndarray, epilogue: Epilogue | None, in_place: bool = False) -> np.ndarray | None:
    """A fresh ``act(x)`` (``epilogue``: a standalone activation op's, `Epilogue.of` the op alone),
    or with ``in_place`` ``x`` itself holding it (a writeable buffer its caller owns); None when
    this is no case for the compiled pass: other than a C-contiguous float32 array, or an
    activation the epilogue lacks (None)."""
    if (epilogue is None or type(x) is not np.ndarray or x.dtype != np.float32 or not x.flags.c_contiguous
            or not x.size):
        return None
    n = x.size
    out = x if in_place else np.empty(x.shape, np.float32)
    src, dst = x.reshape(-1), out.reshape(-1)
    kind, av, bv = epilogue.kind, epilogue.a, epilogue.b
    if n < TEAM_MIN_VALUES:  # (one range here, no closures: a Relu of 64 values 1.6 -> 1.3 µs)
        activate_range(src, dst, 0, n, kind, av, bv)
        return out
    _in_ranges(n, parallel.team(ACTIVATE_PART_KIND), ALIGN,
               lambda control, cuts: post_activate(control, src, dst, cuts, kind, epilogue.numbers),
               lambda control, cuts, rounds: finish_activate(control, src, dst, cuts, kind, av, bv, rounds),
               lambda lo, hi: activate_range(src, dst, lo, hi, kind, av, bv))
    return out


#: Fewest values a row kernel (`row_kernel`) shares with the spinning helpers: SSDlite's softmax
#: over 3234 rows of 91 scores takes 170 µs on one core.
ROWS_TEAM_MIN_VALUES = 1 << 15


def row_kernel(op: int, span: np.ndarray, stride: int, width: int, out: np.ndarray, rows: int) -> None:
    """`compiled.normalization.row_range` ``op`` over all ``rows`` rows: in ranges of rows shared
    with the spinning helpers from `ROWS_TEAM_MIN_VALUES` values, else here in one call."""
    if rows * width < ROWS_TEAM_MIN_VALUES:
        row_range(op, span, stride, width, out, 0, rows)
        return
    _in_ranges(rows, parallel.team(ROWS_PART_KIND), 1,
               lambda control, cuts: post_rows(control, op, span, stride, width, out, cuts),
               lambda control, cuts, rounds: finish_rows(control, op, span, stride, width, out, cuts, rounds),
               lambda lo, hi: row_range(op, span, stride, width, out, lo, hi))


def _in_ranges(n: int, team: SpinTeam | None, align: int, post: Callable[[np.ndarray, np.ndarray], int],
               finish: Callable[[np.ndarray, np.ndarray, int], bool], own: Callable[[int, int], None]) -> None:
    """Run ``[0, n)``: in ranges (starting on multiples of ``align``) shared with ``team``'s
    helpers when there is a team, it is free and ``n`` makes a range for each (``post(control,
    cuts)`` posts the helpers' ranges, 1 to ``len(cuts) - 2``, from compiled code and says whether
    one was asleep; ``finish(control, cuts, rounds)`` runs range 0 here and waits for theirs,
    False when it gave up spinning); else as ``own(0, n)`` here."""
    count = 1 if team is None else min(team.helpers + 1, n // align)
    control = team.claim() if count > 1 else None  # type: ignore[union-attr]
    if control is None:
        own(0, n)
        return
    try:
        cuts = spin_team.range_cuts(n, count, align)
        if post(control, cuts):
            team.wake()  # type: ignore[union-attr]
        if not finish(control, cuts, spin_team.WAIT_ROUNDS):
            team.wait_posted(count - 1)  # type: ignore[union-attr]
    finally:
        team.release()  # type: ignore[union-attr]


#: Fewest values a channel plane needs for `fused_affine` (a row loop over shorter planes is
#: mostly overhead: NumPy's broadcast does as well).
MIN_PLANE = 16


def fused_affine(x: np.ndarray, scale: np.ndarray, shift: np.ndarray, activations: Activations) -> np.ndarray | None:
    """A fresh ``act(x · scale[c] + shift[c])`` over the channel axis (1) of ``x`` (N, C, ...), or
    with ``scale`` and ``shift`` of N·C values, ``act(x · scale[i·C + c] + shift[i·C + c])`` for
    image ``i``; None when this is no case for the compiled pass: other than float32 (``scale``
    and ``shift`` too, C-contiguous), ``x`` not C-contiguous, planes under `MIN_PLANE` values, or
    activations the epilogue lacks."""
    if (type(x) is not np.ndarray or x.dtype != np.float32 or x.ndim < 3 or not x.flags.c_contiguous or not x.size
            or scale.dtype != np.float32 or shift.dtype != np.float32
            or scale.shape not in ((x.shape[1],), (x.shape[0] * x.shape[1],))
            or shift.shape != scale.shape or not scale.flags.c_contiguous or not shift.flags.c_contiguous):
        return None
    width = x.size // (x.shape[0] * x.shape[1])
    epilogue = Epilogue.of(activations, x.dtype)
    if width < MIN_PLANE or epilogue is None:
        return None
    out = np.empty(x.shape, np.float32)
    rows = x.shape[0] * x.shape[1]
    planes, results = x.reshape(rows, width), out.reshape(rows, width)
    kind, av, bv = epilogue.kind, epilogue.a, epilogue.b
    _in_ranges(rows, parallel.team(AFFINE_PART_KIND) if x.size >= TEAM_MIN_VALUES else None, 1,
               lambda control, cuts: post_affine(control, planes, scale, shift, results, cuts, kind, epilogue.numbers),
               lambda control, cuts, rounds: finish_affine(control, planes, scale, shift, results, cuts, kind, av, bv,
                                                           rounds),
               lambda r0, r1: affine_rows(planes, scale, shift, results, r0, r1, kind, av, bv))
    return out
