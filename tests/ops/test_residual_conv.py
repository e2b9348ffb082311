"""A ResidualConv whose 1x1 conv runs on `compiled.pointwise` adds its residual in the conv's
stores (`ops/residual_conv.py`): the very bits of the Conv and Add layers unfused, and the
definition's values, on every path of both kernels' stores (`small_map_conv`: whole and partial
panels of channels, blocks of 14 and 8 positions with the last overlapping, fewer than 8, bands
of a large input; `pointwise_conv`: whole panels of positions and a partial one through the
tail, blocks of channels, blocks of depth), alone and shared with a spinning helper."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from asyncinfer.ops import residual_conv
from conftest import make_model, tensor_info

RNG = np.random.default_rng(29)


def _model(cin: int, cout: int, height: int, width: int, activation: str | None) -> onnx.ModelProto:
    """x (1, cin, h, w) → Conv 1x1 to ``cout`` with a bias → Add(conv, r) [→ ``activation``] → y."""
    consts = [numpy_helper.from_array((RNG.standard_normal((cout, cin, 1, 1)) / np.sqrt(cin)).astype(np.float32), "w"),
              numpy_helper.from_array(RNG.standard_normal(cout).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[1, 1]),
             helper.make_node("Add", ["c", "r"], ["s" if activation else "y"])]
    if activation:
        nodes.append(helper.make_node(activation, ["s"], ["y"]))
    return make_model(nodes, [tensor_info("x", [1, cin, height, width]), tensor_info("r", [1, cout, height, width])],
                      [tensor_info("y", None)], consts)


@pytest.mark.parametrize("cin, cout, height, width", [
    (64, 64, 7, 7),      # whole panels, 49 positions: blocks of 14 (AVX-512) or 8, the last overlapping
    (512, 40, 14, 14),   # a whole panel and a partial one
    (48, 32, 3, 5),      # 15 positions
    (512, 32, 2, 3),     # 6 positions: fewer than a block, through the scratch block
    (1024, 64, 32, 32),  # an input over 1 MiB: positions in bands
    # `pointwise_conv` (positions in panels): whole panels and a partial one (63 positions), 40
    # channels (blocks of 8: the last of 8, 4... on AVX2), a depth in two blocks (DEPTH 128)
    (88, 24, 28, 28), (240, 40, 7, 9), (200, 48, 14, 14)])
@pytest.mark.parametrize("activation", ["Relu", None])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_residual_is_added_in_the_convs_stores(cin, cout, height, width, activation, threads, monkeypatch):
    proto = _model(cin, cout, height, width, activation)
    model = ai.load_model(proto)
    assert [layer.op_type for layer in model.layers] == ["ResidualConv"]
    stored = []
    run = residual_conv.run_pointwise
    monkeypatch.setattr(residual_conv, "run_pointwise",
                        lambda plan, x, residual=None: stored.append(residual is not None) or run(plan, x, residual))
    feeds = {"x": RNG.standard_normal((1, cin, height, width)).astype(np.float32),
             "r": RNG.standard_normal((1, cout, height, width)).astype(np.float32)}
    feeds["r"].flat[::17] = np.nan  # (a NaN passes the Relu, as the Add's)
    with ai.Worker(model, "cpu", threads=threads) as worker, \
            ai.Worker(ai.load_model(proto, optimize=False), "cpu", threads=threads) as layers:
        for _ in range(2):  # (the second run: the plan as kept)
            got = worker.run_blocking(feeds)["y"]
            np.testing.assert_array_equal(got.view(np.uint32), layers.run_blocking(feeds)["y"].view(np.uint32))
    assert stored and all(stored)
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cin, cout, height, width, activation", [
    (64, 64, 7, 7, "LeakyRelu"),     # an activation the stores lack
    (512, 64, 40, 40, "Relu")])      # a map over RESIDUAL_MAX_POSITIONS
def test_other_cases_add_after_the_conv(cin, cout, height, width, activation, monkeypatch):
    """The conv, then the Add's own pass (no residual in the stores): the definition's values."""
    proto = _model(cin, cout, height, width, activation)
    stored = []
    run = residual_conv.run_pointwise
    monkeypatch.setattr(residual_conv, "run_pointwise",
                        lambda plan, x, residual=None: stored.append(residual) or run(plan, x, residual))
    feeds = {"x": RNG.standard_normal((1, cin, height, width)).astype(np.float32),
             "r": RNG.standard_normal((1, cout, height, width)).astype(np.float32)}
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    assert not stored
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)
