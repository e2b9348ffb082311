"""Warm-up: one run on made-up (or given) example inputs, on every backend, changing no result;
clear errors when an example cannot be made up; a failed warm-up at construction leaks nothing."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer.runtime.inputs import example_inputs
from conftest import TEST_DOMAIN, make_model, tensor_info
from pixel_testing import require_pixel


@pytest.mark.anyio
async def test_outputs_after_warmup_equal_outputs_without_it(digits_model, digits_samples, any_backend):
    images = digits_samples[0][:3]
    async with ai.Worker(digits_model, any_backend) as cold:
        want = await cold.run(images)
    async with ai.Worker(digits_model, any_backend) as warm:
        with warm.profile() as profile:
            await warm.warmup()  # the model's declared (N, 1, 8, 8): N counts as 1
        assert {r.layer for r in profile.records} >= {l.name for l in digits_model.layers}
        # on cpu it runs on until the worker has chosen serial or parallel runs (runtime/tuning.py)
        assert len(profile.runs) == 1 if any_backend != "cpu" else not warm._run_mode.deciding
        got = await warm.run(images)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value)


def test_warmup_option_on_the_pixel_backend(digits_model, digits_samples):
    require_pixel()
    images = digits_samples[0][:2]
    with ai.Worker(digits_model, "gpu_pixel", warmup=True) as warmed, ai.Worker(digits_model, "gpu_pixel") as cold:
        np.testing.assert_array_equal(warmed.run_blocking(images)["probabilities"],
                                      cold.run_blocking(images)["probabilities"])


def test_example_inputs_follow_declared_types_and_shapes():
    proto = make_model([helper.make_node("Cast", ["ids"], ["y"], to=TensorProto.FLOAT, name="cast")],
                       [tensor_info("ids", ["batch", 7, None], TensorProto.INT64)],
                       [tensor_info("y", ["batch", 7, None])], extra_domains=())
    examples = example_inputs(ai.load_model(proto))
    assert examples["ids"].dtype == np.int64 and examples["ids"].shape == (1, 7, 1) and not examples["ids"].any()


def test_an_input_of_unknown_rank_needs_an_example():
    proto = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], extra_domains=())
    model = ai.load_model(proto)
    with ai.Worker(model) as worker:
        with pytest.raises(ai.InputError, match=r"input 'x' declares no shape.*give example inputs"):
            worker.warmup_blocking()
        worker.warmup_blocking(np.ones((2, 2), np.float32))  # an example is enough
    with pytest.raises(ai.InputError, match="declares no shape"):
        ai.Worker(model, warmup=True)


@pytest.mark.anyio
async def test_examples_given_by_name_are_the_ones_run():
    proto = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], extra_domains=())
    example = np.ones((3, 2), np.float32)  # (its rank is not declared: nothing could be made up)
    async with ai.Worker(ai.load_model(proto)) as worker:
        with worker.profile() as profile:
            await worker.warmup(x=example)
            worker.warmup_blocking(x=example)
    assert {r.output_shapes for r in profile.records} == {((3, 2),)}


def _pool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("asyncinfer-cpu")}


def test_a_failed_warmup_at_construction_disposes_the_worker():
    proto = make_model([helper.make_node("Fail", ["x"], ["y"], domain=TEST_DOMAIN, name="broken")],
                       [tensor_info("x", [2])], [tensor_info("y", [2])])
    model = ai.load_model(proto)
    before = _pool_threads()
    with pytest.raises(ai.ExecutionError, match="broken"):
        ai.Worker(model, warmup=True)
    assert not (_pool_threads() - before), "the failed worker's pool threads are still running"
