"""End-to-end numerical truth: the ONNX light zoo against its shipped outputs, and several
architectures against ONNX Runtime on random inputs (and random weights)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import asyncinfer as ai
from model_zoo import (LIGHT_MODELS, decoder_net, light_expected, light_input, light_params, light_path, recurrent_net,
                       transformer_block, with_random_weights)

ort = pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the numerical reference")


def _ort_run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _ours(proto_or_path, feeds: dict, optimize: bool = True) -> dict[str, np.ndarray]:
    with ai.Worker(ai.load_model(proto_or_path, optimize=optimize)) as worker:
        return worker.run_blocking(feeds)


@pytest.mark.parametrize("name, rtol, atol", light_params(LIGHT_MODELS))
def test_light_model_matches_shipped_output(name, rtol, atol):
    """Run after run: a worker's first run takes each layer's full way, later ones the short ways
    the first kept (a conv's plan, a shape op's target), and each must give the model's values."""
    proto = onnx.load(light_path(name))
    input_name, x = light_input(proto)
    with ai.Worker(ai.load_model(light_path(name))) as worker:
        for run in ("first", "second", "third"):
            got = list(worker.run_blocking({input_name: x}).values())[0]
            np.testing.assert_allclose(got, light_expected(name), rtol=rtol, atol=atol, err_msg=f"the {run} run")


# Random weights make every kernel matter. Tolerance: float32 through ~50-120 layers, each
# summing up to ~4600 products in a different order than ONNX Runtime does.
RANDOM_LIGHT = ["resnet50", "densenet121", "inception_v2", "squeezenet", "shufflenet", "bvlc_alexnet"]


@pytest.mark.parametrize("name", light_params(RANDOM_LIGHT))
def test_light_model_with_random_weights_matches_onnxruntime(name, rng):
    proto = with_random_weights(onnx.load(light_path(name)), seed=7)
    input_name, x = light_input(proto)
    x = rng.standard_normal(x.shape).astype(np.float32)
    expected = _ort_run(proto, {input_name: x})[0]
    got = list(_ours(proto, {input_name: x}).values())[0]
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-5)


def test_digits_cnn_matches_onnxruntime_and_classifies(digits_samples):
    from asyncinfer import assets

    images, labels = digits_samples
    proto = onnx.load(assets.default_model_path())
    expected = _ort_run(proto, {"image": images})
    got = _ours(proto, {"image": images})
    np.testing.assert_allclose(got["logits"], expected[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got["probabilities"], expected[1], rtol=1e-4, atol=1e-6)
    assert np.mean(np.argmax(got["probabilities"], 1) == labels) >= 0.95


@pytest.mark.parametrize("batch, seq", [(1, 5), (3, 11)])
@pytest.mark.parametrize("optimize", [True, False])
def test_transformer_block_matches_onnxruntime(batch, seq, optimize, rng):
    proto = transformer_block()
    x = rng.standard_normal((batch, seq, 32)).astype(np.float32)
    expected = _ort_run(proto, {"x": x})[0]
    got = _ours(proto, {"x": x}, optimize)["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 4])
def test_recurrent_net_matches_onnxruntime(batch, rng):
    proto = recurrent_net()
    x = rng.standard_normal((7, batch, 5)).astype(np.float32)
    expected = _ort_run(proto, {"x": x})[0]
    np.testing.assert_allclose(_ours(proto, {"x": x})["y"], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2])
def test_decoder_net_matches_onnxruntime(batch, rng):
    proto = decoder_net()
    x = rng.standard_normal((batch, 4, 6, 6)).astype(np.float32)
    expected = _ort_run(proto, {"x": x})[0]
    np.testing.assert_allclose(_ours(proto, {"x": x})["y"], expected, rtol=1e-4, atol=1e-5)
