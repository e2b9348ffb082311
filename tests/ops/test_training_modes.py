"""Training-mode Dropout and BatchNormalization (asyncinfer/ops/shape.py, normalization.py).

The oracle is the definition as onnx.reference writes it: Dropout's mask is
``RandomState(seed).uniform(0, 1, shape) >= ratio`` with a seed (fresh randomness without one) and
``y = x * mask / (1 - ratio)``; BatchNormalization normalizes with the batch's mean and population
variance and updates the running statistics with ``momentum``. The GPU backends must decline such
layers (they fall back to the CPU, visibly in ``worker.placement``) rather than apply the inference
formula.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from op_testing import one_node
from pixel_testing import require_pixel


def _gpu_compute_on_the_host():
    from asyncinfer.backends.cupy import CuPyBackend, HostRuntime

    return CuPyBackend(HostRuntime())


def run(model, feeds, backend="cpu"):
    """Outputs by name, and the layers that fell back to the CPU."""
    with ai.Worker(ai.load_model(model), backend) as worker:
        return worker.run_blocking(feeds), worker.placement.fallback


def reference(model, feeds):
    return ReferenceEvaluator(model).run(None, feeds)


# -- Dropout ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 4, 5), (7,), (2, 1, 3, 3)])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
@pytest.mark.parametrize("seed", [0, 7, 123456])
def test_seeded_dropout_equals_the_reference(shape, ratio, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    model, feeds = one_node("Dropout", [x, np.float32(ratio), np.bool_(True)], dict(seed=seed), opset=13,
                            outputs=["y", "mask"])
    got, _ = run(model, feeds)
    y, mask = reference(model, feeds)
    np.testing.assert_array_equal(got["mask"], mask)
    np.testing.assert_allclose(got["y"], y, rtol=1e-6)
    assert got["y"].dtype == np.float32 and got["mask"].dtype == np.bool_
    again, _ = run(model, feeds)  # reproducible: the seed fixes the draw
    np.testing.assert_array_equal(again["y"], got["y"])


def test_unseeded_dropout_draws_fresh_masks_with_the_given_ratio():
    x = np.ones((200, 100), np.float32)
    model, feeds = one_node("Dropout", [x, np.float32(0.3), np.bool_(True)], opset=22, outputs=["y", "mask"])
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        first, second = worker.run_blocking(feeds), worker.run_blocking(feeds)
    for out in (first, second):
        # kept elements are scaled by 1 / (1 - ratio), dropped ones are 0
        np.testing.assert_allclose(out["y"], np.where(out["mask"], np.float32(1 / 0.7), 0), rtol=1e-6)
        kept = out["mask"].mean()
        assert 0.66 < kept < 0.74, kept  # 20,000 draws: 0.7 within 8 standard deviations
    assert (first["mask"] != second["mask"]).any()


def test_dropout_inference_and_zero_ratio_are_the_identity():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for ratio, training in ((np.float32(0.5), np.bool_(False)), (np.float32(0.0), np.bool_(True))):
        model, feeds = one_node("Dropout", [x, ratio, training], dict(seed=1), opset=13, outputs=["y", "mask"])
        got, _ = run(model, feeds)
        np.testing.assert_array_equal(got["y"], x)
        assert got["mask"].all()


@pytest.mark.parametrize("ratio", [1.0, -0.5, 1.5])
def test_dropout_ratio_outside_zero_one_is_an_error_and_the_worker_stays_usable(ratio):
    x = np.ones((2, 3), np.float32)
    model, feeds = one_node("Dropout", [x, np.float32(ratio), np.bool_(True)], opset=13)
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        with pytest.raises(ai.ExecutionError, match=r"ratio .* outside \[0, 1\)"):
            worker.run_blocking(feeds)
        ok = dict(feeds, i1=np.float32(0.5), i2=np.bool_(False))
        np.testing.assert_array_equal(worker.run_blocking(ok)["o0"], x)


def test_dropout_in_float16_keeps_its_type():
    x = np.ones((4, 4), np.float16)
    model, feeds = one_node("Dropout", [x, np.float32(0.5), np.bool_(True)], dict(seed=3), opset=13)
    got, _ = run(model, feeds)
    (y,) = reference(model, feeds)
    assert got["o0"].dtype == np.float16
    np.testing.assert_array_equal(got["o0"], y)


def test_gpu_compute_leaves_a_dropout_that_may_train_to_the_cpu():
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    model, feeds = one_node("Dropout", [x, np.float32(0.5), np.bool_(True)], dict(seed=0), opset=13)
    got, fallback = run(model, feeds, _gpu_compute_on_the_host())
    assert fallback  # the training layer is on the CPU…
    np.testing.assert_allclose(got["o0"], reference(model, feeds)[0], rtol=1e-6)  # …and drops elements
    # the same layer without a training_mode input stays on the device (it is the identity there)
    model, feeds = one_node("Dropout", [x], opset=13, outputs=["y", "mask"])
    _, fallback = run(model, feeds, _gpu_compute_on_the_host())
    assert not fallback


def test_gpu_pixel_leaves_a_dropout_that_may_train_to_the_cpu():
    require_pixel()
    x = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    model, feeds = one_node("Dropout", [x, np.float32(0.5), np.bool_(True)], dict(seed=0), opset=13,
                            outputs=["y", "mask"])
    got, fallback = run(model, feeds, "gpu_pixel")
    assert fallback
    y, mask = reference(model, feeds)
    np.testing.assert_array_equal(got["mask"], mask)
    np.testing.assert_allclose(got["y"], y, rtol=1e-6)


# -- BatchNormalization -------------------------------------------------------------------------------
def _bn_inputs(rng, shape, dtype=np.float32):
    c = shape[1]
    return [rng.standard_normal(shape).astype(dtype) * 3 + 1, rng.uniform(0.5, 1.5, c).astype(dtype),
            rng.standard_normal(c).astype(dtype), rng.standard_normal(c).astype(dtype),
            rng.uniform(0.5, 2, c).astype(dtype)]


@pytest.mark.parametrize("opset", [14, 15])
@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4), (4, 2, 3, 5), (1, 3, 2, 2, 2)])
def test_batchnorm_training_equals_the_reference(opset, shape):
    rng = np.random.default_rng(sum(shape))
    inputs = _bn_inputs(rng, shape)
    attrs = dict(training_mode=1, momentum=0.8, epsilon=1e-3)
    model, feeds = one_node("BatchNormalization", inputs, attrs, opset=opset, outputs=["y", "rm", "rv"],
                            constants=(1, 2, 3, 4))
    got, _ = run(model, feeds)
    for name, expected in zip(("y", "rm", "rv"), reference(model, feeds)):
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape, name
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5, err_msg=name)
    # the batch statistics by their definition: y has zero mean and unit variance per channel
    axes = (0,) + tuple(range(2, len(shape)))
    normalized = (got["y"] - inputs[2].reshape((-1,) + (1,) * (len(shape) - 2))) \
        / inputs[1].reshape((-1,) + (1,) * (len(shape) - 2))
    np.testing.assert_allclose(normalized.mean(axis=axes), 0, atol=1e-5)
    variance = inputs[0].astype(np.float64).var(axis=axes)
    np.testing.assert_allclose(normalized.var(axis=axes), variance / (variance + 1e-3), rtol=1e-4)


def test_batchnorm_training_with_only_y_uses_the_batch_statistics():
    rng = np.random.default_rng(4)
    inputs = _bn_inputs(rng, (3, 2, 4))
    model, feeds = one_node("BatchNormalization", inputs, dict(training_mode=1), opset=15, constants=(1, 2, 3, 4))
    got, _ = run(model, feeds)
    np.testing.assert_allclose(got["o0"], reference(model, feeds)[0], rtol=1e-5, atol=1e-5)
    inference, _ = run(one_node("BatchNormalization", inputs, {}, opset=15, constants=(1, 2, 3, 4))[0], feeds)
    assert not np.allclose(got["o0"], inference["o0"])  # not the inference formula


def test_batchnorm_training_in_float16_accumulates_in_float32():
    rng = np.random.default_rng(5)
    inputs = _bn_inputs(rng, (8, 3, 16), np.float16)
    model, feeds = one_node("BatchNormalization", inputs, dict(training_mode=1), opset=15,
                            outputs=["y", "rm", "rv"], constants=(1, 2, 3, 4))
    got, _ = run(model, feeds)
    exact = [np.asarray(v, np.float64) for v in inputs]
    axes = (0, 2)
    mean, var = exact[0].mean(axis=axes), exact[0].var(axis=axes)
    y = (exact[0] - mean[:, None]) / np.sqrt(var[:, None] + 1e-5) * exact[1][:, None] + exact[2][:, None]
    assert got["y"].dtype == np.float16 and got["rm"].dtype == np.float16
    np.testing.assert_allclose(got["y"].astype(np.float64), y, rtol=3e-3, atol=3e-3)
    np.testing.assert_allclose(got["rv"].astype(np.float64), exact[4] * 0.9 + var * 0.1, rtol=2e-3)


@pytest.mark.parametrize("backend", ["gpu_compute", "gpu_pixel"])
def test_gpu_backends_leave_training_batchnorm_to_the_cpu(backend):
    if backend == "gpu_pixel":
        require_pixel()
    target = _gpu_compute_on_the_host() if backend == "gpu_compute" else backend
    rng = np.random.default_rng(6)
    inputs = _bn_inputs(rng, (2, 4, 3, 3))
    model, feeds = one_node("BatchNormalization", inputs, dict(training_mode=1), opset=15, constants=(1, 2, 3, 4))
    got, fallback = run(model, feeds, target)
    assert fallback
    np.testing.assert_allclose(got["o0"], reference(model, feeds)[0], rtol=1e-5, atol=1e-5)
    # inference mode stays on the device
    model, feeds = one_node("BatchNormalization", inputs, {}, opset=15, constants=(1, 2, 3, 4))
    target = _gpu_compute_on_the_host() if backend == "gpu_compute" else backend
    _, fallback = run(model, feeds, target)
    assert not fallback


def test_batchnorm_rank_one_training_is_an_error():
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(3).astype(np.float32)] + _bn_inputs(rng, (2, 3))[1:]
    model, feeds = one_node("BatchNormalization", inputs, dict(training_mode=1), opset=15, constants=(1, 2, 3, 4))
    with ai.Worker(ai.load_model(model), "cpu") as worker, pytest.raises(ai.ExecutionError, match="rank 2"):
        worker.run_blocking(feeds)
