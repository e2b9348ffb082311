"""A ResidualConv whose 1x1 conv runs on `compiled.pointwise` adds its residual in the conv's
stores (`ops/residual_conv.py`): the very bits of the Conv and Add layers unfused, and the
definition's values, on every path of both kernels' stores (`small_map_conv`: whole and partial
panels of channels, blocks of 14 and 8 positions with the last overlapping, fewer than 8, bands
of a large input; `pointwise_conv`: whole panels of positions and a partial one through the
tail, blocks of channels, blocks of depth), alone and shared with a spinning helper; and written
over the residual itself where the runtime gives it up (`runtime.plan.Plan._plan_donations`)."""
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


def _watch_run_pointwise(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """Each `run_pointwise` call of the ResidualConv layers from now on: (a residual given, the
    result written over it)."""
    calls = []
    run = residual_conv.run_pointwise

    def watched(plan, x, residual=None, over_residual=False):
        calls.append((residual is not None, over_residual))
        return run(plan, x, residual, over_residual)

    monkeypatch.setattr(residual_conv, "run_pointwise", watched)
    return calls


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
    (64, 64, 7, 7),      # whole panels, 49 positions: blocks of 14 (AVX-512) or 8, the last overlapping or of 1
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
    calls = _watch_run_pointwise(monkeypatch)
    feeds = {"x": RNG.standard_normal((1, cin, height, width)).astype(np.float32),
             "r": RNG.standard_normal((1, cout, height, width)).astype(np.float32)}
    feeds["r"].flat[::17] = np.nan  # (a NaN passes the Relu, as the Add's)
    with ai.Worker(model, "cpu", threads=threads) as worker, \
            ai.Worker(ai.load_model(proto, optimize=False), "cpu", threads=threads) as layers:
        for _ in range(2):  # (the second run: the plan as kept)
            got = worker.run_blocking(feeds)["y"]
            np.testing.assert_array_equal(got.view(np.uint32), layers.run_blocking(feeds)["y"].view(np.uint32))
    assert calls and all(given for given, _ in calls)
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cin, cout, height, width, activation", [
    (64, 64, 7, 7, "LeakyRelu"),     # an activation the stores lack
    (512, 64, 40, 40, "Relu")])      # a map over RESIDUAL_MAX_POSITIONS
def test_other_cases_add_after_the_conv(cin, cout, height, width, activation, monkeypatch):
    """The conv, then the Add's own pass (no residual in the stores): the definition's values."""
    proto = _model(cin, cout, height, width, activation)
    calls = _watch_run_pointwise(monkeypatch)
    feeds = {"x": RNG.standard_normal((1, cin, height, width)).astype(np.float32),
             "r": RNG.standard_normal((1, cout, height, width)).astype(np.float32)}
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    assert not calls
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


