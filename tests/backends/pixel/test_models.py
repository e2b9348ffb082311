"""Whole models on gpu_pixel (Mesa's llvmpipe in CI): the nine light models against their shipped
outputs, run wholly as shaders, and random-weight / random-input comparisons with the CPU backend.

Tolerances: the shipped outputs are checked at onnx's own per-model tolerances (as on the CPU);
against the CPU backend, float32 through up to ~120 layers summing up to ~25000 products each in
another order: rtol 1e-3, atol 1e-4 on softmax outputs and logits alike.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

import asyncinfer as ai
from model_zoo import (LIGHT_MODELS, light_expected, light_input, light_params, light_path, transformer_block,
                       with_random_weights)
from pixel_testing import assert_close, require_pixel


@pytest.fixture(autouse=True)
def _pixel():
    require_pixel()


@pytest.mark.parametrize("name, rtol, atol", light_params(LIGHT_MODELS))
def test_light_model_runs_wholly_as_shaders_and_matches_shipped_output(name, rtol, atol):
    proto = onnx.load(light_path(name))
    input_name, x = light_input(proto)
    with ai.Worker(ai.load_model(light_path(name)), "gpu_pixel") as worker:
        assert not worker.placement.fallback, f"fell back to the CPU: {worker.placement.fallback}"
        assert worker.placement.transfer_steps == [f"upload {input_name} to gpu_pixel"]
        got = list(worker.run_blocking({input_name: x}).values())[0]
    np.testing.assert_allclose(got, light_expected(name), rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["resnet50", "inception_v2", "shufflenet", "squeezenet"])
def test_light_model_with_random_weights_matches_the_cpu_backend(name, rng):
    proto = with_random_weights(onnx.load(light_path(name)), seed=11)
    input_name, x = light_input(proto)
    x = rng.standard_normal(x.shape).astype(np.float32)
    model = ai.load_model(proto)
    with ai.Worker(model, "cpu") as cpu:
        expected = cpu.run_blocking({input_name: x})
    with ai.Worker(model, "gpu_pixel") as pixel:
        assert not pixel.placement.fallback
        got = pixel.run_blocking({input_name: x})
    assert_close(got, expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("batch, seq", [(1, 5), (3, 11)])
def test_transformer_block_matches_the_cpu_backend(batch, seq, rng):
    model = ai.load_model(transformer_block())
    x = rng.standard_normal((batch, seq, 32)).astype(np.float32)
    with ai.Worker(model, "cpu") as cpu:
        expected = cpu.run_blocking({"x": x})
    with ai.Worker(model, "gpu_pixel") as pixel:
        on_cpu = [name for name, backend in pixel.placement.layers.items() if backend == "cpu"]
        shape_layers = {name for name in on_cpu if model_layer(model, name).cpu_bound}
        assert set(pixel.placement.fallback) == shape_layers, "only shape arithmetic may stay on the CPU"
        got = pixel.run_blocking({"x": x})
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


def model_layer(model: ai.Model, name: str):
    return next(layer for layer in model.layers if layer.name == name)


def test_digits_model_on_pixel_classifies_like_the_cpu(digits_model, digits_samples):
    images, labels = digits_samples
    with ai.Worker(digits_model, "cpu") as cpu:
        expected = cpu.run_blocking({"image": images})
    with ai.Worker(digits_model, "gpu_pixel") as pixel:
        assert not pixel.placement.fallback
        got = pixel.run_blocking({"image": images})
    assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert np.mean(np.argmax(got["probabilities"], 1) == labels) >= 0.95
