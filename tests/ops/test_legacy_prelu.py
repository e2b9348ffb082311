"""PRelu before opset 7 (asyncinfer/ops/pointwise.py ``PRelu6``): the slope is one value or one per
channel (axis 1 of X), as the opset-1/6 schema ("shared across different channels") and the
pytorch-converted models of ONNX's backend test (test_PReLU_*, run in tests/test_onnx_backend.py)
have it, not NumPy-broadcast from the right as from opset 7. gpu_compute leaves such a layer to the
CPU; gpu_pixel runs it with the CPU op's own alignment of the slope."""
from __future__ import annotations

import numpy as np
import pytest

import asyncinfer as ai
from op_testing import one_node
from pixel_testing import require_pixel


def definition(x: np.ndarray, slope: np.ndarray) -> np.ndarray:
    """``slope * x`` where x < 0, the slope taken per channel (axis 1) or as one value (X of rank 1:
    element by element)."""
    if slope.size == 1:
        per_channel = slope.reshape(-1)[0]
    else:
        per_channel = slope if x.ndim < 2 else slope.reshape((1, -1) + (1,) * (x.ndim - 2))
    return np.where(x < 0, x * per_channel, x).astype(x.dtype)


def _case(shape, slope_shape, opset, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    slope = rng.uniform(0.05, 0.5, slope_shape).astype(np.float32)
    return x, slope, one_node("PRelu", [x, slope], opset=opset, constants=(1,))


def _run(model, feeds, backend="cpu"):
    with ai.Worker(ai.load_model(model), backend) as worker:
        return worker.run_blocking(feeds)["o0"], worker.placement.fallback


@pytest.mark.parametrize("opset", [1, 6])
@pytest.mark.parametrize("shape, slope_shape", [
    ((2, 3, 4), (3,)), ((2, 3, 4, 5), (3,)), ((2, 3, 4, 5, 6), (3,)),  # the pytorch-converted cases' shapes
    ((2, 4, 4), (4,)),  # channels equal to the last axis: NumPy broadcasting would pick that one
    ((2, 3, 4), (1,)), ((2, 3), ()), ((5,), (5,)),
])
def test_slope_is_per_channel(opset, shape, slope_shape):
    x, slope, (model, feeds) = _case(shape, slope_shape, opset)
    got, _ = _run(model, feeds)
    np.testing.assert_array_equal(got, definition(x, slope))


def test_a_slope_of_another_shape_must_broadcast():
    x, slope, (model, feeds) = _case((2, 3, 4), (3, 4), 6)
    got, _ = _run(model, feeds)
    np.testing.assert_array_equal(got, np.where(x < 0, x * slope, x))  # trailing axes, as it broadcasts
    x, slope, (model, feeds) = _case((2, 3, 4), (5,), 6)
    with pytest.raises(ai.ExecutionError, match="neither one value, one per channel"):
        _run(model, feeds)


def test_opset_7_still_broadcasts_from_the_right():
    x, slope, (model, feeds) = _case((2, 4, 4), (4,), 7)
    got, _ = _run(model, feeds)
    np.testing.assert_array_equal(got, np.where(x < 0, x * slope, x))


def test_gpu_compute_leaves_old_prelu_to_the_cpu():
    from asyncinfer.backends.cupy import CuPyBackend, HostRuntime

    x, slope, (model, feeds) = _case((2, 4, 4), (4,), 6)
    got, fallback = _run(model, feeds, CuPyBackend(HostRuntime()))
    assert fallback
    np.testing.assert_array_equal(got, definition(x, slope))
    _, fallback = _run(_case((2, 4, 4), (4,), 7)[2][0], feeds, CuPyBackend(HostRuntime()))
    assert not fallback  # opset 7 is the device's


@pytest.mark.parametrize("shape, slope_shape", [((2, 4, 4), (4,)), ((1, 3, 5, 6), (3,)), ((2, 3, 4), (1,))])
def test_gpu_pixel_runs_old_prelu_per_channel(shape, slope_shape):
    require_pixel()
    x, slope, (model, feeds) = _case(shape, slope_shape, 6)
    got, fallback = _run(model, feeds, "gpu_pixel")
    assert not fallback
    np.testing.assert_allclose(got, definition(x, slope), rtol=1e-6)
