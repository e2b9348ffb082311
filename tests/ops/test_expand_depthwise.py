"""A 1x1 expansion and the depthwise conv that alone reads it run as one `ExpandDepthwise` layer
(`ops/expand_depthwise.py`, `compiled.expand_depthwise`): the very bits of the two layers and the
definition's values, on every path of the kernel (whole and partial panels of channels, blocks of
14 and 8 positions with the last overlapping, fewer positions than a block, several bands of
rows, strides and windows of the inverted residual blocks, each activation of the epilogue,
batches), alone and shared with a spinning helper (by panels and by bands of rows); cases the
kernel does not take run as the two layers, and the loader leaves the pairs it must not join."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from asyncinfer.loader import optimize
from asyncinfer.ops import expand_depthwise
from asyncinfer.ops.compiled.panels import panel_width
from asyncinfer.ops.epilogue import Epilogue
from conftest import make_model, tensor_info

RNG = np.random.default_rng(55)


def _model(cin: int, mid: int, size: int, kernel: int, stride: int, first: str | None, second: str | None,
           batch: int = 1, expand_stride: int = 1, bias: bool = True) -> onnx.ModelProto:
    """x (batch, cin, size, size) → Conv 1x1 to ``mid`` [→ ``first``] → depthwise ``kernel`` x
    ``kernel`` at ``stride``, padded to keep the map at stride 1 [→ ``second``] → y."""
    consts = [numpy_helper.from_array((RNG.standard_normal((mid, cin, 1, 1)) / np.sqrt(cin)).astype(np.float32), "w1"),
              numpy_helper.from_array((RNG.standard_normal((mid, 1, kernel, kernel)) / kernel).astype(np.float32),
                                      "w2")]
    if bias:
        consts += [numpy_helper.from_array(RNG.standard_normal(mid).astype(np.float32), name) for name in ("b1", "b2")]
    nodes = [helper.make_node("Conv", ["x", "w1"] + (["b1"] if bias else []), ["e"], kernel_shape=[1, 1],
                              strides=[expand_stride] * 2)]
    if "Relu6" in (first, second):  # (a Clip with its bounds as inputs, as exporters write ReLU6)
        consts += [numpy_helper.from_array(np.array(v, np.float32), name) for name, v in (("lo", 0.0), ("hi", 6.0))]

    def activation(op: str, x: str, y: str) -> onnx.NodeProto:
        return helper.make_node("Clip", [x, "lo", "hi"], [y]) if op == "Relu6" else helper.make_node(op, [x], [y])
    last = "e"
    if first:
        nodes.append(activation(first, "e", "ea"))
        last = "ea"
    nodes.append(helper.make_node("Conv", [last, "w2"] + (["b2"] if bias else []), ["d" if second else "y"],
                                  kernel_shape=[kernel] * 2, strides=[stride] * 2, pads=[kernel // 2] * 4, group=mid))
    if second:
        nodes.append(activation(second, "d", "y"))
    return make_model(nodes, [tensor_info("x", [batch, cin, size, size])], [tensor_info("y", None)], consts)


def _unfused(proto: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch) -> ai.Model:
    """The model loaded with every pass but this fusion: the two conv layers as they run alone."""
    with monkeypatch.context() as patch:
        patch.setattr(optimize, "PASSES", [p for p in optimize.PASSES if p[0] != "fuse_expand_depthwise"])
        return ai.load_model(proto)


def _watch(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each fused run from now on: the number of parts of its plan."""
    calls = []
    run = expand_depthwise.run_expand_depthwise

    def watched(plan, x):
        calls.append(len(plan.parts))
        return run(plan, x)

    monkeypatch.setattr(expand_depthwise, "run_expand_depthwise", watched)
    return calls


@pytest.mark.parametrize("cin, mid, size, kernel, stride, first, second, batch", [
    (40, 240, 14, 5, 1, "HardSwish", "HardSwish", 1),   # whole panels, 196 positions: blocks of 14
    (40, 120, 14, 5, 1, "HardSwish", "HardSwish", 1),   # a partial panel (120 = 3·32 + 24)
    (48, 144, 14, 5, 2, "Relu", "Relu", 1),             # a half panel, stride 2 (an odd map: 7x7 out)
    (96, 576, 7, 5, 1, "HardSwish", "HardSwish", 2),    # 49 positions, two images
    (32, 72, 56, 3, 2, None, "Relu", 1),                # a map of several bands of rows
    (64, 48, 2, 3, 1, "Sigmoid", None, 1),              # 4 positions: fewer than a block
    (80, 96, 10, 3, 1, "LeakyRelu", "Clip", 1),         # 100 positions: the last block overlapping
    (32, 64, 11, 7, 2, "HardSigmoid", "HardSwish", 3),  # a 7x7 window, odd map, three images
    (40, 120, 14, 3, 2, "Relu6", "Relu6", 1)])          # ReLU6: the 1x1's Clip bounds are the layer's inputs
