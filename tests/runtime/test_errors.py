"""Bad input gets a clear asyncinfer error before anything is scheduled; the worker stays usable."""
from __future__ import annotations

import sys
from types import MappingProxyType

import numpy as np
import pytest
from onnx import helper

import asyncinfer as ai
from conftest import make_model, tensor_info


@pytest.fixture
def two_input_worker():
    nodes = [helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    proto = make_model(nodes, [tensor_info("a", ["N", 3]), tensor_info("b", ["N", 3])], [tensor_info("y", ["N", 3])])
    with ai.Worker(ai.load_model(proto)) as worker:
        yield worker


GOOD = np.ones((2, 3), np.float32)


@pytest.mark.parametrize("args, kwargs, message", [
    ((GOOD,), {}, r"missing input\(s\) \['b'\]"),
    (({"a": GOOD, "b": GOOD, "c": GOOD},), {}, r"unknown input\(s\) \['c'\]"),
    (({"a": GOOD, "c": GOOD},), {}, r"unknown input\(s\) \['c'\]"),  # as many as declared, one wrong
    ((MappingProxyType({"a": GOOD}),), {}, r"missing input\(s\) \['b'\]"),  # a Mapping, not a dict
    ((GOOD, GOOD, GOOD), {}, "3 positional inputs given, the model takes 2"),
    ((GOOD, GOOD.astype(np.float64)), {}, "'b' must be float32, got float64"),
    ((GOOD, np.ones((2, 4), np.float32)), {}, r"'b' must have shape \(N, 3\).*axis 1 is 4"),
    ((GOOD, np.ones(3, np.float32)), {}, "'b' must have rank 2"),
    ((GOOD,), {"a": GOOD}, "given both positionally and by name"),
])
def test_input_errors_before_scheduling(two_input_worker, args, kwargs, message):
    with pytest.raises(ai.InputError, match=message):
        two_input_worker.schedule(*args, **kwargs)
    # nothing was scheduled, and the worker still works
    with pytest.raises(ai.AsyncInferError, match="nothing scheduled"):
        two_input_worker.peek_output()
    np.testing.assert_array_equal(two_input_worker.run_blocking(GOOD, GOOD)["y"], 2 * GOOD)


@pytest.mark.anyio
async def test_async_run_raises_input_error(two_input_worker):
    with pytest.raises(ai.InputError):
        await two_input_worker.run(GOOD)


def test_python_lists_take_the_declared_dtype(two_input_worker):
    out = two_input_worker.run_blocking([[1, 2, 3]], [[1, 1, 1]])
    np.testing.assert_array_equal(out["y"], [[2, 3, 4]])
    assert out["y"].dtype == np.float32


def test_kernel_failure_names_layer_and_op_and_worker_survives():
    # Reshape to an impossible shape only fails at run time (the target comes from an input).
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="bad_reshape")]
    from onnx import TensorProto

    proto = make_model(nodes, [tensor_info("x", [6]), tensor_info("shape", [2], TensorProto.INT64)],
                       [tensor_info("y", None)])
    with ai.Worker(ai.load_model(proto)) as worker:
        worker.schedule(np.arange(6, dtype=np.float32), np.array([4, 4], np.int64))
        with pytest.raises(ai.ExecutionError, match="'bad_reshape' \\(Reshape\\) failed") as info:
            worker.peek_output().readback_and_clone()
        assert info.value.layer == "bad_reshape" and info.value.op_type == "Reshape"
        out = worker.run_blocking(np.arange(6, dtype=np.float32), np.array([2, 3], np.int64))
        assert out["y"].shape == (2, 3)


def test_unavailable_gpu_compute_says_what_is_missing(digits_model):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here: the missing-CuPy message cannot be provoked")
    except ImportError:
        pass
    with pytest.raises(ai.BackendUnavailableError, match="CuPy|CUDA"):
        ai.Worker(digits_model, "gpu_compute")


def test_gpu_pixel_without_moderngl_says_so(digits_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "moderngl", None)  # import moderngl now raises ImportError
    with pytest.raises(ai.BackendUnavailableError, match="moderngl cannot be imported.*asyncinfer\\[pixel\\]"):
        ai.Worker(digits_model, "gpu_pixel")


def test_gpu_pixel_without_egl_says_so(digits_model, monkeypatch):
    moderngl = pytest.importorskip("moderngl", reason="moderngl (the pixel extra) is not installed")

    def no_display(**kwargs):
        raise Exception("eglGetDisplay failed")

    monkeypatch.setattr(moderngl, "create_context", no_display)
    with pytest.raises(ai.BackendUnavailableError, match="EGL display with OpenGL ≥ 3.3.*eglGetDisplay failed.*libegl1"):
        ai.Worker(digits_model, "gpu_pixel")


def test_unknown_backend(digits_model):
    with pytest.raises(ai.BackendUnavailableError, match="unknown backend 'tpu'.*cpu, gpu_compute, gpu_pixel"):
        ai.Worker(digits_model, "tpu")


def test_backend_type_enum_accepted(digits_model):
    with ai.Worker(digits_model, ai.BackendType.CPU) as worker:
        assert worker.backend_type is ai.BackendType.CPU


def test_disposed_worker_refuses_everything(digits_model, digits_samples):
    worker = ai.Worker(digits_model)
    worker.dispose()
    for call in (lambda: worker.schedule(digits_samples[0][:1]), worker.peek_output,
                 lambda: worker.run_blocking(digits_samples[0][:1])):
        with pytest.raises(ai.DisposedError):
            call()


def test_every_error_is_an_asyncinfer_error():
    for cls in (ai.ModelLoadError, ai.UnsupportedOperatorError, ai.InputError, ai.ExecutionError,
                ai.BackendUnavailableError, ai.DisposedError):
        assert issubclass(cls, ai.AsyncInferError)


def test_big_endian_inputs_are_read_by_value(add_chain_model):
    x = np.arange(4, dtype=">f4").reshape(1, 4)  # the same numbers, stored byte-swapped
    with ai.Worker(ai.load_model(add_chain_model(1))) as worker:
        out = worker.run_blocking(x)
    np.testing.assert_array_equal(out["y"], np.arange(4, dtype=np.float32).reshape(1, 4) + 1)
    assert out["y"].dtype.isnative


def test_inputs_over_the_run_limits_are_refused_before_any_work(add_chain_model):
    model = ai.load_model(add_chain_model(1), limits=ai.Limits(max_tensor_elements=3))
    with ai.Worker(model) as worker:
        with pytest.raises(ai.RequestTooLargeError, match="max_tensor_elements") as info:
            worker.run_blocking(np.zeros((1, 4), np.float32))
        assert isinstance(info.value, ai.InputError) and info.value.bound == 3
