"""Row-wise LayerNormalization, Softmax and row maxima for float32, one call over all rows (or a
range of them, `row_range`, which the CPU backend's spinning helpers run too: `rows_part`).

As NumPy expressions each is 6-10 whole-array operations, which on the small tensors of a
transformer (a few tokens × a few hundred features) cost 1-2 µs each in call overhead alone, and
on large ones stream the tensor through memory that many times. Here each row is read once for
its statistics (the vectorised reductions of `compiled.rows`) and once to write the result, while
it is in L1. Statistics are rounded to float32, the stash type.
"""
from __future__ import annotations

import numba
import numpy as np

from ...concurrency.spin_team import ARGS, KIND, address_as_pointer, post_and_count_asleep, wait_all
from . import inline, kernel
from .activations import _exp
from .rows import row_max, row_sum, row_sum_squares

#: The kind of spin-team part that is a `row_range`.
ROWS_PART_KIND = 16
#: The row kernels a `row_range` runs: `softmax_rows`, `max_rows`.
SOFTMAX_ROWS, MAX_ROWS = 0, 1


@kernel
def layer_norm_rows(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, has_bias: bool, epsilon: float,
                    y: np.ndarray, mean: np.ndarray, inv_std: np.ndarray) -> None:
    """Each row of ``x`` (R, D) normalised to ``y`` (R, D): ``(x - mean)·inv_std·scale + bias``
    with ``scale``/``bias`` of D values; ``mean`` and ``inv_std`` (R,) receive the statistics."""
    for r in range(x.shape[0]):
        mean[r], inv_std[r] = _normalise_row(x[r], scale, bias, has_bias, epsilon, y[r])


@kernel
def add_layer_norm_rows(a: np.ndarray, b: np.ndarray, scale: np.ndarray, bias: np.ndarray, has_bias: bool,
                        epsilon: float, y: np.ndarray, total: np.ndarray, keep_total: bool) -> None:
    """Each row of ``a + b`` (R, D, float32 additions: an ``Add``'s bits) normalised to ``y`` as
    `layer_norm_rows` normalises it: a residual sum and the LayerNormalization after it in one
    pass. With ``keep_total`` the sums are written to ``total`` (R, D) for its other readers;
    without, they are made in ``y``'s row and normalised there."""
    d = a.shape[1]
    for r in range(a.shape[0]):
        ar, br = a[r], b[r]
        if keep_total:
            row = total[r]
            for i in range(d):
                row[i] = ar[i] + br[i]
            _normalise_row(row, scale, bias, has_bias, epsilon, y[r])
        else:
            out = y[r]
            for i in range(d):
                out[i] = ar[i] + br[i]
            _normalise_row(out, scale, bias, has_bias, epsilon, out)  # (one array: no aliasing guard)


@inline
def _normalise_row(row: np.ndarray, scale: np.ndarray, bias: np.ndarray, has_bias: bool, epsilon: float,
                   out: np.ndarray) -> tuple[np.float32, np.float32]:
    """``out = (row - mean)·inv_std·scale (+ bias)``; (mean, inv_std)."""
    d = row.shape[0]
    m = np.float32(row_sum(row) / d)
    sq = row_sum_squares(row, m)
    inv = np.float32(1.0) / np.sqrt(np.float32(sq / d) + np.float32(epsilon))
    if has_bias:
        for i in range(d):
            out[i] = (row[i] - m) * inv * scale[i] + bias[i]
    else:
        for i in range(d):
            out[i] = (row[i] - m) * inv * scale[i]
    return m, inv


@kernel
def softmax_rows(x: np.ndarray, y: np.ndarray) -> None:
    """Each row of ``x`` (R, D), C-contiguous, → ``y`` (the same shape, C-contiguous, or ``x``
    itself): ``e^(x - max) / Σ e^(x - max)`` (a NaN anywhere in a row makes the whole row NaN
    through the sum; a row of -inf gives NaN, as the definition's 0/0). The values as
    `softmax_row` computes them, in three passes: each row less its maximum, then ``exp`` over
    every value at once, then each row normalised. Row by row, a row's last values short of a
    vector took ``exp`` one at a time, and each row was a call: SSDlite's 3234 rows of 91, one
    core, 280 -> 171 µs."""
    rows, d = x.shape
    for r in range(rows):
        row, out = x[r], y[r]
        top = row_max(row)
        if top == -np.inf:  # every value -inf or NaN: NaN, as e^(x - max) gives
            top = row[0]
        if out.ctypes.data == row.ctypes.data:  # (in place: one array, no aliasing guard; see `_softmax_row`)
            _shift(out, top, out)
        else:
            _shift(row, top, out)
    flat = y.reshape(rows * d)
    for i in range(rows * d):
        flat[i] = _exp(flat[i])
    for r in range(rows):
        _normalise(y[r])


@kernel
def softmax_row(row: np.ndarray, out: np.ndarray) -> None:
    """One row of `softmax_rows` (``out`` may be ``row``)."""
    _softmax_row(row, out)


