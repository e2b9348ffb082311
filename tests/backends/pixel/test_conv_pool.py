"""gpu_pixel convolution, pooling and per-channel normalization kernels against the CPU backend.

Tolerances: a convolution output is a float32 sum of up to a few hundred products accumulated in
another order than the CPU's GEMM, so conv-like results are compared with rtol = atol = 1e-4;
max pools select values exactly (1e-6); averages and normalizations divide or take powers and
square roots on llvmpipe (rtol = atol = 1e-5, 1e-4 for the statistics of InstanceNormalization).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import asyncinfer as ai
from pixel_testing import assert_close, one_node_model, require_pixel, run_both

CONV_TOL = 1e-4
MAX_TOL = 1e-6
MEAN_TOL = 1e-5


def _rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _conv_model(x_shape: tuple, w_shape: tuple, attrs: dict, bias: bool = True, const_weights: bool = True,
                activation: tuple | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Conv (optionally followed by ``activation``) with feeds; weights and bias are
    initializers when ``const_weights``, else graph inputs."""
    x, w = _rand(*x_shape, seed=1), _rand(*w_shape, seed=2)
    b = _rand(w_shape[0], seed=3) if bias else None
    inputs = [x, w] + ([b] if bias else [])
    constants = {k: a for k, a in enumerate(inputs) if k > 0} if const_weights else {}
    model = one_node_model("Conv", inputs, attrs, constants=constants)
    if activation is not None:
        op_type, act_attrs = activation
        graph = model.graph
        graph.node[0].output[0] = "pre"
        graph.node.append(helper.make_node(op_type, ["pre"], ["o0"], **act_attrs))
        del graph.value_info[:]
        model = onnx.shape_inference.infer_shapes(model)
    feeds = {f"i{k}": a for k, a in enumerate(inputs) if k not in constants}
    return model, feeds


