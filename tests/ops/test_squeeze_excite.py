"""A squeeze-and-excitation block runs as one `SqueezeExcite` layer (`ops/squeeze_excite.py`,
`compiled.squeeze_excite`): the definition's values, the same bits on one thread, on a spinning
helper and in any split of its chunks of channels, its map scaled in place where the runtime gives
it up, and the layers' own steps where the compiled block does not apply."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from asyncinfer.loader import optimize
from asyncinfer.ops import squeeze_excite
from asyncinfer.ops.compiled import squeeze_excite as compiled
from asyncinfer.ops.compiled.epilogue import SIGMOID, SWISH
from conftest import make_model, tensor_info

RNG = np.random.default_rng(56)

#: (first conv's activation, second's) as exporters write them
STYLES = {"mobilenet": ("Relu", "HardSigmoid"), "efficientnet": ("SiLU", "Sigmoid"),
          "hard_swish": ("HardSwish", "Sigmoid"), "leaky": ("LeakyRelu", "HardSigmoid"),
          "softplus": ("Softplus", "Sigmoid")}


def _model(c: int, r: int, size: int, style: str = "mobilenet", batch: int = 1,
           map_is_output: bool = False) -> onnx.ModelProto:
    """x (batch, c, size, size) → depthwise 3x3 conv f → SE block of ``r`` hidden channels
    (GlobalAveragePool, 1x1 conv + act1, 1x1 conv + act2, Mul by f) → y; with ``map_is_output``
    f is a graph output too (so the SE may not write over it)."""
    first, second = STYLES[style]
    consts = [numpy_helper.from_array((RNG.standard_normal((c, 1, 3, 3)) / 3).astype(np.float32), "wd"),
              numpy_helper.from_array((RNG.standard_normal((r, c, 1, 1)) / np.sqrt(c)).astype(np.float32), "w1"),
              numpy_helper.from_array(RNG.standard_normal(r).astype(np.float32), "b1"),
              numpy_helper.from_array((RNG.standard_normal((c, r, 1, 1)) / np.sqrt(r)).astype(np.float32), "w2"),
              numpy_helper.from_array(RNG.standard_normal(c).astype(np.float32), "b2")]
    nodes = [helper.make_node("Conv", ["x", "wd"], ["f"], group=c, pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["f"], ["p"]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["s1"])]
    if first == "SiLU":
        nodes += [helper.make_node("Sigmoid", ["s1"], ["g1"]), helper.make_node("Mul", ["s1", "g1"], ["a1"])]
    else:
        nodes.append(helper.make_node(first, ["s1"], ["a1"]))
    nodes.append(helper.make_node("Conv", ["a1", "w2", "b2"], ["s2"]))
    nodes.append(helper.make_node(second, ["s2"], ["gate"]))
    nodes.append(helper.make_node("Mul", ["f", "gate"], ["y"]))
    outputs = [tensor_info("y", None)] + ([tensor_info("f", None)] if map_is_output else [])
    return make_model(nodes, [tensor_info("x", [batch, c, size, size])], outputs, consts)


def _unfused(proto: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch) -> ai.Model:
    with monkeypatch.context() as patch:
        patch.setattr(optimize, "PASSES", [p for p in optimize.PASSES if p[0] != "fuse_squeeze_excite"])
        return ai.load_model(proto)


def _watch(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each compiled block run from now on: "alone" or "shared"."""
    calls = []
    alone, shared = squeeze_excite.squeeze_excite, squeeze_excite.post_and_finish_squeeze_excite
    monkeypatch.setattr(squeeze_excite, "squeeze_excite", lambda *a: calls.append("alone") or alone(*a))

    def watched(control, phase, *rest):
        if phase == compiled.SQUEEZE:
            calls.append("shared")
        return shared(control, phase, *rest)

    monkeypatch.setattr(squeeze_excite, "post_and_finish_squeeze_excite", watched)
    return calls


