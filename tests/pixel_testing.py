"""Helpers for gpu_pixel tests: one shared backend check, and one-node models run on the pixel
backend and on the CPU backend side by side."""
from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from onnx import helper

import asyncinfer as ai
from asyncinfer.errors import BackendUnavailableError


@functools.cache
def pixel_unavailable_reason() -> str | None:
    """None when a gpu_pixel worker can be built here, else why not (the backend's own message)."""
    try:
        from asyncinfer.backends.pixel.device import PixelDevice

        PixelDevice().close()
    except BackendUnavailableError as exc:
        return str(exc)
    return None


def require_pixel() -> None:
    """Skip the calling test, saying why, when there is no EGL/OpenGL 3.3 context here."""
    reason = pixel_unavailable_reason()
    if reason is not None:
        pytest.skip(f"no gpu_pixel backend on this machine: {reason}")


def one_node_model(op_type: str, inputs: list, attrs: dict | None = None, opset: int = 17,
                   n_outputs: int = 1, constants: dict[int, np.ndarray] | None = None) -> onnx.ModelProto:
    """A model of one node; ``inputs`` are example arrays (None: omitted optional input).
    Inputs whose index is in ``constants`` become initializers with that value."""
    constants = constants or {}
    names, infos, inits = [], [], []
    for k, x in enumerate(inputs):
        if x is None and k not in constants:
            names.append("")
            continue
        name = f"i{k}"
        names.append(name)
        if k in constants:
            inits.append(onnx.numpy_helper.from_array(np.asarray(constants[k]), name))
        else:
            infos.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape))
    outs = [f"o{k}" for k in range(n_outputs)]
    node = helper.make_node(op_type, names, outs, **(attrs or {}))
    graph = helper.make_graph([node], "g", infos, [helper.make_empty_tensor_value_info(o) for o in outs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def run_both(model: onnx.ModelProto | bytes, feeds: dict[str, np.ndarray], *, expect_on_pixel: bool = True,
             optimize: bool = True) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], ai.Worker]:
    """Outputs on gpu_pixel and on cpu for ``feeds``; checks every layer ran on gpu_pixel when
    ``expect_on_pixel``. Returns (pixel outputs, cpu outputs, the disposed pixel worker)."""
    require_pixel()
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    loaded = ai.load_model(data, optimize=optimize)
    with ai.Worker(loaded, "cpu", threads=1) as cpu:
        expected = cpu.run_blocking(feeds)
    with ai.Worker(loaded, "gpu_pixel", threads=1) as pixel:
        if expect_on_pixel:
            assert not pixel.placement.fallback, f"fell back to the CPU: {pixel.placement.fallback}"
        got = pixel.run_blocking(feeds)
    return got, expected, pixel


def assert_close(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], rtol: float, atol: float) -> None:
    """Same names, shapes and dtypes; values within ``rtol``/``atol`` (NaN equal to NaN)."""
    assert got.keys() == expected.keys()
    for name in expected:
        g, e = got[name], expected[name]
        assert g.shape == e.shape and g.dtype == e.dtype, (name, g.shape, g.dtype, e.shape, e.dtype)
        if e.dtype.kind == "f":
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, equal_nan=True, err_msg=name)
        else:
            np.testing.assert_array_equal(g, e, err_msg=name)
