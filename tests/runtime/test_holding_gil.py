"""`concurrency.holding_gil.copy_array`: the copies an event loop's thread makes per run (a
run's inputs, its outputs), made without letting go of the GIL where that is cheap."""
from __future__ import annotations

import numpy as np
import pytest

from asyncinfer.concurrency import holding_gil
from asyncinfer.concurrency.holding_gil import copy_array


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint16, np.int64, np.bool_, np.complex64,
                                   np.float16])
@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (2, 3, 4)])
def test_a_copy_has_the_values_shape_and_type_and_shares_nothing(dtype, shape, rng):
    source = (rng.standard_normal(shape) * 100).astype(dtype)
    copy = copy_array(source)
    assert copy.shape == source.shape and copy.dtype == source.dtype and copy.flags.c_contiguous
    np.testing.assert_array_equal(copy, source)
    assert not np.shares_memory(copy, source)


def test_what_the_compiled_copy_does_not_take_numpy_copies(rng, monkeypatch):
    """Views out of order, another type, byte-swapped data, strings, empty arrays and copies past
    `HOLD_GIL_MAX_BYTES`: NumPy's copy, C-ordered, of the requested type."""
    taken, compiled = [], holding_gil._copy_bytes
    monkeypatch.setattr(holding_gil, "_copy_bytes", lambda *a: taken.append(a) or compiled(*a))
    x = rng.standard_normal((40, 60)).astype(np.float32)  # (over NUMPY_KEEPS_GIL_ELEMENTS)
    cases = [(x.T, None), (x[:, ::2], None), (x, np.float64), (x.astype(">f4"), np.dtype("<f4")),
             (np.array(["a", "bc"]), None), (np.zeros((0, 3), np.float32), None)]
    for source, dtype in cases:
        copy = copy_array(source, dtype)
        assert copy.flags.c_contiguous and copy.dtype == (source.dtype if dtype is None else dtype)
        np.testing.assert_array_equal(copy, source)
    assert not taken
    monkeypatch.setattr(holding_gil, "HOLD_GIL_MAX_BYTES", x.nbytes - 1)
    np.testing.assert_array_equal(copy_array(x), x)
    assert not taken
    monkeypatch.setattr(holding_gil, "HOLD_GIL_MAX_BYTES", x.nbytes)
    np.testing.assert_array_equal(copy_array(x), x)
    assert len(taken) == 1


def test_a_copy_numpy_makes_holding_the_gil_is_left_to_numpy(rng, monkeypatch):
    """Up to `NUMPY_KEEPS_GIL_ELEMENTS` elements NumPy keeps the GIL itself, and its call is cheaper."""
    taken, compiled = [], holding_gil._copy_bytes
    monkeypatch.setattr(holding_gil, "_copy_bytes", lambda *a: taken.append(a) or compiled(*a))
    limit = holding_gil.NUMPY_KEEPS_GIL_ELEMENTS
    small, large = rng.standard_normal(limit).astype(np.float32), rng.standard_normal(limit + 1).astype(np.float32)
    np.testing.assert_array_equal(copy_array(small), small)
    assert not taken
    np.testing.assert_array_equal(copy_array(large), large)
    assert len(taken) == 1