@inline
def _softmax_row(row: np.ndarray, out: np.ndarray) -> None:
    top = row_max(row)
    if top == -np.inf:  # every value -inf or NaN: NaN, as e^(x - max) gives
        top = row[0]
    if out.ctypes.data == row.ctypes.data:  # in place: one array (``out``: ``row`` may be read-only), so
        _exp_shifted(out, top, out)  # LLVM sees no aliasing to guard against (a guarded loop falls
        _normalise(out)  # back to scalar code: 3.7x slower)
    else:
        _exp_shifted(row, top, out)
        _normalise(out)


@kernel
def max_rows(span: np.ndarray, stride: int, width: int, out: np.ndarray) -> None:
    """``out[r]`` = the largest value of row ``r``, ``span[r·stride:r·stride + width]`` (width ≥ 1;
    rows of a 2-D array, or of a view whose rows are each contiguous, read in place): NaN where
    the row holds one (``np.max``'s answer; `row_max` skips NaN, and a NaN-free row sums to a
    number unless it holds both infinities). NumPy's max over a short last axis ran 190 µs on
    SSDlite's 3234 x 90."""
    for r in range(out.shape[0]):
        row = span[r * stride:r * stride + width]
        top = row_max(row)
        total = row_sum(row)
        if total != total:
            for i in range(row.shape[0]):
                if row[i] != row[i]:
                    top = row[i]
                    break
        out[r] = top


@inline
def _shift(row: np.ndarray, top: float, out: np.ndarray) -> None:
    """``out[i] = row[i] - top``."""
    for i in range(row.shape[0]):
        out[i] = row[i] - top


@inline
def _exp_shifted(row: np.ndarray, top: float, out: np.ndarray) -> None:
    """``out[i] = e^(row[i] - top)``."""
    for i in range(row.shape[0]):
        out[i] = _exp(row[i] - top)


@inline
def _normalise(row: np.ndarray) -> None:
    """``row /= Σ row`` (as a product by the float32 reciprocal)."""
    inv = np.float32(1.0 / row_sum(row))
    for i in range(row.shape[0]):
        row[i] = row[i] * inv


@kernel
def rms_norm_rows(x: np.ndarray, scale: np.ndarray, epsilon: float, y: np.ndarray) -> None:
    """Each row of ``x`` (R, D) → ``y``: ``x / sqrt(mean(x²) + epsilon) · scale`` (``scale`` of D
    values), the root rounded to float32 and divided by, as the definition writes it."""
    rows, d = x.shape
    for r in range(rows):
        row = x[r]
        root = np.sqrt(np.float32(row_sum_squares(row, np.float32(0.0)) / d) + np.float32(epsilon))
        out = y[r]
        for i in range(d):
            out[i] = (row[i] / root) * scale[i]


@kernel
def row_range(op: int, span: np.ndarray, stride: int, width: int, out: np.ndarray, r0: int, r1: int) -> None:
    """Rows ``r0:r1`` of a row kernel, ``op``: `SOFTMAX_ROWS`, ``span`` the rows end to end
    (``stride`` = ``width`` values each) and ``out`` as large (or ``span`` itself); `MAX_ROWS`,
    ``out[r]`` the largest value of ``span[r·stride:r·stride + width]``. Each row as the kernel
    computes it alone: the same bits for any split of the rows."""
    if op == SOFTMAX_ROWS:
        softmax_rows(span[r0 * width:r1 * width].reshape(r1 - r0, width),
                     out[r0 * width:r1 * width].reshape(r1 - r0, width))
    else:
        max_rows(span[r0 * stride:], stride, width, out[r0:r1])


@kernel
def post_rows(control: np.ndarray, op: int, span: np.ndarray, stride: int, width: int, out: np.ndarray,
              cuts: np.ndarray) -> int:
    """Post rows ``cuts[i + 1]:cuts[i + 2]`` to helper ``i`` of a claimed team's ``control``, for
    `rows_part` to run as `row_range`; how many of those helpers were asleep (the caller wakes
    them)."""
    sleeping = 0
    for i in range(cuts.shape[0] - 2):
        row = control[i]
        row[KIND] = ROWS_PART_KIND
        at = ARGS
        row[at], row[at + 1], row[at + 2], row[at + 3] = op, span.size, span.ctypes.data, stride
        row[at + 4], row[at + 5], row[at + 6] = width, out.size, out.ctypes.data
        row[at + 7], row[at + 8] = cuts[i + 1], cuts[i + 2]
        sleeping += post_and_count_asleep(row)
    return sleeping


@kernel
def finish_rows(control: np.ndarray, op: int, span: np.ndarray, stride: int, width: int, out: np.ndarray,
                cuts: np.ndarray, rounds: int) -> bool:
    """Rows ``cuts[0]:cuts[1]`` here, then wait for those `post_rows` posted; False when a helper
    is not done within ``rounds`` spins (the caller then waits the slow way)."""
    row_range(op, span, stride, width, out, cuts[0], cuts[1])
    return wait_all(control, cuts.shape[0] - 2, rounds)


@numba.njit(inline="always")
def rows_part(control: np.ndarray) -> None:
    """Run the `row_range` posted in a spin team's ``control`` row (`post_rows`): the helper's
    side (a `team_parts` runner)."""
    at = ARGS
    span = numba.carray(address_as_pointer(control[at + 2], np.float32), (control[at + 1],))
    out = numba.carray(address_as_pointer(control[at + 6], np.float32), (control[at + 5],))
    row_range(control[at], span, control[at + 3], control[at + 4], out, control[at + 7], control[at + 8])
