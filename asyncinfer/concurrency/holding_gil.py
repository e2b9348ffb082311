"""Array copies that keep the GIL: what an event loop's thread copies per run.

NumPy lets go of the GIL while it copies a large array. On an event loop's thread that costs
more than it saves: getting the GIL back waits until the compute threads leave it, and with two
lanes running Python between their kernels it keeps changing hands between them, so the loop's
wait can run to milliseconds (a waiter forces a switch only after a whole switch interval in
which the GIL did not change hands). With 8 tasks awaiting SqueezeNet on 2 cores, a run's input
copy (600 KB) on the loop took p99 2.2-3.1 ms through NumPy and 0.36-0.46 ms here, and the lag
of a 1 ms ticker on that loop went p99 2.96 / 3.30 -> 2.53 / 2.78 ms, max 18.8 / 7.8 -> 6.5 / 6.9,
at the same throughput. Up to `HOLD_GIL_MAX_BYTES` only: a larger copy takes long enough to be
worth letting the other threads run meanwhile.
"""
from __future__ import annotations

import numba
import numpy as np

#: Largest copy made holding the GIL (a few hundred microseconds at memory speed).
HOLD_GIL_MAX_BYTES = 4 << 20
#: Most elements NumPy copies without letting go of the GIL (its threshold for releasing it is a
#: loop of over 500): such a copy goes to NumPy, 0.3 µs where the compiled call takes 1.5-2.
NUMPY_KEEPS_GIL_ELEMENTS = 500
_PLAIN_KINDS = frozenset("biufc")


@numba.njit(cache=True)  # (no ``nogil``: keeping the GIL is the point)
def _copy_bytes(destination: np.ndarray, source: np.ndarray) -> None:
    for i in range(source.shape[0]):
        destination[i] = source[i]


def copy_array(array: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
    """A C-ordered copy of ``array`` as ``dtype`` (default its own): a numeric array already of
    that type, in C order and at most `HOLD_GIL_MAX_BYTES`, is copied without letting go of the
    GIL; anything else by NumPy (which keeps it too for `NUMPY_KEEPS_GIL_ELEMENTS` or fewer)."""
    dtype = array.dtype if dtype is None else np.dtype(dtype)
    if array.size <= NUMPY_KEEPS_GIL_ELEMENTS:
        return np.array(array, dtype=dtype, copy=True, order="C")
    if (array.dtype == dtype and dtype.kind in _PLAIN_KINDS and array.flags.c_contiguous
            and 0 < array.nbytes <= HOLD_GIL_MAX_BYTES):
        copy = np.empty(array.shape, dtype)
        _copy_bytes(copy.reshape(-1).view(np.uint8), array.reshape(-1).view(np.uint8))
        return copy
    return np.array(array, dtype=dtype, copy=True, order="C")
