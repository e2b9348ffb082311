"""How the compiled kernels are called (asyncinfer/ops/compiled/__init__.py): never on numba's slow
dispatch, which types a call's arguments in Python (about 80 µs a call, against 1 µs)."""
from __future__ import annotations

import collections

import numpy as np
import pytest
from numba.core import dispatcher

import asyncinfer as ai
from asyncinfer.ops.compiled import kernel, reduction

from .op_testing import one_node, randn


@pytest.mark.parametrize("compile_", [kernel, kernel(contract=False), reduction])
def test_a_kernel_with_default_arguments_is_refused(compile_):
    def scale(x: np.ndarray, factor: float = 2.0) -> None:
        x *= factor

    with pytest.raises(TypeError, match=r"scale has default arguments \['factor'\]"):
        compile_(scale)


@pytest.fixture
def slow_dispatches(monkeypatch):
    """Counts, by kernel, the calls that numba typed on its slow path (`_compile_for_args`)."""
    counts: collections.Counter[str] = collections.Counter()
    slow_path = dispatcher.Dispatcher._compile_for_args

    def counting(self, *args, **kwargs):
        counts[self.py_func.__qualname__] += 1
        return slow_path(self, *args, **kwargs)

    monkeypatch.setattr(dispatcher.Dispatcher, "_compile_for_args", counting)
    return counts


# depthwise convs on each loop (channels last in 16-channel blocks, flat, stride-2 rows), a 3x3
# conv on the direct panels, a stem, a 1x1 one, and pools: each run again must call its kernels
# on the fast path (a default argument left out sent each block of a depthwise conv to the slow one)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("op_type,shape,weights,attrs", [
    ("Conv", (1, 72, 28, 28), (72, 1, 3, 3), {"group": 72, "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ("Conv", (1, 48, 7, 7), (48, 1, 5, 5), {"group": 48, "pads": [2, 2, 2, 2]}),
    ("Conv", (1, 32, 40, 40), (32, 1, 3, 3), {"group": 32, "pads": [1, 1, 1, 1]}),
    ("Conv", (1, 16, 160, 160), (16, 1, 3, 3), {"group": 16, "pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ("Conv", (1, 64, 14, 14), (32, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
    ("Conv", (1, 3, 56, 56), (16, 3, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    ("Conv", (1, 64, 14, 14), (128, 64, 1, 1), {}),
    ("MaxPool", (1, 64, 56, 56), None, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("AveragePool", (1, 64, 14, 14), None, {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
])
def test_kernels_run_again_take_the_fast_dispatch(op_type, shape, weights, attrs, threads, rng, slow_dispatches):
    inputs = [randn(rng, *shape)] + ([randn(rng, *weights)] if weights else [])
    proto, feeds = one_node(op_type, inputs, attrs, constants=(1,) if weights else ())
    worker = ai.Worker(ai.load_model(proto), "cpu", threads=threads)
    try:
        worker.warmup_blocking(dict(feeds))  # (a worker's first runs measure its run modes: other paths)
        first = worker.run_blocking(dict(feeds))["o0"]
        slow_dispatches.clear()
        again = worker.run_blocking(dict(feeds))["o0"]
        slow = dict(slow_dispatches)  # (not the helpers' stop: disposal types what it calls first)
    finally:
        worker.dispose()
    np.testing.assert_array_equal(again, first)
    assert not slow, f"kernels typed on numba's slow path: {slow}"