@pytest.mark.parametrize("threads", [1, 2])
def test_the_two_convs_run_fused_with_their_bits(cin, mid, size, kernel, stride, first, second, batch, threads,
                                                 monkeypatch):
    proto = _model(cin, mid, size, kernel, stride, first, second, batch)
    model = ai.load_model(proto)
    assert [layer.op_type for layer in model.layers] == ["ExpandDepthwise"]
    unfused = _unfused(proto, monkeypatch)
    assert [layer.op_type for layer in unfused.layers] == ["Conv", "Conv"]
    calls = _watch(monkeypatch)
    feeds = {"x": RNG.standard_normal((batch, cin, size, size)).astype(np.float32)}
    with ai.Worker(model, "cpu", threads=threads) as worker, ai.Worker(unfused, "cpu", threads=threads) as layers:
        for _ in range(2):  # (the second run: the plan as kept)
            got = worker.run_blocking(feeds)["y"]
            np.testing.assert_array_equal(got.view(np.uint32), layers.run_blocking(feeds)["y"].view(np.uint32))
    # a part for this thread and one for the spinning helper where the layer is large enough to share
    assert calls == [threads if batch * mid * cin * size * size >= expand_depthwise.TEAM_MIN_MACS else 1] * 2
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mid, size, stride", [
    (256, 14, 1),   # 8 panels: four a part
    (96, 28, 2),    # 3 panels: two bands of output rows instead
    (160, 28, 1)])  # 5 panels: 3 against 2, or bands of rows (the smaller largest share)
def test_a_layer_is_shared_by_panels_or_by_rows(mid, size, stride, monkeypatch):
    plan = expand_depthwise.expand_depthwise_plan(
        (1, 64, size, size), np.zeros((mid, 64, 1, 1), np.float32), None, np.zeros((mid, 1, 3, 3), np.float32), None,
        (stride, stride), (1, 1), (1, 1), (-(-size // stride),) * 2, Epilogue(), Epilogue(), sharers=2)
    assert plan.team and len(plan.parts) == 2
    panels = -(-mid // panel_width(np.float32))
    (a, b) = plan.parts.tolist()
    if panels % 2 == 0:
        assert a == [0, 1, 0, panels // 2, 0, plan.y_shape[2]] and b[2:4] == [panels // 2, panels]
    else:  # an odd count of panels: rows, each part reading a little more than half the input rows
        assert a[2:4] == b[2:4] == [0, panels] and a[5] == b[4] and 0 < a[5] < plan.y_shape[2]
    # (and the parts cover every output: the layer's result as the two layers', shared or not)
    proto = _model(64, mid, size, 3, stride, "Relu", "Relu")
    feeds = {"x": RNG.standard_normal((1, 64, size, size)).astype(np.float32)}
    with ai.Worker(ai.load_model(proto), "cpu", threads=2) as worker, \
            ai.Worker(_unfused(proto, monkeypatch), "cpu", threads=2) as layers:
        np.testing.assert_array_equal(worker.run_blocking(feeds)["y"], layers.run_blocking(feeds)["y"])


def test_cases_the_kernel_does_not_take_run_as_the_two_layers(monkeypatch):
    proto = _model(32, 64, 9, 3, 1, "Relu", None, expand_stride=2)  # a strided 1x1: joined, not the kernel's
    model = ai.load_model(proto)
    assert [layer.op_type for layer in model.layers] == ["ExpandDepthwise"]
    calls = _watch(monkeypatch)
    feeds = {"x": RNG.standard_normal((1, 32, 9, 9)).astype(np.float32)}
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    assert calls == []
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_the_loader_leaves_pairs_it_must_not_join():
    shallow = _model(16, 64, 8, 5, 1, "Relu", "Relu")  # fewer input channels than MIN_DEPTH
    assert [layer.op_type for layer in ai.load_model(shallow).layers] == ["Conv", "Conv"]
    three_by_one = _model(24, 64, 8, 3, 1, "Relu", "Relu")  # ... than MIN_DEPTH_THREE_BY_ONE for a 3x3
    assert [layer.op_type for layer in ai.load_model(three_by_one).layers] == ["Conv", "Conv"]
    wider = _model(24, 64, 8, 5, 1, "Relu", "Relu")  # (a 5x5 window from MIN_DEPTH on)
    assert [layer.op_type for layer in ai.load_model(wider).layers] == ["ExpandDepthwise"]
    shared = _model(32, 64, 8, 3, 1, "Relu", "Relu")  # the wide map read by another layer too
    shared.graph.output.append(tensor_info("ea", None))
    assert [layer.op_type for layer in ai.load_model(shared).layers] == ["Conv", "Conv"]
    no_bias = _model(32, 64, 8, 3, 1, None, None, bias=False)
    assert [layer.op_type for layer in ai.load_model(no_bias).layers] == ["ExpandDepthwise"]