# -- the residual given up: the result written over it ----------------------------------------------
def _block_model(channels: int, height: int, width: int, *, extra_reader: bool = False,
                 residual_output: bool = False) -> onnx.ModelProto:
    """x → Conv 1x1 (c1) → Conv 1x1 (c2) → Conv 1x1 (c3) → Relu(Add(c3, c1)) → y: a residual block
    whose shortcut c1 is read by the block's first conv (an ancestor of the Add) and the Add.
    ``extra_reader``: c1 is read after the Add too (z = y + c1, an output); ``residual_output``:
    c1 is an output."""
    def weight(name: str) -> onnx.TensorProto:
        value = RNG.standard_normal((channels, channels, 1, 1)) / np.sqrt(channels)
        return numpy_helper.from_array(value.astype(np.float32), name)
    consts = [weight("w1"), weight("w2"), weight("w3"),
              numpy_helper.from_array(RNG.standard_normal(channels).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b"], ["c1"], kernel_shape=[1, 1]),
             helper.make_node("Conv", ["c1", "w2", "b"], ["c2"], kernel_shape=[1, 1]),
             helper.make_node("Conv", ["c2", "w3", "b"], ["c3"], kernel_shape=[1, 1]),
             helper.make_node("Add", ["c3", "c1"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    outputs = [tensor_info("y", None)]
    if extra_reader:
        nodes.append(helper.make_node("Add", ["y", "c1"], ["z"]))
        outputs.append(tensor_info("z", None))
    if residual_output:
        outputs.append(tensor_info("c1", None))
    return make_model(nodes, [tensor_info("x", [1, channels, height, width])], outputs, consts)


def _residual_step(worker: ai.Worker, outputs: list[str] | None = None):
    """The plan's step of the block's ResidualConv (the plan of runs asking for ``outputs``)."""
    plan = worker._plan if outputs is None else worker._plans.get(outputs)
    (node,) = [node for node in plan.nodes if node.layer.op_type == "ResidualConv"]
    return node


@pytest.mark.parametrize("channels, height, width, over", [
    (64, 7, 7, True),      # 49 positions: 4 blocks of 14, the last (overlapping) through a block of its own
    (64, 5, 10, True),     # 50: the same, 8 of its positions stored
    (64, 4, 11, True),     # 44: 3 blocks of 14 and a block of 2 (blocks of 8: 5 and an overlapping one)
    (96, 13, 13, True),    # 169: 12 blocks of 14, the last of 1; 3 whole panels of 32 channels
    (64, 3, 4, True),      # 12: blocks of 8 (and the last of 4 stored)
    (64, 56, 56, True),    # 3136 (ResNet-50's first stage): a map of any size over the residual
    (512, 32, 32, True),   # an input over 1 MiB: positions in bands, each band's last block its own
    (40, 28, 28, False)])  # on `pointwise_conv` (blocks of depth): into a map of its own
@pytest.mark.parametrize("threads", [1, 2])
def test_a_dead_residual_is_written_over(channels, height, width, over, threads, monkeypatch):
    """The shortcut's last reader writes the block's result over it (no third map) where its
    kernel can: the bits of the unfused layers."""
    proto = _block_model(channels, height, width)
    calls = _watch_run_pointwise(monkeypatch)
    feeds = {"x": RNG.standard_normal((1, channels, height, width)).astype(np.float32)}
    with ai.Worker(ai.load_model(proto), "cpu", threads=threads) as worker, \
            ai.Worker(ai.load_model(proto, optimize=False), "cpu", threads=threads) as layers:
        assert _residual_step(worker).donated == (3,)
        for _ in range(2):
            got = worker.run_blocking(feeds)["y"]
            np.testing.assert_array_equal(got.view(np.uint32), layers.run_blocking(feeds)["y"].view(np.uint32))
    assert calls == [(True, over)] * 2
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["read after", "an output", "asked for", "a model input"])
def test_a_residual_still_read_is_kept(case):
    """No donation where the residual lives on: read by a later step, returned, asked for by
    ``outputs=``, or the caller's own input array (read in place by ``run_blocking``)."""
    channels, size = 64, 14
    x = RNG.standard_normal((1, channels, size, size)).astype(np.float32)
    if case == "a model input":
        proto = _model(channels, channels, size, size, "Relu")
        feeds = {"x": x, "r": RNG.standard_normal((1, channels, size, size)).astype(np.float32)}
    else:
        proto = _block_model(channels, size, size, extra_reader=case == "read after",
                             residual_output=case == "an output")
        feeds = {"x": x}
    kept = feeds.get("r", np.empty(0)).copy()
    outputs = ["y", "c1"] if case == "asked for" else None
    expected = ReferenceEvaluator(proto).run(outputs, feeds)
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        got = worker.run_blocking(feeds, outputs=outputs)
        assert _residual_step(worker, outputs).donated == ()
        if outputs:  # (the plain runs' plan still gives it up)
            assert _residual_step(worker).donated == (3,)
    for value, want in zip(got.values(), expected):
        np.testing.assert_allclose(value, want, rtol=1e-4, atol=1e-4)
    if case == "a model input":
        np.testing.assert_array_equal(feeds["r"], kept)  # (the caller's array untouched)


def test_a_scheduled_run_writes_over_nothing(monkeypatch):
    """A `schedule()`d run hands its caller the execution, whose layer futures show each layer's
    value until no step reads it (a callback may still be reading it while later layers run):
    it gives nothing up; runs that return only their outputs do."""
    channels, size = 64, 14
    proto = _block_model(channels, size, size)
    feeds = {"x": RNG.standard_normal((1, channels, size, size)).astype(np.float32)}
    calls = _watch_run_pointwise(monkeypatch)
    expected = ReferenceEvaluator(proto).run(None, feeds)[0]
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        assert _residual_step(worker).donated == (3,)
        scheduled = worker.schedule(feeds).read_outputs_blocking()["y"]
        blocking = worker.run_blocking(feeds)["y"]
    assert calls == [(True, False), (True, True)]
    np.testing.assert_array_equal(scheduled, blocking)
    np.testing.assert_allclose(blocking, expected, rtol=1e-4, atol=1e-4)