@pytest.mark.parametrize("c, r, size, style, batch", [
    (576, 144, 7, "mobilenet", 1),     # MobileNetV3's last blocks: 36 chunks
    (240, 64, 14, "mobilenet", 1),     # 15 chunks: an odd count to split
    (16, 8, 56, "mobilenet", 1),       # one chunk: never shared
    (40, 10, 9, "efficientnet", 3),    # a short last chunk, three images
    (24, 6, 5, "hard_swish", 2),       # a small block: alone
    (96, 24, 14, "leaky", 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_block_gives_the_definitions_values_and_one_set_of_bits(c, r, size, style, batch, threads, monkeypatch):
    proto = _model(c, r, size, style, batch)
    model = ai.load_model(proto)
    assert [layer.op_type for layer in model.layers] == ["Conv", "SqueezeExcite"]
    feeds = {"x": RNG.standard_normal((batch, c, size, size)).astype(np.float32)}
    calls = _watch(monkeypatch)
    with ai.Worker(model, "cpu", threads=threads) as worker, ai.Worker(model, "cpu", threads=1) as alone:
        got = worker.run_blocking(feeds)["y"]
        again = worker.run_blocking(feeds)["y"]  # (the plan as kept)
        one_thread = alone.run_blocking(feeds)["y"]
    for other in (again, one_thread):  # the same bits however many threads share the block
        np.testing.assert_array_equal(got.view(np.uint32), other.view(np.uint32))
    shared = threads > 1 and c > compiled.CHUNK and batch * c * size * size + 2 * c * r >= squeeze_excite.TEAM_MIN_VALUES
    assert calls[:2] == ["shared" if shared else "alone"] * 2
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    with ai.Worker(_unfused(proto, monkeypatch), "cpu") as layers:
        # the pool's and the activations' bits; the products' sums in another order than the convs'
        np.testing.assert_allclose(got, layers.run_blocking(feeds)["y"], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_any_split_of_the_chunks_gives_the_same_bits(threads):
    """The phases run chunk range by chunk range as the threads of a team would (each phase's
    ranges all done before the next phase): the bits of the block run whole."""
    n, c, r, h = 2, 200, 48, 6
    x = RNG.standard_normal((n, c, h, h)).astype(np.float32)
    x.flat[::97] = 0.0
    w1t, b1 = RNG.standard_normal((c, r)).astype(np.float32), RNG.standard_normal(r).astype(np.float32)
    w2t, b2 = RNG.standard_normal((r, c)).astype(np.float32), RNG.standard_normal(c).astype(np.float32)
    acts, numbers = np.array([SWISH, SIGMOID], np.int64), np.array([1.0, 0.0, 0.0, 0.0])
    chunks = compiled.chunks_of(c)
    whole = np.empty_like(x)
    compiled.squeeze_excite(x, w1t, b1, w2t, b2, acts, numbers,
                            np.empty(compiled.scratch_floats(n, c, r, chunks), np.float32), whole)
    cuts = np.array([chunks * i // threads for i in range(threads + 1)], np.int64)
    scratch = np.empty(compiled.scratch_floats(n, c, r, threads), np.float32)
    split = np.empty_like(x)
    for phase in (compiled.SQUEEZE, compiled.EXCITE):
        for t in range(threads):  # (what thread ``t`` of a team runs, `squeeze_excite_part`)
            compiled._run_phase(phase, x, w1t, b1, w2t, b2, acts, numbers, scratch, split, threads, t, cuts[t],
                                cuts[t + 1])
    np.testing.assert_array_equal(split.view(np.uint32), whole.view(np.uint32))
    pooled = x.astype(np.float64).mean((2, 3))
    hidden = pooled @ w1t + b1
    hidden = hidden / (1 + np.exp(-hidden))
    gate = 1 / (1 + np.exp(-(hidden @ w2t + b2)))
    np.testing.assert_allclose(whole, x * gate[:, :, None, None], rtol=1e-5, atol=1e-5)


def test_the_map_is_scaled_in_place_only_where_nothing_else_reads_it(monkeypatch):
    """Where the SE alone reads the conv's map, the runtime gives it up and the block writes over
    it (no fresh array); where the map is a graph output too, it is left as the conv made it."""
    donated = []
    real = squeeze_excite.SqueezeExcitePlan.run
    monkeypatch.setattr(squeeze_excite.SqueezeExcitePlan, "run",
                        lambda plan, x, in_place: donated.append(in_place) or real(plan, x, in_place))
    feeds = {"x": RNG.standard_normal((1, 96, 14, 14)).astype(np.float32)}
    alone = _model(96, 24, 14)
    with ai.Worker(ai.load_model(alone), "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    assert donated == [True]
    np.testing.assert_allclose(got, ReferenceEvaluator(alone).run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    donated.clear()
    read_elsewhere = _model(96, 24, 14, map_is_output=True)
    with ai.Worker(ai.load_model(read_elsewhere), "cpu") as worker:
        outputs = worker.run_blocking(feeds)
    assert donated == [False]
    want_y, want_f = ReferenceEvaluator(read_elsewhere).run(None, feeds)
    np.testing.assert_allclose(outputs["f"], want_f, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outputs["y"], want_y, rtol=1e-5, atol=1e-5)


def test_activations_the_epilogue_lacks_take_the_layers_steps(monkeypatch):
    """A block whose first activation has no compiled form (Softplus) gives the definition's
    values through the pool, the two products and the Mul, without the compiled block."""
    proto = _model(40, 10, 6, "softplus", batch=2)
    model = ai.load_model(proto)
    assert [layer.op_type for layer in model.layers] == ["Conv", "SqueezeExcite"]
    calls = _watch(monkeypatch)
    feeds = {"x": RNG.standard_normal((2, 40, 6, 6)).astype(np.float32)}
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    assert calls == []
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)