# -- Conv ---------------------------------------------------------------------------------------------
CONV_CASES = {
    # name: (x shape, w shape, attributes)
    "1x1": ((1, 6, 5, 7), (5, 6, 1, 1), {}),
    "1x1-strided": ((1, 5, 7, 9), (8, 5, 1, 1), {"strides": [2, 2]}),
    "3x3-c3": ((1, 3, 9, 8), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    "3x3-c5-m6-s2": ((1, 5, 9, 8), (6, 5, 3, 3), {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
    "3x3-c6-m3-valid": ((1, 6, 8, 8), (3, 6, 3, 3), {"auto_pad": "VALID"}),
    "3x3-same-upper-s2": ((1, 5, 8, 7), (6, 5, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    "3x3-same-lower-s2": ((1, 5, 8, 7), (6, 5, 3, 3), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}),
    "3x3-asymmetric-pads": ((1, 4, 7, 6), (5, 4, 3, 3), {"pads": [0, 2, 1, 0]}),
    "3x3-dilated": ((1, 5, 11, 10), (6, 5, 3, 3), {"dilations": [2, 3], "pads": [2, 1, 2, 1]}),
    "3x2-strided-hw": ((1, 6, 9, 10), (7, 6, 3, 2), {"strides": [1, 3], "pads": [1, 0, 1, 1]}),
    "5x5": ((1, 6, 10, 9), (8, 6, 5, 5), {"pads": [2, 2, 2, 2]}),
    "7x7-stem": ((1, 3, 20, 18), (8, 3, 7, 7), {"pads": [3, 3, 3, 3], "strides": [2, 2]}),
    "batch2": ((2, 5, 6, 7), (6, 5, 3, 3), {"pads": [1, 1, 1, 1]}),
    "deep": ((1, 64, 6, 5), (36, 64, 3, 3), {"pads": [1, 1, 1, 1]}),
    "depthwise": ((1, 6, 8, 7), (6, 1, 3, 3), {"group": 6, "pads": [1, 1, 1, 1]}),
    "depthwise-s2-dilated": ((2, 10, 9, 9), (10, 1, 3, 3), {"group": 10, "strides": [2, 2], "dilations": [2, 2]}),
    "depthwise-multiplier": ((1, 3, 7, 6), (6, 1, 3, 3), {"group": 3, "pads": [1, 1, 1, 1]}),
    "grouped-aligned": ((1, 8, 6, 7), (16, 4, 3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    "grouped-unaligned": ((1, 6, 6, 7), (4, 3, 3, 3), {"group": 2, "pads": [0, 1, 1, 0]}),
    "grouped-3": ((1, 9, 5, 6), (12, 3, 1, 1), {"group": 3}),
    "1d": ((1, 5, 17), (6, 5, 3), {"pads": [1, 1]}),
    "1d-strided-dilated": ((2, 3, 20), (4, 3, 5), {"strides": [2], "dilations": [2], "auto_pad": "SAME_UPPER"}),
    "1d-depthwise": ((1, 6, 12), (6, 1, 3), {"group": 6, "pads": [1, 1]}),
    "3d": ((1, 3, 5, 6, 4), (5, 3, 3, 3, 3), {"pads": [1, 0, 1, 1, 1, 0], "strides": [1, 2, 1]}),
    # 3x3 stride-1 convs with >= 8 input channels take the Winograd path
    "winograd-odd": ((2, 8, 7, 9), (5, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
    "winograd-valid": ((1, 12, 6, 8), (8, 12, 3, 3), {}),
    "winograd-asymmetric": ((1, 9, 5, 6), (6, 9, 3, 3), {"pads": [0, 2, 1, 0]}),
    "winograd-same-lower": ((1, 8, 6, 5), (7, 8, 3, 3), {"auto_pad": "SAME_LOWER"}),
    "winograd-1x1-map": ((1, 16, 1, 1), (8, 16, 3, 3), {"pads": [1, 1, 1, 1]}),
}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv(case: str, bias: bool) -> None:
    x_shape, w_shape, attrs = CONV_CASES[case]
    model, feeds = _conv_model(x_shape, w_shape, attrs, bias=bias)
    got, expected, _ = run_both(model, feeds)
    assert_close(got, expected, CONV_TOL, CONV_TOL)


def test_winograd_cases_are_eligible() -> None:
    """The winograd-* cases above really take that path (and a strided 3x3 does not)."""
    from asyncinfer.backends.pixel.kernels.conv import winograd_eligible
    from asyncinfer.ops.conv import Conv as CpuConv

    for name, (_, w_shape, attrs) in CONV_CASES.items():
        model, _ = _conv_model(CONV_CASES[name][0], w_shape, attrs)
        loaded = ai.load_model(model.SerializeToString())
        eligible = winograd_eligible(CpuConv(loaded.layers[0]), w_shape, attrs.get("group", 1))
        assert eligible == name.startswith("winograd") or name == "deep", name


@pytest.mark.parametrize("case", ["3x3-c5-m6-s2", "depthwise", "grouped-unaligned", "1d", "winograd-odd"])
def test_conv_with_runtime_weights(case: str) -> None:
    """Weights and bias fed as inputs are packed by a draw at run time instead of at load time."""
    x_shape, w_shape, attrs = CONV_CASES[case]
    model, feeds = _conv_model(x_shape, w_shape, attrs, const_weights=False)
    assert len(feeds) == 3
    got, expected, _ = run_both(model, feeds)
    assert_close(got, expected, CONV_TOL, CONV_TOL)


@pytest.mark.parametrize("channels", [5, 8], ids=["direct", "winograd"])
@pytest.mark.parametrize("activation", [("Relu", {}), ("LeakyRelu", {"alpha": 0.2}), ("Sigmoid", {})],
                         ids=lambda a: a[0])
def test_conv_fused_activation(activation, channels: int) -> None:  # type: ignore[no-untyped-def]
    model, feeds = _conv_model((1, channels, 8, 7), (6, channels, 3, 3), {"pads": [1, 1, 1, 1]}, activation=activation)
    got, expected, worker = run_both(model, feeds)
    assert_close(got, expected, CONV_TOL, CONV_TOL)
    assert [layer.kind for layer in worker.model.layers] == [f"Conv+{activation[0]}"]
    assert set(worker.placement.layers.values()) == {"gpu_pixel"}


def test_conv_chain_with_pools() -> None:
    """A small CNN: Conv+Relu -> MaxPool -> depthwise Conv -> 1x1 Conv -> GlobalAveragePool."""
    rng = np.random.default_rng(4)
    inits = {
        "w1": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
        "b1": rng.standard_normal(8).astype(np.float32),
        "w2": rng.standard_normal((8, 1, 3, 3)).astype(np.float32) * 0.3,
        "w3": rng.standard_normal((6, 8, 1, 1)).astype(np.float32) * 0.3,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"], group=8, pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c2", "w3"], ["c3"]),
        helper.make_node("GlobalAveragePool", ["c3"], ["y"]),
    ]
    x_info = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, (1, 3, 16, 14))
    y_info = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "cnn", [x_info], [y_info],
                              [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    got, expected, _ = run_both(model, {"x": _rand(1, 3, 16, 14)})
    assert_close(got, expected, CONV_TOL, CONV_TOL)


# -- windowed pools -----------------------------------------------------------------------------------
POOL_CASES = {
    "k2s2": ((1, 5, 8, 9), {"kernel_shape": [2, 2], "strides": [2, 2]}),
    "k3s2-pads": ((2, 6, 9, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "k3s2-ceil": ((1, 3, 10, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    "k3s2-ceil-pads": ((1, 5, 10, 9),
                       {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1}),
    "k3s1-same-upper": ((1, 6, 7, 8), {"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER"}),
    "k2s2-same-lower": ((1, 6, 7, 8), {"kernel_shape": [2, 3], "strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    "dilated": ((1, 5, 10, 11), {"kernel_shape": [2, 3], "dilations": [2, 2], "pads": [1, 1, 1, 1]}),
    "1d": ((2, 5, 13), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    "3d": ((1, 3, 5, 6, 7), {"kernel_shape": [2, 2, 3], "strides": [2, 1, 2], "pads": [0, 1, 1, 1, 0, 1]}),
}


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_max_pool(case: str) -> None:
    shape, attrs = POOL_CASES[case]
    model = one_node_model("MaxPool", [_rand(*shape)], attrs, opset=12)
    got, expected, _ = run_both(model, {"i0": _rand(*shape)})
    assert_close(got, expected, MAX_TOL, MAX_TOL)


@pytest.mark.parametrize("include_pad", [0, 1], ids=["exclude-pad", "include-pad"])
@pytest.mark.parametrize("case", list(POOL_CASES))
def test_average_pool(case: str, include_pad: int) -> None:
    shape, attrs = POOL_CASES[case]
    model = one_node_model("AveragePool", [_rand(*shape)], {**attrs, "count_include_pad": include_pad}, opset=19)
    got, expected, _ = run_both(model, {"i0": _rand(*shape)})
    assert_close(got, expected, MEAN_TOL, MEAN_TOL)


def test_max_pool_with_indices_falls_back() -> None:
    x = _rand(1, 4, 6, 6)
    model = one_node_model("MaxPool", [x], {"kernel_shape": [2, 2], "strides": [2, 2]}, n_outputs=2)
    got, expected, worker = run_both(model, {"i0": x}, expect_on_pixel=False)
    assert worker.placement.fallback
    assert_close(got, expected, MAX_TOL, MAX_TOL)


# -- global pools -------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 6, 5, 7), (1, 3, 40, 33), (1, 5, 600), (1, 4, 3, 4, 5)],
                         ids=["small", "chunked", "1d-chunked", "3d"])
@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
def test_global_pool(op: str, shape: tuple[int, ...]) -> None:
    x = _rand(*shape)
    got, expected, _ = run_both(one_node_model(op, [x]), {"i0": x})
    assert_close(got, expected, MEAN_TOL, MEAN_TOL if op == "GlobalAveragePool" else MAX_TOL)


# -- normalization ------------------------------------------------------------------------------------
@pytest.mark.parametrize("attrs,channels", [({"size": 5, "alpha": 0.5}, 10), ({"size": 3}, 3),
                                            ({"size": 4, "alpha": 0.3, "beta": 0.5, "bias": 2.0}, 9)],
                         ids=["size5", "size3-c3", "size4-even"])
def test_lrn(attrs: dict, channels: int) -> None:
    x = _rand(2, channels, 5, 4)
    got, expected, _ = run_both(one_node_model("LRN", [x], attrs), {"i0": x})
    assert_close(got, expected, MEAN_TOL, MEAN_TOL)


def _norm_params(channels: int, count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    params = [rng.standard_normal(channels).astype(np.float32) for _ in range(count)]
    if count == 4:  # BatchNormalization's variance
        params[3] = rng.uniform(0.5, 2.0, channels).astype(np.float32)
    return params


@pytest.mark.parametrize("shape", [(2, 6, 4, 5), (2, 5, 7), (3, 6)], ids=["nchw", "ncl", "nc"])
def test_batch_normalization(shape: tuple[int, ...]) -> None:
    x = _rand(*shape)
    params = _norm_params(shape[1], 4)
    model = one_node_model("BatchNormalization", [x, *params], {"epsilon": 1e-3},
                           constants={k + 1: p for k, p in enumerate(params)})
    got, expected, _ = run_both(model, {"i0": x})
    assert_close(got, expected, MEAN_TOL, MEAN_TOL)


def test_batch_normalization_fused_relu() -> None:
    x = _rand(1, 6, 5, 5)
    params = _norm_params(6, 4)
    model = one_node_model("BatchNormalization", [x, *params], constants={k + 1: p for k, p in enumerate(params)})
    model.graph.node[0].output[0] = "pre"
    model.graph.node.append(helper.make_node("Relu", ["pre"], ["o0"]))
    got, expected, worker = run_both(model, {"i0": x})
    assert [layer.kind for layer in worker.model.layers] == ["BatchNormalization+Relu"]
    assert_close(got, expected, MEAN_TOL, MEAN_TOL)


@pytest.mark.parametrize("shape", [(2, 6, 4, 5), (1, 5, 30, 20), (2, 3, 9)], ids=["small", "chunked", "ncl"])
def test_instance_normalization(shape: tuple[int, ...]) -> None:
    x = _rand(*shape) * 3 + 1
    params = _norm_params(shape[1], 2)
    model = one_node_model("InstanceNormalization", [x, *params], {"epsilon": 1e-4},
                           constants={1: params[0], 2: params[1]})
    got, expected, _ = run_both(model, {"i0": x})
    assert_close(got, expected, CONV_TOL, CONV_TOL)


# -- inputs in other layouts --------------------------------------------------------------------------
@pytest.mark.parametrize("w_shape", [(6, 5, 3, 3), (6, 8, 3, 3)], ids=["direct", "winograd"])
def test_conv_reads_inputs_in_other_layouts(w_shape: tuple) -> None:
    """An input blocked on its last axis is copied to the channel-blocked layout first, and a bias
    stored one value per texel is read element by element."""
    require_pixel()
    from asyncinfer import ops
    from asyncinfer.backends.pixel.device import PixelDevice
    from asyncinfer.backends.pixel.kernels.conv import Conv
    from asyncinfer.backends.pixel.layout import Layout, axis_layout
    from asyncinfer.model.ir import Layer

    x, w, b = _rand(2, w_shape[1], 6, 7), _rand(*w_shape, seed=2), _rand(w_shape[0], seed=3)
    layer = Layer(name="conv", op_type="Conv", inputs=["x", "w", "b"], outputs=["y"],
                  attrs={"pads": [1, 1, 1, 1]}, version=17)
    op = ops.create(layer)
    kernel = Conv(layer, op)
    device = PixelDevice()
    try:
        def run() -> object:
            xt = device.upload(x, layout=axis_layout(x.shape, 3))
            bt = device.upload(b, layout=Layout(w_shape[0], 1, 1))
            return kernel.run(device, [xt, kernel.prepare_constant(device, 1, w), bt], None)[0]

        got = device.gl.call(run).download()
    finally:
        device.close()
    np.testing.assert_allclose(got, op.run(x, w, b), rtol=CONV_TOL, atol=CONV_TOL)
