"""Subgraph fusions (asyncinfer/loader/patterns.py): each exporter spelling of GELU, LayerNorm,
RMSNorm and SiLU becomes one op, the result still matches onnx.reference on the original graph,
and anything that is not exactly the pattern is left alone."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from asyncinfer.ops import squeeze_excite
from conftest import make_model, tensor_info
from pixel_testing import require_pixel

RNG = np.random.default_rng(7)
C = 16


def _const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _check(proto: onnx.ModelProto, fused_kind: str | None, *, backend: str = "cpu", rtol: float = 2e-5) -> ai.Model:
    """Load ``proto``; the layer kinds include ``fused_kind`` (None: nothing fused); the outputs
    match onnx.reference on the unfused graph."""
    model = ai.load_model(proto)
    kinds = [l.kind for l in model.layers]
    if fused_kind is None:
        assert not any(k.split("+")[-1] in ("Gelu", "LayerNormalization", "RMSNormalization", "Swish")
                       for k in kinds), kinds
    else:
        assert any(fused_kind in k for k in kinds), kinds
    x = (RNG.standard_normal((2, 5, C)) * 2).astype(np.float32)
    expected = ReferenceEvaluator(proto).run(None, {"x": x})[0]
    with ai.Worker(model, backend) as worker:
        got = worker.run_blocking(x)["y"]
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol)
    return model


def _gelu_erf(order: str) -> list[onnx.NodeProto]:
    scale = [helper.make_node("Div", ["x", "sqrt2"], ["d"])] if order != "mul_scale" else \
        [helper.make_node("Mul", ["inv_sqrt2", "x"], ["d"])]
    nodes = scale + [helper.make_node("Erf", ["d"], ["e"]), helper.make_node("Add", ["one", "e"], ["a"])]
    if order in ("torch", "mul_scale"):  # (x · a) · ½
        nodes += [helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Mul", ["m", "half"], ["y"])]
    elif order == "half_first":  # (x · ½) · a
        nodes += [helper.make_node("Mul", ["x", "half"], ["h"]), helper.make_node("Mul", ["h", "a"], ["y"])]
    else:  # (a · ½) · x
        nodes += [helper.make_node("Mul", ["a", "half"], ["m"]), helper.make_node("Mul", ["x", "m"], ["y"])]
    return nodes


GELU_CONSTANTS = [_const("sqrt2", math.sqrt(2)), _const("inv_sqrt2", 1 / math.sqrt(2)), _const("one", 1.0),
                  _const("half", 0.5)]


@pytest.mark.parametrize("order", ["torch", "mul_scale", "half_first", "half_last"])
def test_gelu_erf_spellings_fuse(order):
    proto = make_model(_gelu_erf(order), [tensor_info("x", [2, 5, C])], [tensor_info("y", [2, 5, C])],
                       GELU_CONSTANTS, extra_domains=())
    model = _check(proto, "Gelu")
    assert model.optimizations["fuse_gelu"] == 1
    assert len(model.layers) == 1


def test_gelu_fuses_into_the_matmul_before_it_and_matches_on_gpu_pixel():
    w = _const("w", RNG.standard_normal((C, C)) / 4)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["x1"])] + [
        helper.make_node(n.op_type, [("x1" if i == "x" else i) for i in n.input], list(n.output)) for n in _gelu_erf("torch")]
    proto = make_model(nodes, [tensor_info("x", [2, 5, C])], [tensor_info("y", [2, 5, C])], GELU_CONSTANTS + [w],
                       extra_domains=())
    model = _check(proto, "MatMul+Gelu")
    assert [l.kind for l in model.layers] == ["MatMul+Gelu"]
    _check(proto, "MatMul+Gelu", backend="gpu_pixel", rtol=2e-4)


def test_gelu_tanh_fuses():
    nodes = [helper.make_node("Pow", ["x", "three"], ["x3"]), helper.make_node("Mul", ["x3", "k"], ["kx3"]),
             helper.make_node("Add", ["x", "kx3"], ["s"]), helper.make_node("Mul", ["s", "c"], ["arg"]),
             helper.make_node("Tanh", ["arg"], ["t"]), helper.make_node("Add", ["t", "one"], ["a"]),
             helper.make_node("Mul", ["x", "half"], ["h"]), helper.make_node("Mul", ["h", "a"], ["y"])]
    consts = [_const("three", 3.0), _const("k", 0.044715), _const("c", math.sqrt(2 / math.pi)), _const("one", 1.0),
              _const("half", 0.5)]
    proto = make_model(nodes, [tensor_info("x", [2, 5, C])], [tensor_info("y", [2, 5, C])], consts, extra_domains=())
    model = _check(proto, "Gelu")
    assert model.layers[0].attrs["approximate"] == "tanh"


@pytest.mark.parametrize("change", ["wrong_constant", "shared_intermediate"])
def test_gelu_lookalikes_are_left_alone(change):
    nodes = _gelu_erf("torch")
    consts = list(GELU_CONSTANTS)
    outputs = [tensor_info("y", [2, 5, C])]
    if change == "wrong_constant":
        consts[0] = _const("sqrt2", 1.5)
    else:  # the Erf output is also a graph output: the pattern does not own it
        outputs.append(tensor_info("e", [2, 5, C]))
    proto = make_model(nodes, [tensor_info("x", [2, 5, C])], outputs, consts, extra_domains=())
    _check(proto, None)


def _layer_norm_nodes(square: str = "Pow", affine: bool = True) -> list[onnx.NodeProto]:
    nodes = [helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1], keepdims=1),
             helper.make_node("Sub", ["x", "mean"], ["d"])]
    nodes.append(helper.make_node("Pow", ["d", "two"], ["sq"]) if square == "Pow" else helper.make_node("Mul", ["d", "d"], ["sq"]))
    nodes += [helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1], keepdims=1),
              helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["std"])]
    if affine:
        nodes += [helper.make_node("Div", ["d", "std"], ["n"]), helper.make_node("Mul", ["n", "gamma"], ["g"]),
                  helper.make_node("Add", ["g", "beta"], ["y"])]
    else:
        nodes.append(helper.make_node("Div", ["d", "std"], ["y"]))
    return nodes


LN_CONSTANTS = [_const("two", 2.0), _const("eps", 1e-5), _const("gamma", RNG.uniform(0.5, 1.5, C)),
                _const("beta", RNG.standard_normal(C) / 10)]


@pytest.mark.parametrize("square, affine", [("Pow", True), ("Mul", True), ("Pow", False)])
def test_expanded_layer_norm_fuses(square, affine):
    proto = make_model(_layer_norm_nodes(square, affine), [tensor_info("x", [2, 5, C])], [tensor_info("y", [2, 5, C])],
                       LN_CONSTANTS, extra_domains=())
    model = _check(proto, "LayerNormalization", rtol=1e-4)
    assert len(model.layers) == 1
    _check(proto, "LayerNormalization", backend="gpu_pixel", rtol=2e-4)


def test_layer_norm_over_another_axis_is_left_alone():
    nodes = _layer_norm_nodes()
    nodes[0] = helper.make_node("ReduceMean", ["x"], ["mean"], axes=[1], keepdims=1)
    proto = make_model(nodes, [tensor_info("x", [2, 5, C])], [tensor_info("y", [2, 5, C])], LN_CONSTANTS,
                       extra_domains=())
    # The mean over axis 1 stays; what follows it is an RMSNorm of d over the last axis, and fuses so.
    model = _check(proto, "RMSNormalization", rtol=1e-4)
    assert [l.kind for l in model.layers] == ["ReduceMean", "Sub", "RMSNormalization", "Add"]


@pytest.mark.parametrize("division", ["reciprocal_mul", "one_div_mul", "div"])
def test_rms_norm_fuses(division):
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["ms"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["me"]), helper.make_node("Sqrt", ["me"], ["rms"])]
    if division == "reciprocal_mul":
        nodes += [helper.make_node("Reciprocal", ["rms"], ["inv"]), helper.make_node("Mul", ["x", "inv"], ["n"])]
    elif division == "one_div_mul":
        nodes += [helper.make_node("Div", ["one", "rms"], ["inv"]), helper.make_node("Mul", ["x", "inv"], ["n"])]
    else:
        nodes.append(helper.make_node("Div", ["x", "rms"], ["n"]))
    nodes.append(helper.make_node("Mul", ["gamma", "n"], ["y"]))
    consts = LN_CONSTANTS[:3] + [_const("one", 1.0)]
    proto = make_model(nodes, [tensor_info("x", [2, 5, C])], [tensor_info("y", [2, 5, C])], consts, extra_domains=())
    if not _has("RMSNormalization", 23):
        pytest.skip("the installed onnx has no RMSNormalization (opset 23)")
    model = _check(proto, "RMSNormalization", rtol=1e-4)
    assert len(model.layers) == 1


def _has(op: str, version: int) -> bool:
    try:
        onnx.defs.get_schema(op, version)
        return True
    except onnx.defs.SchemaError:
        return False


def test_silu_fuses_into_the_conv_before_it():
    w = _const("w", RNG.standard_normal((4, 3, 3, 3)) / 3)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Sigmoid", ["c"], ["s"]),
             helper.make_node("Mul", ["c", "s"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [1, 3, 8, 8])], [tensor_info("y", [1, 4, 8, 8])], [w], extra_domains=())
    model = ai.load_model(proto)
    assert [l.kind for l in model.layers] == ["Conv+Swish"]
    x = RNG.standard_normal((1, 3, 8, 8)).astype(np.float32)
    expected = ReferenceEvaluator(proto).run(None, {"x": x})[0]
    for backend in ("cpu", "gpu_pixel"):
        with ai.Worker(model, backend) as worker:
            np.testing.assert_allclose(worker.run_blocking(x)["y"], expected, rtol=2e-4, atol=2e-4)


def test_silu_whose_sigmoid_is_shared_is_left_alone():
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["m"]),
             helper.make_node("Add", ["m", "s"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [2, 5, C])], [tensor_info("y", [2, 5, C])], extra_domains=())
    _check(proto, None)


# -- residual sum and LayerNormalization -------------------------------------------------------
def _add_layer_norm_model(*, sum_read_after: bool = False, addend_shape: tuple[int, ...] = (2, 5, C),
                          with_bias: bool = True, dtype: int = onnx.TensorProto.FLOAT) -> onnx.ModelProto:
    """``y = LayerNormalization(x + r)`` (a block's residual and its norm); with ``sum_read_after``
    the sum is read again after the norm (``y + s``: a pre-norm block's residual stream)."""
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    nodes = [helper.make_node("Add", ["x", "r"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma"] + (["beta"] if with_bias else []),
                              ["n" if sum_read_after else "y"], axis=-1, epsilon=1e-5)]
    if sum_read_after:
        nodes.append(helper.make_node("Add", ["n", "s"], ["y"]))
    consts = [numpy_helper.from_array(RNG.standard_normal(C).astype(np_type), "gamma"),
              numpy_helper.from_array(RNG.standard_normal(C).astype(np_type), "beta")]
    return make_model(nodes, [tensor_info("x", [2, 5, C], dtype), tensor_info("r", list(addend_shape), dtype)],
                      [tensor_info("y", [2, 5, C], dtype)], consts if with_bias else consts[:1], extra_domains=())


@pytest.mark.parametrize("sum_read_after,addend_shape,with_bias,compiled", [
    (False, (2, 5, C), True, True), (True, (2, 5, C), True, True), (False, (2, 5, C), False, True),
    (False, (C,), True, False)])  # an addend that broadcasts: the Add, then the norm
def test_residual_add_and_layer_norm_fuse_and_match_the_layers(sum_read_after, addend_shape, with_bias, compiled,
                                                               monkeypatch):
    """The sum and its normalisation in one pass, with the bits of the two layers (unfused, on the
    same worker kind); a sum read again after the norm is the fused layer's second output."""
    from asyncinfer.ops import normalization
    proto = _add_layer_norm_model(sum_read_after=sum_read_after, addend_shape=addend_shape, with_bias=with_bias)
    model = ai.load_model(proto)
    fused = [l for l in model.layers if l.op_type == "AddLayerNormalization"]
    assert len(fused) == 1 and len(fused[0].outputs) == (2 if sum_read_after else 1)
    feeds = {"x": RNG.standard_normal((2, 5, C)).astype(np.float32) * 3,
             "r": RNG.standard_normal(addend_shape).astype(np.float32)}
    calls: list[int] = []
    kernel = normalization.add_layer_norm_rows
    monkeypatch.setattr(normalization, "add_layer_norm_rows", lambda *args: calls.append(1) or kernel(*args))
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    assert bool(calls) == compiled
    unfused, layers = _load_and_run(proto, feeds, without="fuse_add_layer_norm")
    assert "AddLayerNormalization" not in [l.op_type for l in unfused.layers]
    np.testing.assert_array_equal(got, layers)
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_residual_add_and_layer_norm_in_float16_run_the_layers():
    proto = _add_layer_norm_model(dtype=onnx.TensorProto.FLOAT16)
    model = ai.load_model(proto)
    feeds = {n: RNG.standard_normal((2, 5, C)).astype(np.float16) for n in ("x", "r")}
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    assert got.dtype == np.float16
    expected = ReferenceEvaluator(proto).run(None, feeds)[0]
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("relu_first", [False, True])
def test_a_sum_read_before_its_norm_is_left_alone(relu_first):
    """The fused layer takes the norm's place: a reader of the sum that comes before the norm
    would read it before it is made, so then nothing fuses."""
    add = helper.make_node("Add", ["x", "r"], ["s"])
    relu = helper.make_node("Relu", ["s"], ["t"])
    norm = helper.make_node("LayerNormalization", ["s", "gamma"], ["n"], axis=-1)
    nodes = [add, relu, norm] if relu_first else [add, norm, relu]
    gamma = numpy_helper.from_array(np.ones(C, np.float32), "gamma")
    proto = make_model(nodes + [helper.make_node("Add", ["n", "t"], ["y"])],
                       [tensor_info("x", [2, 5, C]), tensor_info("r", [2, 5, C])], [tensor_info("y", [2, 5, C])],
                       [gamma], extra_domains=())
    model = ai.load_model(proto)
    assert model.optimizations["fuse_add_layer_norm"] == (0 if relu_first else 1)
    feeds = {n: RNG.standard_normal((2, 5, C)).astype(np.float32) for n in ("x", "r")}
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_residual_add_and_layer_norm_on_gpu_pixel_run_the_layers():
    require_pixel()
    proto = _add_layer_norm_model(sum_read_after=True)
    feeds = {n: RNG.standard_normal((2, 5, C)).astype(np.float32) for n in ("x", "r")}
    with ai.Worker(ai.load_model(proto), "gpu_pixel") as worker:
        got = worker.run_blocking(feeds)["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-4, atol=1e-4)


# -- attention ---------------------------------------------------------------------------------
B, H, S, T, D = 2, 4, 3, 7, 8


def _attention_model(scale: str | None = "Div", where: bool = True, bias: bool = True,
                     extra_outputs: tuple[str, ...] = (), dtype=onnx.TensorProto.FLOAT) -> onnx.ModelProto:
    """An exported decoder's attention: ``Softmax(Add(Where(keep, Div(q @ kᵀ, √D), fill), bias)) @ v``."""
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s0"])]
    x = "s0"
    if scale == "Div":
        nodes.append(helper.make_node("Div", [x, "root"], ["s1"]))
        x = "s1"
    elif scale == "Mul":
        nodes.append(helper.make_node("Mul", ["inv_root", x], ["s1"]))
        x = "s1"
    if where:
        nodes.append(helper.make_node("Where", ["keep", x, "fill"], ["s2"]))
        x = "s2"
    if bias:
        nodes.append(helper.make_node("Add", [x, "bias"], ["s3"]))
        x = "s3"
    nodes += [helper.make_node("Softmax", [x], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["y"])]
    inputs = [tensor_info("q", [B, H, S, D], dtype), tensor_info("k", [B, H, T, D], dtype),
              tensor_info("v", [B, H, T, D], dtype), tensor_info("keep", [1, 1, S, T], onnx.TensorProto.BOOL),
              tensor_info("bias", [B, 1, 1, T], dtype)]
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    consts = [numpy_helper.from_array(np.asarray(v, np_type), n) for n, v in
              (("root", math.sqrt(D)), ("inv_root", 1 / math.sqrt(D)), ("fill", np.finfo(np_type).min))]
    outputs = [tensor_info("y", [B, H, S, D], dtype)] + [tensor_info(n, None, dtype) for n in extra_outputs]
    used = {n for node in nodes for n in node.input}
    return make_model(nodes, [i for i in inputs if i.name in used], outputs,
                      [c for c in consts if c.name in used], extra_domains=())


def _attention_feeds(dtype=np.float32) -> dict[str, np.ndarray]:
    keep = np.tril(np.ones((S, T), bool), k=T - S)[None, None]  # a causal mask after T - S cached keys
    bias = np.where(RNG.random((B, 1, 1, T)) < 0.3, np.finfo(dtype).min, 0)
    bias[..., -1] = 0  # every query keeps its own key
    return {"q": RNG.standard_normal((B, H, S, D)).astype(dtype), "k": RNG.standard_normal((B, H, T, D)).astype(dtype),
            "v": RNG.standard_normal((B, H, T, D)).astype(dtype), "keep": keep, "bias": bias.astype(dtype)}


@pytest.mark.parametrize("scale,where,bias", [("Div", True, True), ("Mul", False, True), (None, True, False),
                                              (None, False, False)])
def test_decoder_attention_fuses_and_matches_the_definition(scale, where, bias):
    proto = _attention_model(scale, where, bias)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_attention"] == 1
    assert [l.op_type for l in model.layers] == ["MaskedAttention"]
    assert [l.op_type for l in model.layers[0].expansion][-2:] == ["Softmax", "MatMul"]
    feeds = {n: v for n, v in _attention_feeds().items() if n in {i.name for i in proto.graph.input}}
    expected = ReferenceEvaluator(proto).run(None, feeds)[0]
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_decoder_attention_in_float16_computes_in_float32_and_rounds_once():
    proto = _attention_model(dtype=onnx.TensorProto.FLOAT16)
    model = ai.load_model(proto)
    assert "MaskedAttention" in [l.op_type for l in model.layers]
    feeds = _attention_feeds(np.float16)
    expected = ReferenceEvaluator(proto).run(None, feeds)[0]
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("read_elsewhere", [False, True])
def test_the_heads_merge_after_attention_goes_into_it_when_it_is_the_only_reader(read_elsewhere):
    """``Transpose(attention, [0, 2, 1, 3])`` (the heads merged back) becomes the fused layer's
    ``out_perm`` when nothing else reads the attention; else the Transpose stays a layer."""
    proto = _attention_model(extra_outputs=("o",) if read_elsewhere else ())
    proto.graph.node[-1].output[0] = "o"
    proto.graph.node.append(helper.make_node("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3]))
    proto.graph.output[0].CopyFrom(tensor_info("y", [B, S, H, D]))
    model = ai.load_model(proto)
    kinds = [l.op_type for l in model.layers]
    assert kinds == (["MaskedAttention", "Transpose"] if read_elsewhere else ["MaskedAttention"])
    assert [l.op_type for l in model.layers[0].expansion][-1] == ("MatMul" if read_elsewhere else "Transpose")
    feeds = _attention_feeds()
    expected = ReferenceEvaluator(proto).run(None, feeds)
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)
    np.testing.assert_allclose(got["y"], expected[0], rtol=1e-5, atol=1e-5)
    assert got["y"].shape == (B, S, H, D)


def _encoder_attention_model(queries: int) -> onnx.ModelProto:
    """A BERT export's attention: Q, K and V projected as ``(B, S, H·D)``, reshaped to
    ``(B, S, H, D)`` and split into heads by Transposes (K's straight to ``(B, H, D, S)``), the
    heads merged back after ``Softmax(Add(Div(q @ kᵀ, √D), bias)) @ v``."""
    shape = numpy_helper.from_array(np.array([B, queries, H, D], np.int64), "heads")
    merged = numpy_helper.from_array(np.array([B, queries, H * D], np.int64), "merged")
    nodes = [helper.make_node("Reshape", [x, "heads"], [f"{x}4"]) for x in "qkv"]
    nodes += [helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
              helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
              helper.make_node("MatMul", ["qh", "kt"], ["s0"]), helper.make_node("Div", ["s0", "root"], ["s1"]),
              helper.make_node("Add", ["s1", "bias"], ["s2"]), helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vh"], ["o"]),
              helper.make_node("Transpose", ["o"], ["om"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["om", "merged"], ["y"])]
    inputs = [tensor_info(x, [B, queries, H * D]) for x in "qkv"] + [tensor_info("bias", [B, 1, 1, queries])]
    root = numpy_helper.from_array(np.asarray(math.sqrt(D), np.float32), "root")
    return make_model(nodes, inputs, [tensor_info("y", [B, queries, H * D])], [shape, merged, root],
                      extra_domains=())


@pytest.mark.parametrize("queries", [3, 24])  # a compiled pass per query row; two products per head
def test_encoder_attention_takes_in_the_heads_split_and_matches_the_definition(queries):
    """The Transposes that split Q, K and V into heads go into the fused layer (it reads their
    inputs through views), and so does the merge: only the Reshapes stay, each a view."""
    proto = _encoder_attention_model(queries)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_attention"] == 1
    assert [l.op_type for l in model.layers] == ["Reshape"] * 3 + ["MaskedAttention", "Reshape"]
    attrs = next(l.attrs for l in model.layers if l.op_type == "MaskedAttention")
    assert (attrs["q_perm"], attrs["k_perm"], attrs["v_perm"], attrs["out_perm"]) == ([0, 2, 1, 3],) * 4
    bias = np.where(RNG.random((B, 1, 1, queries)) < 0.3, -10000.0, 0).astype(np.float32)
    feeds = {x: RNG.standard_normal((B, queries, H * D)).astype(np.float32) for x in "qkv"} | {"bias": bias}
    expected = ReferenceEvaluator(proto).run(None, feeds)[0]
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_heads_split_after_a_split_stays_for_split_heads():
    """A Q/K/V split into heads after a ``Split`` (GPT-2's fused projection) is left to
    ``fuse_split_heads``: the attention does not take that Transpose in."""
    nodes = [helper.make_node("Split", ["qkv"], ["q", "k", "v"], axis=2)]
    nodes += [helper.make_node("Reshape", [x, "heads"], [f"{x}4"]) for x in "qkv"]
    nodes += [helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
              helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
              helper.make_node("MatMul", ["qh", "kt"], ["s0"]), helper.make_node("Softmax", ["s0"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vh"], ["y"])]
    shape = numpy_helper.from_array(np.array([B, S, H, D], np.int64), "heads")
    proto = make_model(nodes, [tensor_info("qkv", [B, S, 3 * H * D])], [tensor_info("y", [B, H, S, D])], [shape],
                       extra_domains=())
    model = ai.load_model(proto)
    attention = next(l for l in model.layers if l.op_type == "MaskedAttention")
    assert "q_perm" not in attention.attrs and "v_perm" not in attention.attrs and attention.attrs["k_perm"]
    feeds = {"qkv": RNG.standard_normal((B, S, 3 * H * D)).astype(np.float32)}
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_attention_whose_scores_are_also_an_output_is_left_alone():
    model = ai.load_model(_attention_model(extra_outputs=("s1",)))
    assert model.optimizations["fuse_attention"] == 0
    assert "Softmax" in [l.op_type for l in model.layers]


def test_attention_on_gpu_pixel_runs_the_layers_it_replaced_there():
    """gpu_pixel has no MaskedAttention kernel: its plan takes the fused layer's expansion (the
    seven original layers) instead of handing attention to the CPU."""
    require_pixel()
    proto = _attention_model()
    model = ai.load_model(proto)
    feeds = _attention_feeds()
    expected = ReferenceEvaluator(proto).run(None, feeds)[0]
    with ai.Worker(model, "gpu_pixel") as worker:
        placement = worker.placement
        got = worker.run_blocking(feeds)["y"]
    assert "MaskedAttention" not in " ".join(placement.layers)  # its name is the last MatMul's
    assert not any(name in placement.fallback for name in ("y", model.layers[0].name)), placement.fallback
    assert placement.layers[model.layers[0].name] == "gpu_pixel"
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4)


# -- rotary embedding (rotate half) ------------------------------------------------------------
def _rotary_model(lower_end: int = D // 2, upper: tuple[int, int] = (D // 2, D)) -> onnx.ModelProto:
    """Llama's ``x·cos + rotate_half(x)·sin``, the halves taken by Slices of the last axis."""
    ints = lambda name, v: numpy_helper.from_array(np.array([v], np.int64), name)  # noqa: E731
    consts = [ints("zero", 0), ints("half", lower_end), ints("up0", upper[0]), ints("up1", upper[1]), ints("last", -1)]
    nodes = [helper.make_node("Slice", ["x", "zero", "half", "last"], ["x1"]),
             helper.make_node("Slice", ["x", "up0", "up1", "last"], ["x2"]),
             helper.make_node("Mul", ["x", "cos"], ["a"]), helper.make_node("Neg", ["x2"], ["n"]),
             helper.make_node("Concat", ["n", "x1"], ["r"], axis=-1), helper.make_node("Mul", ["r", "sin"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    inputs = [tensor_info("x", [B, H, S, D]), tensor_info("cos", [B, 1, S, D]), tensor_info("sin", [B, 1, S, D])]
    return make_model(nodes, inputs, [tensor_info("y", [B, H, S, D])], consts, extra_domains=())


def _rotary_feeds() -> dict[str, np.ndarray]:
    angles = RNG.standard_normal((B, 1, S, D // 2)).astype(np.float32)
    angles = np.concatenate([angles, angles], axis=-1)
    return {"x": RNG.standard_normal((B, H, S, D)).astype(np.float32), "cos": np.cos(angles), "sin": np.sin(angles)}


def test_rotate_half_embedding_fuses_with_the_bits_of_its_layers():
    proto = _rotary_model()
    model = ai.load_model(proto)
    assert model.optimizations["fuse_rotary"] == 1
    assert [l.op_type for l in model.layers] == ["RotaryHalfEmbedding"]
    feeds = _rotary_feeds()
    expected = ReferenceEvaluator(proto).run(None, feeds)[0]
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    with ai.Worker(ai.load_model(proto, optimize=False), "cpu") as worker:
        unfused = worker.run_blocking(feeds)["y"]
    np.testing.assert_array_equal(got, unfused)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_halves_that_do_not_meet_are_left_alone():
    model = ai.load_model(_rotary_model(lower_end=D // 2 - 1))
    assert model.optimizations["fuse_rotary"] == 0


def test_rotary_on_gpu_pixel_runs_the_layers_it_replaced_there():
    require_pixel()
    proto = _rotary_model()
    model = ai.load_model(proto)
    feeds = _rotary_feeds()
    with ai.Worker(model, "gpu_pixel") as worker:
        placement = worker.placement
        got = worker.run_blocking(feeds)["y"]
    assert placement.layers[model.layers[0].name] == "gpu_pixel" and not placement.fallback
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=2e-4, atol=2e-4)


def _grouped_attention_model(kv_heads: int = 2, read_k_shape: bool = True) -> onnx.ModelProto:
    """Llama's grouped-query attention: K and V heads repeated by Unsqueeze → Expand → Reshape
    (the repeated K also read by a Shape, as exporters do for the causal mask's bounds)."""
    g = H // kv_heads
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    consts = [ints("axis2", [2]), ints("expand", [B, kv_heads, g, T, D]), ints("heads", [B, H, T, D]),
              numpy_helper.from_array(np.asarray(math.sqrt(D), np.float32), "root")]
    nodes = []
    for x in ("k", "v"):
        nodes += [helper.make_node("Unsqueeze", [x, "axis2"], [f"{x}u"]),
                  helper.make_node("Expand", [f"{x}u", "expand"], [f"{x}e"]),
                  helper.make_node("Reshape", [f"{x}e", "heads"], [f"{x}r"])]
    nodes += [helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["s0"]), helper.make_node("Div", ["s0", "root"], ["s1"]),
              helper.make_node("Softmax", ["s1"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "vr"], ["y"])]
    outputs = [tensor_info("y", [B, H, S, D])]
    if read_k_shape:
        nodes.append(helper.make_node("Shape", ["kr"], ["k_shape"]))
        outputs.append(tensor_info("k_shape", [4], onnx.TensorProto.INT64))
    inputs = [tensor_info("q", [B, H, S, D]), tensor_info("k", [B, kv_heads, T, D]), tensor_info("v", [B, kv_heads, T, D])]
    return make_model(nodes, inputs, outputs, consts, extra_domains=())


@pytest.mark.parametrize("read_k_shape", [True, False])
def test_grouped_query_attention_shares_kv_heads_instead_of_repeating_them(read_k_shape):
    proto = _grouped_attention_model(read_k_shape=read_k_shape)
    model = ai.load_model(proto)
    fused = next(l for l in model.layers if l.op_type == "MaskedAttention")
    assert fused.inputs[1:3] == ["k", "v"]  # before the repeats
    feeds = {"q": RNG.standard_normal((B, H, S, D)).astype(np.float32),
             "k": RNG.standard_normal((B, 2, T, D)).astype(np.float32),
             "v": RNG.standard_normal((B, 2, T, D)).astype(np.float32)}
    expected = ReferenceEvaluator(proto).run(None, feeds)
    for backend in ("cpu", "gpu_pixel"):
        if backend == "gpu_pixel":
            require_pixel()
        with ai.Worker(model, backend) as worker:
            for _ in range(2):  # the second run of the signature is the specialised one
                got = worker.run_blocking(feeds)
            assert not worker.placement.fallback or backend == "cpu"
        np.testing.assert_allclose(got["y"], expected[0], rtol=2e-4, atol=2e-4)


# -- Reshape → Gemm → Reshape (a transformer's projections) --------------------------------------
N_OUT = 6


def _projection_model(before: bool = True, after: bool = True, *, activation: str | None = None,
                      trans_b: int = 0, dynamic_after: bool = False, shape_reads_before: bool = False,
                      extra_reader: bool = False) -> onnx.ModelProto:
    """``y = Reshape(Gemm(Reshape(x, [-1, C]), W, b), [2, 5, N])`` with x of shape (2, 5, C), each
    Reshape optional; ``dynamic_after``: the last target built from ``Shape(x)`` as exporters do
    (``shape_reads_before``: from ``Shape`` of the flattened x instead, which keeps that Reshape);
    ``extra_reader``: the flattened x is also an output (the first Reshape must stay)."""
    w = RNG.standard_normal((N_OUT, C) if trans_b else (C, N_OUT)).astype(np.float32)
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    consts = [numpy_helper.from_array(w, "w"), _const("b", RNG.standard_normal(N_OUT)), ints("flat", [-1, C]),
              ints("back", [2, 5, N_OUT]), ints("lead", [0]), ints("two", [2]), ints("n_out", [N_OUT]),
              ints("one", [1])]
    nodes, a = [], "x"
    if before:
        nodes.append(helper.make_node("Reshape", ["x", "flat"], ["a"]))
        a = "a"
    nodes.append(helper.make_node("Gemm", [a, "w", "b"], ["g"], transB=trans_b, alpha=0.5, beta=2.0))
    product = "g"
    if activation:
        nodes.append(helper.make_node(activation, ["g"], ["g_act"]))
        product = "g_act"
    outputs = [tensor_info("y", [2, 5, N_OUT] if after else [10, N_OUT])]
    if after:
        target = "back"
        if dynamic_after:
            if shape_reads_before:  # (10, C) -> [10]: the sequence axis folded, so [2, 5] is rebuilt from x
                nodes += [helper.make_node("Shape", ["a"], ["sa"]), helper.make_node("Gather", ["sa", "lead"], ["rows"]),
                          helper.make_node("Div", ["rows", "two"], ["five"]),
                          helper.make_node("Concat", ["two", "five", "n_out"], ["dyn"], axis=0)]
            else:
                nodes += [helper.make_node("Shape", ["x"], ["sx"]),
                          helper.make_node("Slice", ["sx", "lead", "two"], ["bs"]),
                          helper.make_node("Concat", ["bs", "n_out"], ["dyn"], axis=0)]
            target = "dyn"
        nodes.append(helper.make_node("Reshape", [product, target], ["y"]))
    else:
        nodes[-1].output[0] = "y"
    if extra_reader:
        outputs.append(tensor_info("a", [10, C]))
    x_dims = ["batch", "sequence", C] if dynamic_after else [2, 5, C]  # (else load folds the Shape away)
    return make_model(nodes, [tensor_info("x", x_dims)], outputs, consts, extra_domains=())


@pytest.mark.parametrize("before,after", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_projection_reshapes_fuse_into_the_gemm_and_match_the_definition(before, after, trans_b):
    proto = _projection_model(before, after, trans_b=trans_b)
    if not before:  # the Gemm reads x directly: x is (10, C) then
        proto.graph.input[0].CopyFrom(tensor_info("x", [10, C]))
    model = ai.load_model(proto)
    assert model.optimizations["fuse_gemm_reshapes"] == 1
    assert [l.op_type for l in model.layers] == ["ReshapedGemm"]
    assert [l.op_type for l in model.layers[0].expansion] == ["Reshape"] * before + ["Gemm"] + ["Reshape"] * after
    x = RNG.standard_normal((2, 5, C) if before else (10, C)).astype(np.float32)
    expected = ReferenceEvaluator(proto).run(None, {"x": x})[0]
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)["y"]
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation", ["Relu", "Tanh"])
def test_a_gemm_with_a_fused_activation_keeps_it_when_its_reshapes_fuse(activation):
    proto = _projection_model(activation=activation)
    model = ai.load_model(proto)
    assert [l.kind for l in model.layers] == [f"ReshapedGemm+{activation}"]
    x = RNG.standard_normal((2, 5, C)).astype(np.float32)
    expected = ReferenceEvaluator(proto).run(None, {"x": x})[0]
    with ai.Worker(model, "cpu") as worker:
        np.testing.assert_allclose(worker.run_blocking(x)["y"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape_reads_before", [False, True])
def test_a_reshape_target_computed_at_run_time_is_an_input_of_the_fused_layer(shape_reads_before):
    """Exporters compute the last Reshape's target from ``Shape``: the fused layer reads that
    value; a Reshape whose result ``Shape`` also reads stays for it (and runs of known shapes skip it)."""
    proto = _projection_model(dynamic_after=True, shape_reads_before=shape_reads_before)
    model = ai.load_model(proto)
    kinds = [l.op_type for l in model.layers]
    assert "ReshapedGemm" in kinds and "Gemm" not in kinds
    assert kinds.count("Reshape") == (1 if shape_reads_before else 0)  # kept for the Shape that reads it
    x = RNG.standard_normal((2, 5, C)).astype(np.float32)
    expected = ReferenceEvaluator(proto).run(None, {"x": x})[0]
    with ai.Worker(model, "cpu") as worker:
        for _ in range(3):  # the first run of these shapes records the target, later ones take it
            np.testing.assert_allclose(worker.run_blocking(x)["y"], expected, rtol=1e-5, atol=1e-5)


def test_a_flattened_input_read_elsewhere_keeps_its_reshape():
    proto = _projection_model(extra_reader=True)
    model = ai.load_model(proto)
    fused = [l for l in model.layers if l.op_type == "ReshapedGemm"]
    assert len(fused) == 1 and fused[0].inputs[3] == ""  # only the Reshape after went in
    assert [l.op_type for l in model.layers].count("Reshape") == 1
    x = RNG.standard_normal((2, 5, C)).astype(np.float32)
    expected = ReferenceEvaluator(proto).run(None, {"x": x})
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)
    np.testing.assert_allclose(got["y"], expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got["a"], expected[1])


def test_projection_on_gpu_pixel_runs_the_layers_it_replaced_there():
    require_pixel()
    proto = _projection_model(activation="Relu")
    model = ai.load_model(proto)
    x = RNG.standard_normal((2, 5, C)).astype(np.float32)
    expected = ReferenceEvaluator(proto).run(None, {"x": x})[0]
    with ai.Worker(model, "gpu_pixel") as worker:
        placement = worker.placement
        got = worker.run_blocking(x)["y"]
    assert model.layers[0].name not in placement.fallback, placement.fallback
    assert placement.layers[model.layers[0].name] == "gpu_pixel"
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-4)


# -- Transpose(Reshape(x)): the head split of attention ------------------------------------------
def _head_split_model(perm: list[int] | None = (0, 2, 1, 3), shape_reads: bool = False) -> onnx.ModelProto:
    """``y = Transpose(Reshape(x, [0, 0, 4, -1]), perm)``, x of shape (2, 5, C) or, with
    ``shape_reads``, of symbolic shape with a ``Shape`` of the reshaped x as a second output."""
    target = numpy_helper.from_array(np.array([0, 0, 4, -1], np.int64), "heads")  # (0: x's own dimension)
    attrs = {} if perm is None else {"perm": list(perm)}
    nodes = [helper.make_node("Reshape", ["x", "heads"], ["r"]), helper.make_node("Transpose", ["r"], ["y"], **attrs)]
    out_dims = [2, 5, 4, C // 4] if perm is None else None
    outputs = [tensor_info("y", None if out_dims is None else out_dims[::-1])]
    if shape_reads:
        nodes.append(helper.make_node("Shape", ["r"], ["s"]))
        outputs.append(tensor_info("s", [4], onnx.TensorProto.INT64))
    x_dims = ["batch", "sequence", C] if shape_reads else [2, 5, C]
    return make_model(nodes, [tensor_info("x", x_dims)], outputs, [target], extra_domains=())


@pytest.mark.parametrize("perm", [(0, 2, 1, 3), (0, 2, 3, 1), None])
def test_head_split_fuses_and_matches_the_definition(perm):
    proto = _head_split_model(perm)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_reshape_transposes"] == 1
    assert [l.op_type for l in model.layers] == ["ReshapeTranspose"]
    assert [l.op_type for l in model.layers[0].expansion] == ["Reshape", "Transpose"]
    x = RNG.standard_normal((2, 5, C)).astype(np.float32)
    expected = ReferenceEvaluator(proto).run(None, {"x": x})[0]
    with ai.Worker(model, "cpu") as worker:
        np.testing.assert_array_equal(worker.run_blocking(x)["y"], expected)


def test_head_split_whose_reshape_shape_reads_keeps_the_reshape_for_it():
    proto = _head_split_model(shape_reads=True)
    model = ai.load_model(proto)
    assert sorted(l.op_type for l in model.layers) == ["Reshape", "ReshapeTranspose", "Shape"]
    x = RNG.standard_normal((2, 5, C)).astype(np.float32)
    expected = ReferenceEvaluator(proto).run(None, {"x": x})
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)
    np.testing.assert_array_equal(got["y"], expected[0])
    np.testing.assert_array_equal(got["s"], expected[1])


# -- the K/V head splits appended to the cache, and the Split of a fused Q/K/V projection -------------
HEADS = 4


def _qkv_split_model(opset: int = 17, *, past: bool = True, shape_reads: bool = False,
                     part_read_elsewhere: bool = False) -> onnx.ModelProto:
    """GPT-2's attention inputs: ``Split`` of x (1, S, 3C) into Q, K and V, each split into
    ``HEADS`` heads (``Transpose(Reshape)``), K and V appended to ``past_k``/``past_v`` (``Concat``
    on axis -2) as outputs ``present_k``/``present_v``; output ``y`` is Q's heads. The Split's
    sizes are an input (opset 13+: ``opset`` 17), an attribute (11) or absent (18, equal parts).
    ``shape_reads``: a ``Shape`` of the K part is an output too;
    ``part_read_elsewhere``: the V part itself is an output."""
    target = numpy_helper.from_array(np.array([0, 0, HEADS, -1], np.int64), "heads")
    sizes = numpy_helper.from_array(np.array([C, C, C], np.int64), "sizes")
    if opset >= 18:
        split = helper.make_node("Split", ["x"], ["q", "k", "v"], axis=2, num_outputs=3)
    elif opset >= 13:
        split = helper.make_node("Split", ["x", "sizes"], ["q", "k", "v"], axis=2)
    else:
        split = helper.make_node("Split", ["x"], ["q", "k", "v"], axis=2, split=[C, C, C])
    nodes = [split]
    for part in ("q", "k", "v"):
        nodes += [helper.make_node("Reshape", [part, "heads"], [f"{part}_r"]),
                  helper.make_node("Transpose", [f"{part}_r"], [f"{part}_h"], perm=[0, 2, 1, 3])]
    outputs = [tensor_info("y", None)]
    inputs = [tensor_info("x", [1, "sequence", 3 * C])]
    if past:
        for part in ("k", "v"):
            nodes.append(helper.make_node("Concat", [f"past_{part}", f"{part}_h"], [f"present_{part}"], axis=-2))
            inputs.append(tensor_info(f"past_{part}", ["batch", "heads", "past", "size"]))
            outputs.append(tensor_info(f"present_{part}", None))
    else:
        nodes += [helper.make_node("Identity", [f"{part}_h"], [f"{part}_out"]) for part in ("k", "v")]
        outputs += [tensor_info("k_out", None), tensor_info("v_out", None)]
    nodes.append(helper.make_node("Identity", ["q_h"], ["y"]))
    if shape_reads:
        nodes.append(helper.make_node("Shape", ["k"], ["k_shape"]))
        outputs.append(tensor_info("k_shape", [3], onnx.TensorProto.INT64))
    if part_read_elsewhere:
        nodes.append(helper.make_node("Identity", ["v"], ["v_part"]))
        outputs.append(tensor_info("v_part", None))
    initializers = [target] + ([sizes] if 13 <= opset < 18 else [])
    return make_model(nodes, inputs, outputs, initializers, opset=opset, extra_domains=())


def _qkv_feeds(past: int = 2, sequence: int = 3) -> dict[str, np.ndarray]:
    feeds = {"x": RNG.standard_normal((1, sequence, 3 * C)).astype(np.float32)}
    for part in ("k", "v"):
        feeds[f"past_{part}"] = RNG.standard_normal((1, HEADS, past, C // HEADS)).astype(np.float32)
    return feeds


def _expect_definition(proto: onnx.ModelProto, model: ai.Model, feeds: dict[str, np.ndarray]) -> None:
    names = [o.name for o in proto.graph.output]
    feeds = {i.name: feeds[i.name] for i in proto.graph.input}
    expected = ReferenceEvaluator(proto).run(None, feeds)
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)
    for name, value in zip(names, expected):
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("opset", [11, 17, 18])
def test_qkv_split_into_heads_and_cache_appends_fuse_into_one_layer(opset):
    proto = _qkv_split_model(opset)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_reshape_transposes"] == 3
    assert model.optimizations["fuse_split_heads"] == 1
    fused = [l for l in model.layers if l.op_type == "SplitHeads"]
    assert len(fused) == 1 and fused[0].outputs == ["q_h", "present_k", "present_v"]
    assert "Split" not in [l.op_type for l in model.layers] and "Concat" not in [l.op_type for l in model.layers]
    expanded = [l.op_type for l in fused[0].expansion]
    assert expanded == ["Split", "ReshapeTranspose", "ReshapeTranspose", "ReshapeTranspose"]
    assert [l.op_type for l in fused[0].expansion[2].expansion] == ["Reshape", "Transpose", "Concat"]
    _expect_definition(proto, model, _qkv_feeds())


def test_the_fused_cache_append_grows_its_own_present_in_place():
    """The fused kernel fed its own ``present`` back as ``past`` appends after it in the same
    buffer, as the cache's Concat did (``ops/cache_append.py``), step after step, and the
    results stay the definition's."""
    from asyncinfer import ops
    from asyncinfer.ops.fused import FUSED_DOMAIN

    proto = _qkv_split_model()
    model = ai.load_model(proto)
    layer = next(l for l in model.layers if l.op_type == "SplitHeads")
    kernel = ops.lookup("SplitHeads", 1, FUSED_DOMAIN)(layer)
    reference = ReferenceEvaluator(proto)
    feeds = _qkv_feeds(past=2, sequence=1)
    buffers = set()
    for step, sequence in enumerate([1, 1, 1, 1, 2, 1]):  # (steps after the first take the short way
        # while the input's shape stays: `SplitHeads._remember`)
        feeds["x"] = RNG.standard_normal((1, sequence, 3 * C)).astype(np.float32)
        got = kernel.run(*[None if not n else feeds[n] if n in feeds else model.constants[n] for n in layer.inputs])
        for name, value, expected in zip(["y", "present_k", "present_v"], got, reference.run(None, feeds)):
            np.testing.assert_array_equal(value, expected, err_msg=f"{name}, step {step}")
        assert kernel._known is not None and kernel._known[0] == (1, sequence, 3 * C)
        buffers.add(id(got[1].base))
        feeds = {"past_k": got[1], "past_v": got[2]}
    assert len(buffers) == 1  # the first step made a buffer with room; the others appended into it


def test_a_split_whose_part_shape_reads_stays_for_the_shape_layer():
    proto = _qkv_split_model(shape_reads=True)
    model = ai.load_model(proto)
    kinds = sorted(l.op_type for l in model.layers)
    assert "SplitHeads" in kinds and "Split" in kinds and "Shape" in kinds, kinds
    _expect_definition(proto, model, _qkv_feeds(sequence=4))


@pytest.mark.parametrize("past", [True, False])
def test_a_split_part_read_elsewhere_keeps_the_split(past):
    proto = _qkv_split_model(past=past, part_read_elsewhere=True)
    model = ai.load_model(proto)
    kinds = [l.op_type for l in model.layers]
    assert "SplitHeads" not in kinds and "Split" in kinds and kinds.count("ReshapeTranspose") == 3, kinds
    assert "Concat" not in kinds, kinds  # (with past: the appends went into the ReshapeTransposes)
    _expect_definition(proto, model, _qkv_feeds())


def test_a_cache_that_cannot_be_appended_to_is_an_error_naming_the_fused_layer():
    """A past of the wrong head count (an untrusted request) fails the run with an ExecutionError
    naming the fused layer; the worker stays usable."""
    proto = _qkv_split_model()
    model = ai.load_model(proto)
    fused = next(l for l in model.layers if l.op_type == "SplitHeads")
    feeds = _qkv_feeds()
    bad = dict(feeds, past_k=np.zeros((1, HEADS + 1, 2, C // HEADS), np.float32))
    with ai.Worker(model, "cpu") as worker:
        with pytest.raises(ai.ExecutionError) as failure:
            worker.run_blocking(bad)
        assert fused.name in str(failure.value)
        got = worker.run_blocking(feeds)
    np.testing.assert_array_equal(got["present_v"], ReferenceEvaluator(proto).run(None, feeds)[2])


def test_qkv_split_on_gpu_pixel_runs_the_layers_it_replaced_there():
    require_pixel()
    proto = _qkv_split_model()
    model = ai.load_model(proto)
    fused = next(l for l in model.layers if l.op_type == "SplitHeads")
    feeds = _qkv_feeds()
    expected = ReferenceEvaluator(proto).run(None, feeds)
    with ai.Worker(model, "gpu_pixel") as worker:
        placement = worker.placement
        got = worker.run_blocking(feeds)
    assert fused.name not in placement.fallback, placement.fallback
    for name, value in zip(["y", "present_k", "present_v"], expected):
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("build,node,fused,bad,good", [
    (_projection_model, -1, "ReshapedGemm", [7, 5, N_OUT], [2, 5, N_OUT]),
    (_head_split_model, 0, "ReshapeTranspose", [2, 5, 3, 3], [2, 5, 2, C // 2]),
])
def test_a_fused_reshape_that_cannot_apply_is_an_error_naming_the_layer(build, node, fused, bad, good):
    """A fused Reshape's target fed at run time (an untrusted request): a wrong one fails the run
    with an ExecutionError naming the fused layer; the worker stays usable, and a right one gives
    the definition's result."""
    proto = build()
    proto.graph.node[node].input[1] = "target"
    proto.graph.input.append(tensor_info("target", [len(good)], onnx.TensorProto.INT64))
    model = ai.load_model(proto)
    assert [l.op_type for l in model.layers] == [fused]
    x = RNG.standard_normal((2, 5, C)).astype(np.float32)
    with ai.Worker(model, "cpu") as worker:
        with pytest.raises(ai.ExecutionError, match="cannot reshape") as failure:
            worker.run_blocking({"x": x, "target": np.array(bad, np.int64)})
        assert model.layers[0].name in str(failure.value)
        got = worker.run_blocking({"x": x, "target": np.array(good, np.int64)})["y"]
    expected = ReferenceEvaluator(proto).run(None, {"x": x, "target": np.array(good, np.int64)})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_repeated_projections_take_the_short_way_with_the_same_bits():
    """A ReshapedGemm keeps its last plain run's operands (`ReshapedGemm._remember`): runs with the
    same ones skip the parsing, others (a new batch size, new targets) take the full way again;
    every result has the bits of the unfused layers."""
    proto = _projection_model(dynamic_after=True)
    fused, plain = ai.load_model(proto), ai.load_model(proto, optimize=False)
    assert "ReshapedGemm" in [l.op_type for l in fused.layers]
    xs = [RNG.standard_normal((batch, 5, C)).astype(np.float32) for batch in (2, 2, 3, 2, 3, 3)]
    with ai.Worker(fused, "cpu") as fast, ai.Worker(plain, "cpu") as slow:
        for x in xs:
            np.testing.assert_array_equal(fast.run_blocking(x)["y"], slow.run_blocking(x)["y"])


# -- squeeze-and-excitation ----------------------------------------------------------------------
SE_C, SE_R = 24, 8


def _se_model(style: str = "mobilenet", *, gate_first: bool = False, pool_read_elsewhere: bool = False,
              group: int = 1, clip_bounds: bool = False, batch: int | str = 1) -> onnx.ModelProto:
    """x → depthwise-ish Conv → SE block (GlobalAveragePool, 1x1 Conv + act1, 1x1 Conv + act2,
    Mul) → y: MobileNetV3's (Relu, HardSigmoid) or EfficientNet's (SiLU spelled x·Sigmoid(x),
    Sigmoid)."""
    rng = np.random.default_rng(3)
    consts = [_const("w0", rng.standard_normal((SE_C, 3, 3, 3)) * 0.3), _const("b0", rng.standard_normal(SE_C)),
              _const("w1", rng.standard_normal((SE_R, SE_C // group, 1, 1)) * 0.3), _const("b1", rng.standard_normal(SE_R)),
              _const("w2", rng.standard_normal((SE_C, SE_R, 1, 1)) * 0.3), _const("b2", rng.standard_normal(SE_C)),
              _const("lo", 0.0), _const("hi", 6.0)]
    nodes = [helper.make_node("Conv", ["x", "w0", "b0"], ["f"], pads=[1, 1, 1, 1]),
             helper.make_node("GlobalAveragePool", ["f"], ["p"]),
             helper.make_node("Conv", ["p", "w1", "b1"], ["s1"], group=group)]
    if clip_bounds:
        nodes.append(helper.make_node("Clip", ["s1", "lo", "hi"], ["a1"]))
    elif style == "mobilenet":
        nodes.append(helper.make_node("Relu", ["s1"], ["a1"]))
    else:
        nodes += [helper.make_node("Sigmoid", ["s1"], ["g1"]), helper.make_node("Mul", ["s1", "g1"], ["a1"])]
    nodes.append(helper.make_node("Conv", ["a1", "w2", "b2"], ["s2"]))
    nodes.append(helper.make_node("HardSigmoid", ["s2"], ["gate"], alpha=1 / 6, beta=0.5) if style == "mobilenet"
                 else helper.make_node("Sigmoid", ["s2"], ["gate"]))
    nodes.append(helper.make_node("Mul", ["gate", "f"] if gate_first else ["f", "gate"], ["y"]))
    outputs = [tensor_info("y", [batch, SE_C, 9, 11])]
    if pool_read_elsewhere:
        outputs.append(tensor_info("p", [batch, SE_C, 1, 1]))
    return make_model(nodes, [tensor_info("x", [batch, 3, 9, 11])], outputs, consts)


def _load_and_run(proto: onnx.ModelProto, feeds: dict, *, without: str | None = None,
                  backend: str = "cpu") -> tuple[ai.Model, np.ndarray]:
    """Load ``proto`` (with the optimizer pass ``without`` left out) and run it on ``backend``:
    the model and its output ``y``."""
    from asyncinfer.loader import optimize

    passes = list(optimize.PASSES)
    optimize.PASSES[:] = [p for p in passes if p[0] != without]
    try:
        model = ai.load_model(proto)
    finally:
        optimize.PASSES[:] = passes
    with ai.Worker(model, backend) as worker:
        return model, worker.run_blocking(feeds)["y"]


@pytest.mark.parametrize("style", ["mobilenet", "efficientnet"])
@pytest.mark.parametrize("gate_first", [False, True])
def test_squeeze_excite_fuses_and_matches_the_unfused_layers(style, gate_first):
    proto = _se_model(style, gate_first=gate_first)
    x = RNG.standard_normal((1, 3, 9, 11)).astype(np.float32)
    model, got = _load_and_run(proto, {"x": x})
    assert model.optimizations["fuse_squeeze_excite"] == 1
    fused = [l for l in model.layers if l.op_type == "SqueezeExcite"]
    assert len(fused) == 1 and [l.op_type for l in fused[0].expansion] == ["GlobalAveragePool", "Conv", "Conv", "Mul"]
    assert not any(l.op_type == "GlobalAveragePool" for l in model.layers)
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    unfused_model, unfused = _load_and_run(proto, {"x": x}, without="fuse_squeeze_excite")
    assert "fuse_squeeze_excite" not in unfused_model.optimizations  # (the pass left out)
    # the pool's and the activations' bits; the products' sums in another order than BLAS's GEMV
    np.testing.assert_allclose(got, unfused, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("images", [5, 120])  # 120: a block the worker's threads share
def test_squeeze_excite_of_a_batch_matches_the_definition(images):
    proto = _se_model("efficientnet", batch="N")
    x = RNG.standard_normal((images, 3, 9, 11)).astype(np.float32)
    assert (x.shape[0] * SE_C * 9 * 11 >= squeeze_excite.TEAM_MIN_VALUES) == (images == 120)
    model, got = _load_and_run(proto, {"x": x})
    assert model.optimizations["fuse_squeeze_excite"] == 1
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, _load_and_run(proto, {"x": x}, without="fuse_squeeze_excite")[1], rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("variant", [dict(pool_read_elsewhere=True), dict(group=2), dict(clip_bounds=True)])
def test_squeeze_excite_that_is_not_exactly_the_block_is_left_alone(variant):
    proto = _se_model(**variant)
    x = RNG.standard_normal((1, 3, 9, 11)).astype(np.float32)
    model, got = _load_and_run(proto, {"x": x})
    assert model.optimizations["fuse_squeeze_excite"] == 0
    assert any(l.op_type == "GlobalAveragePool" for l in model.layers)
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


def _runs_its_expansion_on_gpu_pixel(proto: onnx.ModelProto, x: np.ndarray, fusion: str) -> None:
    """gpu_pixel has no kernel for the layer ``fusion`` made: its plan takes the expansion there,
    every layer on gpu_pixel, and the result is the definition's."""
    require_pixel()
    model = ai.load_model(proto)
    assert model.optimizations[fusion] == 1
    with ai.Worker(model, "gpu_pixel") as worker:
        placement = worker.placement
        got = worker.run_blocking(x)["y"]
    assert not placement.fallback, placement.fallback
    assert set(placement.layers.values()) == {"gpu_pixel"}
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=2e-4, atol=2e-4)


def test_squeeze_excite_on_gpu_pixel_runs_the_layers_it_replaced_there():
    """(pool, convs, Mul)"""
    _runs_its_expansion_on_gpu_pixel(_se_model(), RNG.standard_normal((1, 3, 9, 11)).astype(np.float32),
                                     "fuse_squeeze_excite")


# -- channel shuffle after a grouped conv --------------------------------------------------------
SH_C, SH_M, SH_G = 24, 48, 4


def _shuffle_model(*, target=(0, SH_G, -1, 10, 12), target_after=(0, -1, 10, 12), perm=(0, 2, 1, 3, 4),
                   batch: int | str = "N", bias: bool = True) -> onnx.ModelProto:
    """x (N, 24, 10, 12) → grouped 1x1 Conv (4 groups, 48 channels) + Relu → Reshape(target) →
    Transpose(perm) → Reshape(target_after) → y: ShuffleNet's unit as exported."""
    rng = np.random.default_rng(11)
    consts = [_const("w", rng.standard_normal((SH_M, SH_C // SH_G, 1, 1)) * 0.3),
              numpy_helper.from_array(np.array(target, np.int64), "target"),
              numpy_helper.from_array(np.array(target_after, np.int64), "target_after")]
    if bias:
        consts.append(_const("b", rng.standard_normal(SH_M)))
    nodes = [helper.make_node("Conv", ["x", "w", "b"] if bias else ["x", "w"], ["c"], group=SH_G, kernel_shape=[1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Reshape", ["r", "target"], ["g"]),
             helper.make_node("Transpose", ["g"], ["t"], perm=list(perm)),
             helper.make_node("Reshape", ["t", "target_after"], ["y"])]
    return make_model(nodes, [tensor_info("x", [batch, SH_C, 10, 12])], [tensor_info("y", None)], consts)


def _shuffled_convs(worker: ai.Worker) -> list:
    return [node.step.op for segment in worker._plan.segments for node in segment.nodes
            if node.layer.op_type == "ShuffledConv"]


@pytest.mark.parametrize("bias", [True, False])
def test_channel_shuffle_fuses_into_the_grouped_conv_which_stores_it(bias):
    """The four layers become one ``ShuffledConv+Relu`` whose GEMM stores the shuffled channels:
    the definition's values, and the very bits of the layers unfused, for one batch after another."""
    proto = _shuffle_model(bias=bias)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_channel_shuffles"] == 1
    assert [l.kind for l in model.layers] == ["ShuffledConv+Relu"]
    assert [l.op_type for l in model.layers[0].expansion] == ["Conv", "Reshape", "Transpose", "Reshape"]
    with ai.Worker(model, "cpu") as worker, ai.Worker(ai.load_model(proto, optimize=False), "cpu") as plain:
        for images in (1, 3, 1):
            x = RNG.standard_normal((images, SH_C, 10, 12)).astype(np.float32)
            got = worker.run_blocking(x)["y"]
            np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got, plain.run_blocking(x)["y"])
        [op] = _shuffled_convs(worker)
    assert op._shuffled is not None and op._layers is None  # (the GEMM stored it: no layer ran)


@pytest.mark.parametrize("variant", [dict(target=(0, 2, -1, 10, 12)),             # 2 groups shuffled, the conv has 4
                                     dict(target=(0, SH_G, -1, 120), target_after=(0, -1, 10, 12),
                                          perm=(0, 2, 1, 3))])                     # no shuffle of 5 axes
def test_reshapes_that_do_not_shuffle_the_convs_groups_run_as_the_layers(variant):
    proto = _shuffle_model(**variant)
    model = ai.load_model(proto)
    x = RNG.standard_normal((2, SH_C, 10, 12)).astype(np.float32)
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)["y"]
        ops = _shuffled_convs(worker)
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
    if len(variant["target"]) == 5:  # fused (the loader cannot tell), the layers' way at run time
        assert model.optimizations["fuse_channel_shuffles"] == 1 and ops[0]._shuffled is None and ops[0]._layers
    else:
        assert model.optimizations["fuse_channel_shuffles"] == 0 and not ops


def test_a_shuffle_target_that_does_not_fit_the_input_is_the_layers_error():
    proto = _shuffle_model(target=(5, SH_G, -1, 10, 12))  # batch 5 written in: batch 1 cannot take it
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        with pytest.raises(ai.AsyncInferError, match="cannot reshape"):
            worker.run_blocking(RNG.standard_normal((1, SH_C, 10, 12)).astype(np.float32))
        x = RNG.standard_normal((5, SH_C, 10, 12)).astype(np.float32)  # (the worker still runs)
        np.testing.assert_allclose(worker.run_blocking(x)["y"], ReferenceEvaluator(proto).run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-5)
        [op] = _shuffled_convs(worker)
    assert op._shuffled is not None  # (batch 5: the shuffle of the conv's groups)


def test_channel_shuffle_on_gpu_pixel_runs_the_layers_it_replaced_there():
    """(the conv, the Reshapes and the Transpose)"""
    _runs_its_expansion_on_gpu_pixel(_shuffle_model(batch=1), RNG.standard_normal((1, SH_C, 10, 12)).astype(np.float32),
                                     "fuse_channel_shuffles")


# -- MatMul + bias row ---------------------------------------------------------------------------
def _linear_model(*, bias_first: bool = False, gelu: bool = False, bias_shape: tuple[int, ...] = (12,),
                  product_read_elsewhere: bool = False, bias_input: bool = False) -> onnx.ModelProto:
    """``y = [Gelu](x @ W + b)``, x (2, 5, 16): ``nn.Linear`` on a 3-D input as exported."""
    rng = np.random.default_rng(5)
    consts = [_const("w", rng.standard_normal((C, 12)) * 0.3)]
    inputs = [tensor_info("x", [2, 5, C])]
    if bias_input:
        inputs.append(tensor_info("b", list(bias_shape)))
    else:
        consts.append(_const("b", rng.standard_normal(bias_shape)))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]),
             helper.make_node("Add", ["b", "p"] if bias_first else ["p", "b"], ["s" if gelu else "y"])]
    if gelu:
        nodes.append(helper.make_node("Gelu", ["s"], ["y"], domain=""))
    outputs = [tensor_info("y", None)] + ([tensor_info("p", None)] if product_read_elsewhere else [])
    return make_model(nodes, inputs, outputs, consts, opset=20 if gelu else 17)


@pytest.mark.parametrize("bias_first", [False, True])
@pytest.mark.parametrize("gelu", [False, True])
def test_matmul_and_bias_row_fuse_with_the_unfused_bits(bias_first, gelu):
    proto = _linear_model(bias_first=bias_first, gelu=gelu)
    feeds = {"x": RNG.standard_normal((2, 5, C)).astype(np.float32)}
    model, got = _load_and_run(proto, feeds)
    assert model.optimizations["fuse_matmul_bias"] == 1
    assert [l.kind for l in model.layers] == ["MatMulBias+Gelu" if gelu else "MatMulBias"]
    assert [l.op_type for l in model.layers[0].expansion] == ["MatMul", "Add"]
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got, _load_and_run(proto, feeds, without="fuse_matmul_bias")[1])


@pytest.mark.parametrize("variant", [dict(bias_shape=(1, 12)), dict(product_read_elsewhere=True),
                                     dict(bias_input=True)])
def test_matmul_and_add_that_are_not_a_bias_row_are_left_alone(variant):
    proto = _linear_model(**variant)
    feeds = {"x": RNG.standard_normal((2, 5, C)).astype(np.float32)}
    if variant.get("bias_input"):
        feeds["b"] = RNG.standard_normal(12).astype(np.float32)
    model, got = _load_and_run(proto, feeds)
    assert model.optimizations["fuse_matmul_bias"] == 0
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_matmul_bias_on_gpu_pixel_runs_the_layers_it_replaced_there():
    require_pixel()
    proto = _linear_model()
    feeds = {"x": RNG.standard_normal((2, 5, C)).astype(np.float32)}
    model, got = _load_and_run(proto, feeds, backend="gpu_pixel")
    assert model.optimizations["fuse_matmul_bias"] == 1
    with ai.Worker(model, "gpu_pixel") as worker:
        assert not worker.placement.fallback and set(worker.placement.layers.values()) == {"gpu_pixel"}
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=2e-4, atol=2e-4)


# -- products of one input side by side (Q, K, V) ------------------------------------------------
def _siblings_model(*, biased: bool = True, widths: tuple[int, ...] = (12, 12, 8), gelu_on: int | None = None,
                    shared_weight: int | None = None) -> onnx.ModelProto:
    """``y = concat_i(x @ W_i [+ b_i])`` over ``widths``, x (2, 5, 16): projections of one input.
    ``gelu_on``: that one's sum goes through Gelu; ``shared_weight``: that one's weight is also
    read by a product of ``x2``, added to ``y``'s first part."""
    rng = np.random.default_rng(11)
    consts, nodes, parts = [], [], []
    for i, n in enumerate(widths):
        consts.append(_const(f"w{i}", rng.standard_normal((C, n)) * 0.3))
        out = f"p{i}"
        nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [out]))
        if biased:
            consts.append(_const(f"b{i}", rng.standard_normal(n)))
            nodes.append(helper.make_node("Add", [out, f"b{i}"], [f"s{i}"]))
            out = f"s{i}"
        if gelu_on == i:
            nodes.append(helper.make_node("Gelu", [out], [f"g{i}"], domain=""))
            out = f"g{i}"
        parts.append(out)
    inputs = [tensor_info("x", [2, 5, C])]
    if shared_weight is not None:
        inputs.append(tensor_info("x2", [2, 5, C]))
        nodes += [helper.make_node("MatMul", ["x2", f"w{shared_weight}"], ["other"]),
                  helper.make_node("Add", [parts[0], "other"], ["first"])]
        parts[0] = "first"
    nodes.append(helper.make_node("Concat", parts, ["y"], axis=-1))
    return make_model(nodes, inputs, [tensor_info("y", None)], consts, opset=20)


def _sibling_feeds(proto: onnx.ModelProto) -> dict:
    return {i.name: RNG.standard_normal((2, 5, C)).astype(np.float32) for i in proto.graph.input}


@pytest.mark.parametrize("biased", [True, False])
@pytest.mark.parametrize("widths", [(12, 12, 8), (32, 32, 64)])
def test_products_of_one_input_join_into_one(biased, widths):
    """One product on the weights side by side, cut by a Split into the parts: the definition's
    values; the unfused layers' very bits where every part's width is whole panels (the parts
    and the joined product then take the same kernel), within rounding where the narrow parts
    went to another."""
    proto = _siblings_model(biased=biased, widths=widths)
    feeds = _sibling_feeds(proto)
    model, got = _load_and_run(proto, feeds)
    assert model.optimizations["fuse_sibling_products"] == 1
    kind = "MatMulBias" if biased else "MatMul"
    assert [l.op_type for l in model.layers] == [kind, "Split", "Concat"]
    joined, split = model.layers[:2]
    assert model.constants[joined.inputs[1]].shape == (C, sum(widths))
    assert split.outputs == (["s0", "s1", "s2"] if biased else ["p0", "p1", "p2"])
    assert not {"w0", "w1", "w2", "b0", "b1", "b2"} & set(model.constants)  # (one copy of the weights)
    info = model.value_info[joined.outputs[0]]  # (typed though x, a graph input, has no value_info)
    assert info.dtype == np.float32 and tuple(info.shape) == (2, 5, sum(widths))
    if biased:
        assert [l.op_type for l in joined.expansion] == ["MatMul", "Add"]
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    unfused = _load_and_run(proto, feeds, without="fuse_sibling_products")[1]
    if all(w % 32 == 0 for w in widths):
        np.testing.assert_array_equal(got, unfused)
    else:
        np.testing.assert_allclose(got, unfused, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant, joined", [(dict(gelu_on=1), 2), (dict(shared_weight=0), 2),
                                             (dict(widths=(12,)), 0), (dict(gelu_on=0, widths=(12, 8)), 0)])
def test_only_products_with_weights_of_their_own_and_no_activation_join(variant, joined):
    """A product whose sum goes through an activation, or whose weight another layer reads,
    stays apart; the others still join (two or more)."""
    proto = _siblings_model(**variant)
    feeds = _sibling_feeds(proto)
    model, got = _load_and_run(proto, feeds)
    assert model.optimizations["fuse_sibling_products"] == (1 if joined else 0)
    if joined:
        split = next(l for l in model.layers if l.op_type == "Split")
        assert len(split.outputs) == joined
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_products_on_weights_mapped_from_the_file_stay_apart(tmp_path, monkeypatch):
    """Weights memory-mapped from the model's external data stay apart: joined, they would be an
    anonymous copy held for good (each packed copy stands in for its mapped original instead)."""
    from asyncinfer.model import mapped

    monkeypatch.setattr(mapped, "MMAP_MIN_BYTES", 0)  # every external tensor mapped, however small
    proto = _siblings_model()
    feeds = _sibling_feeds(proto)
    expected = ReferenceEvaluator(proto).run(None, feeds)[0]
    path = tmp_path / "siblings.onnx"
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)  # (proto's tensors now refer to the file)
    model = ai.load_model(path)
    assert mapped.is_mapped(model.constants["w0"])
    assert model.optimizations.get("fuse_sibling_products", 0) == 0
    assert [l.op_type for l in model.layers].count("MatMulBias") == 3
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_joined_products_on_gpu_pixel_run_there():
    require_pixel()
    proto = _siblings_model()
    feeds = _sibling_feeds(proto)
    model, got = _load_and_run(proto, feeds, backend="gpu_pixel")
    assert model.optimizations["fuse_sibling_products"] == 1
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=2e-4, atol=2e-4)
    split = next(l for l in model.layers if l.op_type == "Split")
    with ai.Worker(model, "gpu_pixel") as worker:  # (the joined product typed: its Split placed there)
        assert worker.placement.layers[split.name] == "gpu_pixel"


def _magnitude_model(*, sum_read_elsewhere: bool = False, product: bool = False, dtype=onnx.TensorProto.FLOAT,
                     b_shape=(1, 129, 4)) -> onnx.ModelProto:
    """An STFT's magnitude as exporters write it: Sqrt(Add(Mul(re, re), Mul(im, im))) of a
    spectrum's two halves (``product``: the second Mul of re by im, no square)."""
    nodes = [helper.make_node("Mul", ["re", "re"], ["re2"]),
             helper.make_node("Mul", ["im", "re"] if product else ["im", "im"], ["im2"]),
             helper.make_node("Add", ["re2", "im2"], ["power"]),
             helper.make_node("Sqrt", ["power"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", dtype, None)]
    if sum_read_elsewhere:
        outputs.append(helper.make_tensor_value_info("power", dtype, None))
    inputs = [helper.make_tensor_value_info("re", dtype, [1, 129, 4]), helper.make_tensor_value_info("im", dtype, b_shape)]
    return helper.make_model(helper.make_graph(nodes, "magnitude", inputs, outputs),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("b_shape", [(1, 129, 4), (1, 1, 4)])
def test_magnitude_fuses_and_gives_the_bits_of_the_four_layers(dtype, b_shape):
    proto = _magnitude_model(dtype=onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), b_shape=b_shape)
    feeds = {"re": (RNG.standard_normal((1, 129, 4)) * 30).astype(dtype),
             "im": (RNG.standard_normal(b_shape) * 30).astype(dtype)}
    feeds["re"].reshape(-1)[:3] = [np.inf, np.nan, -0.0]
    model = ai.load_model(proto)
    assert model.optimizations["fuse_magnitude"] == 1
    assert [l.op_type for l in model.layers] == ["Magnitude"]
    assert [l.op_type for l in model.layers[0].expansion] == ["Mul", "Mul", "Add", "Sqrt"]
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    unfused_model, unfused = _load_and_run(proto, feeds, without="fuse_magnitude")
    assert len(unfused_model.layers) == 4
    assert got.dtype == dtype and got.shape == unfused.shape
    np.testing.assert_array_equal(got, unfused)
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-3 if dtype == np.float16 else 1e-6)


@pytest.mark.parametrize("variant", [dict(sum_read_elsewhere=True), dict(product=True)])
def test_magnitude_that_is_not_exactly_the_pattern_is_left_alone(variant):
    proto = _magnitude_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_magnitude"] == 0
    assert "Sqrt" in [l.op_type for l in model.layers]


def test_magnitude_on_gpu_pixel_runs_the_layers_it_replaced_there():
    proto = _magnitude_model()
    require_pixel()
    model = ai.load_model(proto)
    assert model.optimizations["fuse_magnitude"] == 1
    feeds = {"re": RNG.standard_normal((1, 129, 4)).astype(np.float32),
             "im": RNG.standard_normal((1, 129, 4)).astype(np.float32)}
    with ai.Worker(model, "gpu_pixel") as worker:
        placement = worker.placement
        got = worker.run_blocking(feeds)["y"]
    assert not placement.fallback, placement.fallback
    assert set(placement.layers.values()) == {"gpu_pixel"}
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=2e-4, atol=2e-4)


# -- convs of one input side by side, concatenated -----------------------------------------------
FIRE_C, FIRE_H, FIRE_W = 16, 9, 11


def _fire_model(*, first: int | None = None, activations=("Relu", "Relu"), biases=(True, True), order=(0, 1),
                also_read: bool = False, channels: int = FIRE_C, size: tuple[int, int] = (FIRE_H, FIRE_W),
                last: int = 24) -> onnx.ModelProto:
    """x (N, C, H, W) → a 1x1 Conv (``first`` channels: two panels of the kernel by default) and a
    3x3 Conv padded to the same map (``last`` channels), each with its activation, → Concat(axis 1)
    in ``order`` → y: SqueezeNet's fire module after its squeeze layer. ``also_read``: the 1x1's
    result is a graph output too."""
    from asyncinfer.ops.conv_direct import PANEL_WIDTH

    rng = np.random.default_rng(5)
    first = 2 * PANEL_WIDTH if first is None else first
    consts, nodes, results = [], [], []
    for i, (m, k) in enumerate(((first, 1), (last, 3))):
        consts.append(_const(f"w{i}", rng.standard_normal((m, channels, k, k)) * 0.2))
        inputs = ["x", f"w{i}"]
        if biases[i]:
            consts.append(_const(f"b{i}", rng.standard_normal(m)))
            inputs.append(f"b{i}")
        nodes.append(helper.make_node("Conv", inputs, [f"c{i}"], kernel_shape=[k, k], pads=[k // 2] * 4))
        if activations[i]:
            nodes.append(helper.make_node(activations[i], [f"c{i}"], [f"a{i}"]))
        results.append(f"a{i}" if activations[i] else f"c{i}")
    nodes.append(helper.make_node("Concat", [results[i] for i in order], ["y"], axis=1))
    outputs = [tensor_info("y", None)] + ([tensor_info(results[0], None)] if also_read else [])
    return make_model(nodes, [tensor_info("x", ["N", channels, *size])], outputs, consts)


def _joined_convs(worker: ai.Worker) -> list:
    return [node.step.op for segment in worker._plan.segments for node in segment.nodes
            if node.layer.op_type == "JoinedConv"]


@pytest.mark.parametrize("variant", [{}, dict(order=(1, 0), last=64), dict(biases=(False, True)),
                                     dict(activations=(None, None)), dict(activations=("LeakyRelu", "LeakyRelu"))])
def test_convs_of_one_input_concatenated_run_as_one_conv(variant):
    """A 1x1 and a 3x3 conv of one input and their Concat become one ``JoinedConv`` that the panel
    kernel runs as one conv: the definition's values, batch after batch, no layer of the three run."""
    proto = _fire_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_joined_convs"] == 1
    assert [l.op_type for l in model.layers] == ["JoinedConv"]
    assert [l.op_type for l in model.layers[0].expansion] == ["Conv", "Conv", "Concat"]
    with ai.Worker(model, "cpu") as worker, ai.Worker(ai.load_model(proto, optimize=False), "cpu") as plain:
        for images in (1, 3, 1):
            x = RNG.standard_normal((images, FIRE_C, FIRE_H, FIRE_W)).astype(np.float32)
            got = worker.run_blocking(x)["y"]
            np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got, plain.run_blocking(x)["y"], rtol=1e-6, atol=1e-6)
        [op] = _joined_convs(worker)
    assert op._joined is not None and op._apart is None  # (one conv: the convs never ran apart)


@pytest.mark.parametrize("variant", [dict(first=20),                          # the 1x1's channels end mid-panel
                                     dict(activations=("Relu", None)),        # two activations
                                     dict(also_read=True)])                   # a result read elsewhere too
def test_convs_that_cannot_share_one_kernel_are_left_alone(variant):
    proto = _fire_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_joined_convs"] == 0
    x = RNG.standard_normal((2, FIRE_C, FIRE_H, FIRE_W)).astype(np.float32)
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_joined_convs_whose_deepest_takes_winograd_run_apart():
    """A 3x3 conv of 256 channels on a 24x24 map takes Winograd alone: the joined layer runs the
    convs one by one (then the Concat), as they ran before the fusion."""
    proto = _fire_model(channels=256, size=(24, 24), last=128)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_joined_convs"] == 1
    x = RNG.standard_normal((1, 256, 24, 24)).astype(np.float32)
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)["y"]
        [op] = _joined_convs(worker)
    assert op._joined is None and op._apart is not None
    # (Winograd's rounding: sums of 2304 taps of values near 1)
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=1e-3, atol=2e-3)


def test_joined_convs_on_gpu_pixel_run_the_layers_they_replaced_there():
    """(the convs and the Concat)"""
    _runs_its_expansion_on_gpu_pixel(_fire_model(), RNG.standard_normal((1, FIRE_C, FIRE_H, FIRE_W)).astype(np.float32),
                                     "fuse_joined_convs")


# -- joined convs and the max pool after them ---------------------------------------------------
def _fire_pool_model(*, pool: tuple[int, int] = (3, 2), pool_pads=(0, 0, 0, 0), ceil: int = 1,
                     also_read: bool = False, indices: bool = False, **fire) -> onnx.ModelProto:
    """`_fire_model` (``fire``) on a 15x21 map, its Concat's result → MaxPool (window, stride)
    ``pool``, ``pool_pads``, ``ceil`` (SqueezeNet 1.1's by default) → y. ``also_read``: the
    Concat's result is a graph output too; ``indices``: the pool gives its indices too."""
    proto = _fire_model(size=(15, 21), **fire)
    graph = proto.graph
    concat = graph.node[-1]
    concat.output[0] = "j"
    outputs = ["y", "i"] if indices else ["y"]
    graph.node.append(helper.make_node("MaxPool", ["j"], outputs, kernel_shape=[pool[0]] * 2,
                                       strides=[pool[1]] * 2, pads=list(pool_pads), ceil_mode=ceil))
    del graph.output[:]
    graph.output.extend([tensor_info(name, None) for name in outputs + (["j"] if also_read else [])])
    return proto


def _fire_pool_input(images: int, nan: bool) -> np.ndarray:
    x = RNG.standard_normal((images, FIRE_C, 15, 21)).astype(np.float32)
    if nan:
        x.flat[::29] = np.nan  # a NaN in a window makes its max NaN, both ways
    return x


@pytest.mark.parametrize("variant", [{}, dict(pool_pads=(1, 1, 1, 1), ceil=0), dict(activations=(None, None)),
                                     dict(last=40)])  # (the last panel of channels full)
def test_joined_convs_and_their_max_pool_are_one_layer(variant, monkeypatch):
    """``MaxPool(Concat(Relu(Conv1x1(x)), Relu(Conv3x3(x))))`` becomes one ``JoinedConvMaxPool``.
    On one thread (other requests keep the other cores busy: `parallel.crowded`) it runs the
    fused loop, a panel of channels at a time; a request alone on two threads may split the two
    layers instead. Either way: the very bits of the layers unfused, batch after batch, NaNs
    too, and the definition's values."""
    from asyncinfer.concurrency import parallel
    from asyncinfer.ops import conv_pool

    proto = _fire_pool_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_joined_convs"] == 1
    assert model.optimizations["fuse_joined_conv_max_pools"] == 1
    assert [l.op_type for l in model.layers] == ["JoinedConvMaxPool"]
    assert [l.op_type for l in model.layers[0].expansion] == ["Conv", "Conv", "Concat", "MaxPool"]
    fused_runs, fused_run = [], conv_pool.run_panel_conv_pool

    def counted(conv, pool, x):
        fused_runs.append(x.shape)
        return fused_run(conv, pool, x)
    monkeypatch.setattr(conv_pool, "run_panel_conv_pool", counted)
    with ai.Worker(model, "cpu", threads=2) as worker, ai.Worker(ai.load_model(proto, optimize=False), "cpu") as plain:
        [op] = [node.step.op for node in worker._plan.nodes if node.layer.op_type == "JoinedConvMaxPool"]
        for images in (1, 2, 1):
            for nan in (False, True):
                x = _fire_pool_input(images, nan)
                want = plain.run_blocking(x)["y"]
                np.testing.assert_array_equal(worker.run_blocking(x)["y"], want)
                operands = [model.constants.get(name) for name in model.layers[0].inputs[1:]]
                calls = len(fused_runs)
                with parallel.pool_bound(None, 1, None, lambda: True):
                    np.testing.assert_array_equal(op(x, *operands)[0], want)
                assert fused_runs[calls:] == [x.shape]  # (crowded: the fused loop, once)
                if not nan:  # (onnx.reference's MaxPool passes NaNs over)
                    np.testing.assert_allclose(want, ReferenceEvaluator(proto).run(None, {"x": x})[0],
                                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", [dict(also_read=True),  # the joined result read elsewhere too
                                     dict(pool=(2, 2)),  # not a 3x3/2 pool
                                     dict(indices=True)])  # the pool's indices wanted
def test_joined_convs_before_other_max_pools_stay_apart(variant):
    proto = _fire_pool_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_joined_convs"] == 1
    assert model.optimizations["fuse_joined_conv_max_pools"] == 0
    x = _fire_pool_input(2, False)
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)
    want = ReferenceEvaluator(proto).run(None, {"x": x})
    for name, value in zip([o.name for o in proto.graph.output], want):
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5)


def test_a_joined_conv_max_pool_on_gpu_pixel_runs_the_layers_it_replaced_there():
    """(the convs with their Relus, the Concat and the MaxPool)"""
    _runs_its_expansion_on_gpu_pixel(_fire_pool_model(), _fire_pool_input(1, False), "fuse_joined_conv_max_pools")


# -- 1x1 convs of one input side by side ---------------------------------------------------------
def _sibling_1x1_model(*, widths=(24, 40, 8), activations=("Relu", "Relu", "Relu"), biases=(True, True, True),
                       kernels=(1, 1, 1), strides=(1, 1, 1), shared_weight: bool = False,
                       summed: bool = False) -> onnx.ModelProto:
    """x (N, 16, 9, 11) → a Conv per entry (``widths`` channels, ``kernels`` windows padded to the
    map, ``strides``), each with its activation → the outputs y0, y1, … (``summed``: y = their
    sum, the widths equal). ``shared_weight``: the first two convs read one weight."""
    rng = np.random.default_rng(9)
    consts, nodes, results = [], [], []
    for i, (m, k, s) in enumerate(zip(widths, kernels, strides)):
        weight = "w0" if shared_weight and i == 1 else f"w{i}"
        if weight == f"w{i}":
            consts.append(_const(weight, rng.standard_normal((m, FIRE_C, k, k)) * 0.2))
        inputs = ["x", weight]
        if biases[i]:
            consts.append(_const(f"b{i}", rng.standard_normal(m)))
            inputs.append(f"b{i}")
        nodes.append(helper.make_node("Conv", inputs, [f"c{i}"], kernel_shape=[k, k], pads=[k // 2] * 4,
                                      strides=[s, s]))
        result = f"c{i}"
        if activations[i]:
            nodes.append(helper.make_node(activations[i], [f"c{i}"], [f"y{i}" if not summed else f"a{i}"]))
            result = f"y{i}" if not summed else f"a{i}"
        results.append(result)
    if summed:
        nodes.append(helper.make_node("Sum", results, ["y"]))
        outputs = [tensor_info("y", None)]
    else:
        outputs = [tensor_info(r, None) for r in results]
    return make_model(nodes, [tensor_info("x", ["N", FIRE_C, FIRE_H, FIRE_W])], outputs, consts)


@pytest.mark.parametrize("variant", [{}, dict(biases=(False, False, False)), dict(activations=(None, None, None))])
def test_one_inputs_1x1_convs_join_into_one_conv_and_a_split(variant):
    """Inception's 1x1 convs of a module's input: one conv on the joined weights, a Split into the
    convs' outputs; the definition's values, batch after batch."""
    proto = _sibling_1x1_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_sibling_convs"] == 1
    assert [l.op_type for l in model.layers] == ["Conv", "Split"]
    assert model.constants[model.layers[0].inputs[1]].shape == (72, FIRE_C, 1, 1)
    with ai.Worker(model, "cpu") as worker, ai.Worker(ai.load_model(proto, optimize=False), "cpu") as plain:
        for images in (1, 3):
            x = RNG.standard_normal((images, FIRE_C, FIRE_H, FIRE_W)).astype(np.float32)
            got = worker.run_blocking(x)
            expected = ReferenceEvaluator(proto).run(None, {"x": x})
            apart = plain.run_blocking(x)
            for i, want in enumerate(expected):
                name = proto.graph.output[i].name
                np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(got[name], apart[name], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant, joined", [(dict(activations=("Relu", None, "Relu")), 1),   # the two with Relu
                                             (dict(biases=(True, False, True)), 1),           # the two with biases
                                             (dict(kernels=(1, 3, 1)), 1),                     # the two 1x1s
                                             (dict(strides=(1, 2, 2)), 0),                     # strided
                                             (dict(shared_weight=True, widths=(24, 24, 8)), 0)])  # one weight, two convs
def test_only_1x1_convs_alike_join(variant, joined):
    proto = _sibling_1x1_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_sibling_convs"] == joined
    x = RNG.standard_normal((2, FIRE_C, FIRE_H, FIRE_W)).astype(np.float32)
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)
    for i, want in enumerate(ReferenceEvaluator(proto).run(None, {"x": x})):
        np.testing.assert_allclose(got[proto.graph.output[i].name], want, rtol=1e-5, atol=1e-5)


def test_joined_1x1_convs_run_on_gpu_pixel_as_a_conv_and_a_split():
    """(standard ops: gpu_pixel runs them itself, the split mid-texel: 6 channels each)"""
    _runs_its_expansion_on_gpu_pixel(_sibling_1x1_model(widths=(6, 6), activations=("Relu", "Relu"),
                                                        biases=(True, True), kernels=(1, 1), strides=(1, 1),
                                                        summed=True),
                                     RNG.standard_normal((1, FIRE_C, FIRE_H, FIRE_W)).astype(np.float32),
                                     "fuse_sibling_convs")


def test_a_concat_of_1x1_convs_alone_is_joined_as_siblings_not_as_one_direct_conv():
    """Concat(1x1, 1x1) of one input: the 1x1 kernel's way (one conv, a Split, the Concat), not a
    `JoinedConv` that would only run its convs apart."""
    proto = _fire_model()
    for node in proto.graph.node:
        if node.op_type == "Conv":
            del node.attribute[:]
            node.attribute.extend([helper.make_attribute("kernel_shape", [1, 1])])
    w1 = next(t for t in proto.graph.initializer if t.name == "w1")
    w1.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w1)[:, :, 1:2, 1:2].copy(), "w1"))
    model = ai.load_model(proto)
    assert model.optimizations["fuse_joined_convs"] == 0 and model.optimizations["fuse_sibling_convs"] == 1
    x = RNG.standard_normal((1, FIRE_C, FIRE_H, FIRE_W)).astype(np.float32)
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(x)["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)


# -- a residual Add after a conv -------------------------------------------------------------------
RES_C = 24


def _residual_model(*, op: str = "Add", conv_first: bool = True, activation: str | None = "Relu",
                    conv_activation: bool = False, also_read: bool = False, residual_shape=None,
                    bias: bool = True, group: int = 1) -> onnx.ModelProto:
    """x (N, 24, 9, 11) → Conv 1x1 (24 channels, ``group``) [+ Relu of its own] → ``op``(conv, x)
    (or (x, conv)), ``residual_shape``: the residual another input of that shape instead of x)
    [→ ``activation``] → y: the end of a residual block. ``also_read``: the conv's result is a
    graph output too."""
    rng = np.random.default_rng(13)
    consts = [_const("w", rng.standard_normal((RES_C, RES_C // group, 1, 1)) * 0.3)]
    inputs = ["x", "w"]
    if bias:
        consts.append(_const("b", rng.standard_normal(RES_C)))
        inputs.append("b")
    nodes = [helper.make_node("Conv", inputs, ["c"], kernel_shape=[1, 1], group=group)]
    result = "c"
    if conv_activation:
        nodes.append(helper.make_node("Relu", ["c"], ["cr"]))
        result = "cr"
    residual = "x" if residual_shape is None else "r"
    nodes.append(helper.make_node(op, [result, residual] if conv_first else [residual, result],
                                  ["s" if activation else "y"]))
    if activation:
        nodes.append(helper.make_node(activation, ["s"], ["y"]))
    graph_inputs = [tensor_info("x", ["N", RES_C, 9, 11])]
    if residual_shape is not None:
        graph_inputs.append(tensor_info("r", list(residual_shape)))
    outputs = [tensor_info("y", None)] + ([tensor_info(result, None)] if also_read else [])
    return make_model(nodes, graph_inputs, outputs, consts)


def _residual_feeds(proto, images: int) -> dict:
    feeds = {"x": RNG.standard_normal((images, RES_C, 9, 11)).astype(np.float32)}
    for info in proto.graph.input[1:]:
        feeds[info.name] = RNG.standard_normal([d.dim_value for d in info.type.tensor_type.shape.dim]).astype(np.float32)
    return feeds


@pytest.mark.parametrize("variant", [{}, dict(conv_first=False), dict(op="Sum"), dict(activation=None),
                                     dict(activation="LeakyRelu"), dict(bias=False), dict(group=4)])
def test_a_residual_add_after_a_conv_is_added_in_place(variant):
    """``Relu(Add(Conv(x), x))`` becomes one ``ResidualConv+Relu``: the definition's values, and the
    very bits of the two layers unfused, batch after batch."""
    proto = _residual_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_residual_adds"] == 1
    assert [l.op_type for l in model.layers] == ["ResidualConv"]
    assert [l.op_type for l in model.layers[0].expansion] == ["Conv", variant.get("op", "Add")]
    with ai.Worker(model, "cpu") as worker, ai.Worker(ai.load_model(proto, optimize=False), "cpu") as plain:
        for images in (1, 3):
            feeds = _residual_feeds(proto, images)
            got = worker.run_blocking(feeds)["y"]
            np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(got, plain.run_blocking(feeds)["y"])


@pytest.mark.parametrize("variant, fused", [(dict(conv_activation=True), 0),  # the conv's own Relu before the sum
                                            (dict(also_read=True), 0),  # the conv's result read elsewhere too
                                            (dict(residual_shape=(1, RES_C, 1, 1)), 1)])  # a residual that broadcasts
def test_other_residual_cases_keep_the_definitions_values(variant, fused):
    """A conv whose result is not the sum's alone keeps its two layers; a bias-like residual is
    fused at load and summed by the Add's own broadcasting at run time."""
    proto = _residual_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_residual_adds"] == fused
    feeds = _residual_feeds(proto, 2)
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking(feeds)["y"]
    np.testing.assert_allclose(got, ReferenceEvaluator(proto).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


def test_a_residual_conv_on_gpu_pixel_runs_the_layers_it_replaced_there():
    """(the Conv and the Add)"""
    _runs_its_expansion_on_gpu_pixel(_residual_model(), RNG.standard_normal((1, RES_C, 9, 11)).astype(np.float32),
                                     "fuse_residual_adds")


# -- a stem conv and the max pool after it ----------------------------------------------------------
STEM_SIZE = (29, 37)


def _stem_model(*, channels: int = 20, kernel: int = 3, stride: int = 2, pad: int = 1, cin: int = 3,
                activation: str | None = "Relu", pool: tuple[int, int] = (3, 2), pool_pads=(1, 1, 1, 1), ceil: int = 0,
                also_read: bool = False, bias: bool = True) -> onnx.ModelProto:
    """x (N, ``cin``, 29, 37) → Conv ``kernel``/``stride`` (``channels``, pads ``pad``) [→
    ``activation``] → MaxPool (window, stride) ``pool``, ``pool_pads``, ``ceil`` → y: a network's
    stem. ``also_read``: the pool's input is a graph output too."""
    rng = np.random.default_rng(17)
    consts = [_const("w", rng.standard_normal((channels, cin, kernel, kernel)) * 0.3)]
    inputs = ["x", "w"]
    if bias:
        consts.append(_const("b", rng.standard_normal(channels)))
        inputs.append("b")
    nodes = [helper.make_node("Conv", inputs, ["c"], kernel_shape=[kernel, kernel], strides=[stride, stride],
                              pads=[pad] * 4)]
    pooled = "c"
    if activation:
        nodes.append(helper.make_node(activation, ["c"], ["a"]))
        pooled = "a"
    nodes.append(helper.make_node("MaxPool", [pooled], ["y"], kernel_shape=[pool[0]] * 2, strides=[pool[1]] * 2,
                                  pads=list(pool_pads), ceil_mode=ceil))
    outputs = [tensor_info("y", None)] + ([tensor_info(pooled, None)] if also_read else [])
    return make_model(nodes, [tensor_info("x", ["N", cin, *STEM_SIZE])], outputs, consts)


def _stem_input(images: int) -> np.ndarray:
    x = RNG.standard_normal((images, 3, *STEM_SIZE)).astype(np.float32)
    x.flat[::23] = np.nan  # a NaN in a window makes its max NaN, both ways
    return x


@pytest.mark.parametrize("variant", [{}, dict(channels=64), dict(activation=None), dict(activation="LeakyRelu"),
                                     dict(bias=False), dict(pool_pads=(0, 0, 0, 0), ceil=1),  # SqueezeNet's
                                     dict(kernel=1, pad=0)])  # (no direct kernel: the two layers' way)
def test_a_stem_conv_and_its_max_pool_are_one_layer(variant, monkeypatch):
    """``MaxPool(Relu(Conv(x)))`` becomes one ``ConvMaxPool+Relu``. A request alone runs it as the
    two layers; under concurrent requests (another thread working: `parallel.crowded`) the fused
    loop: the very bits of the two layers unfused, batch after batch, and the definition's values."""
    from asyncinfer import ops
    from asyncinfer.concurrency import parallel
    from asyncinfer.ops import conv_pool

    proto = _stem_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_conv_max_pools"] == 1
    layer = model.layers[0]
    assert [l.op_type for l in model.layers] == ["ConvMaxPool"]
    assert [l.op_type for l in layer.expansion] == ["Conv", "MaxPool"]
    op = ops.create(layer)
    activations = tuple((ops.create(f), []) for f in layer.fused)
    fused_runs, fused_run = [], conv_pool.run_conv_pool

    def counted(plan, x):
        fused_runs.append(x.shape)
        return fused_run(plan, x)
    monkeypatch.setattr(conv_pool, "run_conv_pool", counted)
    weights = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    with ai.Worker(model, "cpu") as worker, ai.Worker(ai.load_model(proto, optimize=False), "cpu") as plain:
        for images in (1, 2):
            clean = RNG.standard_normal((images, 3, *STEM_SIZE)).astype(np.float32)
            for x in (clean, _stem_input(images)):
                want = plain.run_blocking(x)["y"]
                np.testing.assert_array_equal(worker.run_blocking(x)["y"], want)
                with parallel.pool_bound(None, 1, None, lambda: True), np.errstate(all="ignore"):
                    crowded = op(x, weights["w"], weights.get("b"), activations=activations)[0]
                np.testing.assert_array_equal(crowded, want)
                # as a job calls it (`Op.bound_run`), run after run: the pool too, not the conv's
                # short way alone (the conv's short way once stood for the whole layer there)
                bound = op.bound_run(activations) if activations else op.bound_run()
                for _ in range(3):
                    np.testing.assert_array_equal(bound([x, weights["w"], weights.get("b")])[0], want)
            # (onnx.reference's MaxPool passes NaNs over: compared on the input without any)
            np.testing.assert_allclose(plain.run_blocking(clean)["y"], ReferenceEvaluator(proto).run(None, {"x": clean})[0],
                                       rtol=1e-5, atol=1e-5)
    direct = variant.get("kernel", 3) > 1
    assert len(fused_runs) == (4 if direct else 0)


@pytest.mark.parametrize("variant", [dict(also_read=True),  # the pool's input read elsewhere too
                                     dict(pool=(2, 2), pool_pads=(0, 0, 0, 0)),  # not a 3x3/2 pool
                                     dict(cin=8),  # not a stem: the direct kernel takes 4 channels at most
                                     dict(kernel=7, pad=3, channels=24)])  # ResNet's 7x7 stem: slower fused
def test_other_convs_before_a_max_pool_keep_their_two_layers(variant):
    proto = _stem_model(**variant)
    model = ai.load_model(proto)
    assert model.optimizations["fuse_conv_max_pools"] == 0
    assert "ConvMaxPool" not in [l.op_type for l in model.layers]
    x = RNG.standard_normal((2, variant.get("cin", 3), *STEM_SIZE)).astype(np.float32)
    with ai.Worker(model, "cpu") as worker:
        np.testing.assert_allclose(worker.run_blocking(x)["y"], ReferenceEvaluator(proto).run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-5)


def test_a_conv_max_pool_on_gpu_pixel_runs_the_layers_it_replaced_there():
    """(the Conv with its Relu, and the MaxPool)"""
    _runs_its_expansion_on_gpu_pixel(_stem_model(), RNG.standard_normal((1, 3, *STEM_SIZE)).astype(np.float32),
                                     "fuse_conv_max_pools")
