"""Optimizer passes: each one rewrites what it should and never changes results beyond rounding."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
from asyncinfer.loader import optimize as optimizer
from asyncinfer.model.ir import Layer, Model, TensorInfo
from conftest import make_model, shape_arithmetic_model, tensor_info


def _run(model, *inputs):
    with ai.Worker(model) as worker:
        return worker.run_blocking(*inputs)


def test_constant_of_shape_weights_are_folded():
    shape = numpy_helper.from_array(np.array([3], np.int64), "shape")
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["w"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])),
             helper.make_node("Mul", ["x", "w"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [3])], [tensor_info("y", [3])], [shape], extra_domains=())
    model = ai.load_model(proto)
    assert [l.op_type for l in model.layers] == ["Mul"]
    assert model.optimizations["fold_constants"] == 1
    np.testing.assert_array_equal(model.constants["w"], [0.5, 0.5, 0.5])
    assert not model.constants["w"].flags.writeable  # shared by every run: immutable
    np.testing.assert_array_equal(_run(model, np.ones(3, np.float32))["y"], [0.5] * 3)


def test_shape_of_static_value_is_folded_and_reshape_target_becomes_constant():
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Reshape", ["x", "s"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [2, 3])], [tensor_info("y", [2, 3])], extra_domains=())
    model = ai.load_model(proto)
    assert [l.op_type for l in model.layers] == ["Reshape"]
    np.testing.assert_array_equal(model.constants["s"], [2, 3])


def test_dead_layers_and_identities_are_removed():
    nodes = [helper.make_node("Identity", ["x"], ["i"]),
             helper.make_node("Dropout", ["i"], ["d"]),
             helper.make_node("Relu", ["d"], ["y"]),
             helper.make_node("Exp", ["x"], ["unused"])]
    proto = make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])], extra_domains=())
    model = ai.load_model(proto)
    assert [l.op_type for l in model.layers] == ["Relu"]
    assert model.layers[0].inputs == ["x"]
    assert ai.load_model(proto, optimize=False).layers.__len__() == 4


@pytest.mark.parametrize("mask_read", [False, True])
def test_a_dropout_whose_mask_nobody_reads_is_removed(mask_read):
    """A named mask output that no layer and no graph output reads does not keep the Dropout;
    one that is read does (its value, a mask of ones, is part of the result)."""
    nodes = [helper.make_node("Dropout", ["x"], ["d", "mask"], ratio=0.5),
             helper.make_node("Relu", ["d"], ["y"])]
    outputs = [tensor_info("y", [2])]
    if mask_read:
        nodes.append(helper.make_node("Cast", ["mask"], ["m"], to=TensorProto.FLOAT))
        outputs.append(tensor_info("m", [2]))
    proto = make_model(nodes, [tensor_info("x", [2])], outputs, extra_domains=())
    model = ai.load_model(proto)
    assert ("Dropout" in [l.op_type for l in model.layers]) == mask_read
    x = np.array([-1.0, 2.0], np.float32)
    with ai.Worker(model, "cpu") as worker:
        result = worker.run_blocking(x)
    np.testing.assert_array_equal(result["y"], [0.0, 2.0])
    if mask_read:
        np.testing.assert_array_equal(result["m"], [1.0, 1.0])


def _conv_bn_relu_model(rng):
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    bn = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in
          [("scale", rng.uniform(0.5, 2, 4)), ("beta", rng.standard_normal(4)),
           ("mean", rng.standard_normal(4)), ("var", rng.uniform(0.5, 2, 4))]]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["n"], epsilon=1e-3),
             helper.make_node("Relu", ["n"], ["y"])]
    return make_model(nodes, [tensor_info("x", [1, 3, 8, 8])], [tensor_info("y", [1, 4, 8, 8])], [w, b] + bn,
                      extra_domains=())


def test_conv_batchnorm_folding_and_relu_fusion_keep_results(rng):
    proto = _conv_bn_relu_model(rng)
    optimized = ai.load_model(proto)
    plain = ai.load_model(proto, optimize=False)
    assert [l.kind for l in optimized.layers] == ["Conv+Relu"]
    assert optimized.optimizations["fold_affine"] == 1 and optimized.optimizations["fuse_activations"] == 1
    assert [l.op_type for l in plain.layers] == ["Conv", "BatchNormalization", "Relu"]
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(optimized, x)["y"], _run(plain, x)["y"], rtol=1e-5, atol=1e-5)


def test_weights_a_pass_replaced_are_dropped(rng):
    optimized = ai.load_model(_conv_bn_relu_model(rng))
    # (the conv's weight and bias and the four of the BatchNormalization: only the folded pair is read)
    assert optimized.optimizations["drop_unread_constants"] == 6
    assert set(optimized.constants) == set(optimized.layers[0].inputs[1:])


def test_constants_still_read_by_a_fused_part_an_expansion_or_an_output_stay():
    f32 = np.dtype(np.float32)
    relu = Layer("act", "PRelu", ["y", "slope"], ["y"])
    original = Layer("orig", "Mul", ["x", "w_orig"], ["y"])
    fused = Layer("joined", "Mul", ["x", "w_joined"], ["y"], fused=[relu], expansion=[original])
    constants = {name: np.ones(2, f32) for name in ("slope", "w_orig", "w_joined", "gone", "out_c")}
    model = Model(inputs=[TensorInfo("x", f32, (2,))], layers=[fused], constants=constants, opsets={"": 17},
                  outputs=[TensorInfo("y", f32, (2,)), TensorInfo("out_c", f32, (2,))])
    assert optimizer.drop_unread_constants(model) == 1
    assert sorted(model.constants) == ["out_c", "slope", "w_joined", "w_orig"]


def test_fusion_skipped_when_the_intermediate_is_an_output():
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Relu", ["a"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [2])], [tensor_info("a", [2]), tensor_info("y", [2])],
                       extra_domains=())
    model = ai.load_model(proto)
    assert [l.kind for l in model.layers] == ["Add", "Relu"]
    out = _run(model, np.array([-1, 2], np.float32))
    np.testing.assert_array_equal(out["a"], [-2, 4])
    np.testing.assert_array_equal(out["y"], [0, 4])


def test_cpu_bound_analysis_marks_shape_producers():
    # shape = Concat(Shape(x)[0:1], [-1]) feeds Reshape: Shape/Slice/Concat are CPU-bound, Relu is not.
    proto = shape_arithmetic_model()
    model = ai.load_model(proto)
    marks = {l.name: l.cpu_bound for l in model.layers}
    assert marks == {"relu": False, "shape": True, "slice": True, "concat": True, "reshape": False}
    assert "target" in model.cpu_bound_values
    x = np.arange(12, dtype=np.float32).reshape(2, 2, 3) - 5
    np.testing.assert_array_equal(_run(model, x)["y"], np.maximum(x, 0).reshape(2, 6))


@pytest.mark.parametrize("optimize", [True, False])
def test_digits_model_same_results_with_and_without_optimizer(optimize, digits_samples, digits_model):
    images, _ = digits_samples
    model = ai.load_model(__import__("asyncinfer.assets", fromlist=["x"]).default_model_path(), optimize=optimize)
    got = _run(model, images[:16])["logits"]
    ref = _run(digits_model, images[:16])["logits"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_clip_with_constant_bounds_fuses_like_relu6():
    lo = numpy_helper.from_array(np.array(0, np.float32), "lo")
    hi = numpy_helper.from_array(np.array(6, np.float32), "hi")
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]), helper.make_node("Clip", ["a", "lo", "hi"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [4])], [tensor_info("y", [4])], [lo, hi], extra_domains=())
    model = ai.load_model(proto)
    assert [l.kind for l in model.layers] == ["Add+Clip"]
    np.testing.assert_array_equal(_run(model, np.array([-1, 1, 2, 5], np.float32))["y"], [0, 2, 4, 6])


def test_a_concat_takes_the_activation_after_it():
    """ShuffleNet's ``Relu(Concat(pool, branch))``: one ``Concat+Relu`` layer, the activation run in
    place on the fresh concatenation; a concatenation read twice keeps its own Relu layer."""
    nodes = [helper.make_node("Concat", ["x", "x2"], ["c"], axis=1), helper.make_node("Relu", ["c"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [1, 2, 3]), tensor_info("x2", [1, 3, 3])],
                       [tensor_info("y", [1, 5, 3])], extra_domains=())
    model = ai.load_model(proto)
    assert [l.kind for l in model.layers] == ["Concat+Relu"]
    x, x2 = np.arange(-3, 3, dtype=np.float32).reshape(1, 2, 3), np.arange(-4, 5, dtype=np.float32).reshape(1, 3, 3)
    with ai.Worker(model, "cpu") as worker:
        got = worker.run_blocking({"x": x, "x2": x2})["y"]
    np.testing.assert_array_equal(got, np.maximum(np.concatenate([x, x2], axis=1), 0))
    proto.graph.output.append(tensor_info("c", [1, 5, 3]))
    assert [l.kind for l in ai.load_model(proto).layers] == ["Concat", "Relu"]


def test_per_channel_mul_add_fold_into_conv_and_batchnorm(rng):
    """Caffe2 exports spell BatchNormalization as Mul/Add by [C,1,1] constants: fold them all."""
    c = lambda name, *shape: numpy_helper.from_array(rng.uniform(0.5, 1.5, shape).astype(np.float32), name)  # noqa: E731
    inits = [c("w", 4, 3, 3, 3), c("b", 4), c("s1", 4, 1, 1), c("t1", 4, 1, 1), c("s2", 1),
             c("scale", 4), c("beta", 4), c("mean", 4), c("var", 4), c("s3", 4, 1, 1), c("t3", 4, 1, 1)]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Mul", ["c", "s1"], ["m1"]), helper.make_node("Add", ["t1", "m1"], ["a1"]),
             helper.make_node("Div", ["a1", "s2"], ["d1"]), helper.make_node("Relu", ["d1"], ["r1"]),
             helper.make_node("BatchNormalization", ["r1", "scale", "beta", "mean", "var"], ["n"]),
             helper.make_node("Mul", ["n", "s3"], ["m3"]), helper.make_node("Sub", ["m3", "t3"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [1, 3, 6, 6])], [tensor_info("y", [1, 4, 6, 6])], inits,
                       extra_domains=())
    optimized = ai.load_model(proto)
    assert [l.kind for l in optimized.layers] == ["Conv+Relu", "BatchNormalization"]
    assert optimized.optimizations["fold_affine"] == 5
    x = rng.standard_normal((1, 3, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(_run(optimized, x)["y"], _run(ai.load_model(proto, optimize=False), x)["y"],
                               rtol=1e-5, atol=1e-5)


def test_non_channel_constants_are_not_folded(rng):
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype(np.float32), "w")
    spatial = numpy_helper.from_array(rng.standard_normal((1, 1, 5)).astype(np.float32), "spatial")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Mul", ["c", "spatial"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [1, 3, 5, 5])], [tensor_info("y", [1, 4, 5, 5])], [w, spatial],
                       extra_domains=())
    assert [l.kind for l in ai.load_model(proto).layers] == ["Conv", "Mul"]


def _float16_cnn(rng):
    """Conv → BatchNormalization → Relu → Flatten → Gemm → MatMul(constant, activation), all float16."""
    f16 = TensorProto.FLOAT16
    const = {"w": rng.standard_normal((4, 3, 3, 3)), "b": rng.standard_normal(4),
             "scale": rng.uniform(0.5, 1.5, 4), "beta": rng.standard_normal(4), "mean": rng.standard_normal(4),
             "var": rng.uniform(0.5, 1.5, 4), "g": rng.standard_normal((4 * 6 * 6, 5)) * 0.1,
             "gb": rng.standard_normal(5), "left": rng.standard_normal((3, 2))}
    inits = [numpy_helper.from_array(v.astype(np.float16), k) for k, v in const.items()]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["n"]),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("Flatten", ["r"], ["f"]),
             helper.make_node("Gemm", ["f", "g", "gb"], ["h"]),
             helper.make_node("Reshape", ["h", "shape"], ["h2"]),
             helper.make_node("MatMul", ["left", "h2"], ["y"])]
    inits.append(numpy_helper.from_array(np.array([2, 5], np.int64), "shape"))
    return make_model(nodes, [tensor_info("x", [2, 3, 6, 6], f16)], [tensor_info("y", [3, 5], f16)], inits,
                      extra_domains=())


def test_float16_model_computes_in_float32_and_rounds_once(rng):
    from onnx.reference import ReferenceEvaluator

    proto = _float16_cnn(rng)
    model = ai.load_model(proto)
    assert model.optimizations["promote_narrow_floats"] == 1
    assert model.optimizations["fold_affine"] == 1  # BatchNormalization folded into the (now float32) Conv
    assert all(v.dtype != np.float16 for v in model.constants.values() if isinstance(v, np.ndarray))
    assert [l.op_type for l in model.layers][0] == "Cast" and [l.op_type for l in model.layers][-1] == "Cast"
    assert model.inputs[0].dtype == np.float16 and model.outputs[0].dtype == np.float16  # the signature stays
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float16)
    got = _run(model, x)["y"]
    want = ReferenceEvaluator(proto).run(None, {"x": x})[0]
    assert got.dtype == np.float16 and got.shape == (3, 5)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2)
    # and the same as the float32 model rounded once
    proto32 = _float16_cnn(np.random.default_rng(0))
    for init in proto32.graph.initializer:
        if init.data_type == TensorProto.FLOAT16:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float32), init.name))
    for info in list(proto32.graph.input) + list(proto32.graph.output):
        info.type.tensor_type.elem_type = TensorProto.FLOAT
    same = ai.load_model(_float16_cnn(np.random.default_rng(0)))
    np.testing.assert_array_equal(_run(same, x)["y"], _run(ai.load_model(proto32), x.astype(np.float32))["y"].astype(np.float16))


def test_float16_type_attributes_follow_the_promotion():
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Cast", ["m"], ["c"], to=TensorProto.FLOAT16),
             helper.make_node("Add", ["c", "w"], ["y"])]
    w = numpy_helper.from_array(np.eye(2, dtype=np.float16) * 3, "w")
    proto = make_model(nodes, [tensor_info("x", [2, 2], TensorProto.FLOAT16)],
                       [tensor_info("y", [2, 2], TensorProto.FLOAT16)], [w], extra_domains=())
    model = ai.load_model(proto)
    cast = next(l for l in model.layers if l.name != "y::round" and l.op_type == "Cast" and l.inputs == ["m"])
    assert cast.attrs["to"] == TensorProto.FLOAT
    x = np.array([[1, 2], [3, 4]], np.float16)
    np.testing.assert_array_equal(_run(model, x)["y"], (x @ (np.eye(2) * 3) + np.eye(2) * 3).astype(np.float16))


def test_narrow_weights_are_widened_where_the_model_is_not_promoted(rng):
    from asyncinfer.loader.optimize import widen_narrow_weights

    w = numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float16), "w")
    v = numpy_helper.from_array(rng.standard_normal((3, 3)).astype(np.float16), "v")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "v"], ["a"]),
             helper.make_node("MatMul", ["a", "v"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [3, 3], TensorProto.FLOAT16)],
                       [tensor_info("y", [3, 3], TensorProto.FLOAT16)], [w, v], extra_domains=())
    model = ai.load_model(proto, optimize=False)
    assert widen_narrow_weights(model) == 1  # w; v is also read by Add, which computes in float16
    assert model.constants["w"].dtype == np.float32 and model.constants["v"].dtype == np.float16
    x = np.eye(3, dtype=np.float16)
    got = _run(model, x)["y"]
    assert got.dtype == np.float16
    want = (((x.astype(np.float32) @ model.constants["w"]).astype(np.float16) + model.constants["v"]).astype(np.float32)
            @ model.constants["v"].astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_gemm_weights_are_stored_untransposed(rng, rows):
    """A Gemm with transB=1 on a constant weight read by it alone gets the weight transposed, C
    ordered, and transB=0 (its few-row products then run the compiled kernel); a weight another
    layer reads stays. Results equal onnx.reference on the original graph."""
    from onnx.reference import ReferenceEvaluator

    w = numpy_helper.from_array(rng.standard_normal((64, 96)).astype(np.float32), "w")  # (N, K)
    shared = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "shared")
    c = numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "c")
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["h"], transB=1, alpha=0.5, beta=2.0),
             helper.make_node("Gemm", ["h", "shared"], ["g"], transB=1),
             helper.make_node("MatMul", ["g", "shared"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", ["rows", 96])], [tensor_info("y", ["rows", 64])], [w, shared, c],
                       extra_domains=())
    model = ai.load_model(proto)
    assert model.optimizations["untranspose_gemm_weights"] == 1
    first, second = (l for l in model.layers if l.op_type == "Gemm")
    assert first.attrs["transB"] == 0 and second.attrs["transB"] == 1
    weight = model.constants["w"]
    assert weight.shape == (96, 64) and weight.flags.c_contiguous and not weight.flags.writeable
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    expected = ReferenceEvaluator(proto).run(None, {"x": x})[0]  # (values up to ~500: float32 sums)
    np.testing.assert_allclose(_run(model, x)["y"], expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())


def _run_both(proto, x):
    """Outputs of ``proto`` with and without the optimizer."""
    results = []
    for optimize in (True, False):
        with ai.Worker(ai.load_model(proto, optimize=optimize), "cpu") as worker:
            results.append(worker.run_blocking(x)["y"])
    return results


def test_activation_read_through_a_reshape_moves_before_it_and_fuses_into_the_gemm(rng):
    """GPT-2's MLP: ``Gemm → Reshape (3-D) → Gelu → Reshape (2-D) → Gemm``: the Gelu moves before
    the first Reshape and runs inside the Gemm, and the Reshape left between the two Gemms goes
    into the first (``fuse_gemm_reshapes``); the result is unchanged."""
    w1, w2 = (numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) / 4, n)
              for n, s in (("w1", (8, 16)), ("w2", (16, 8))))
    shapes = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("s3", [2, 3, 16]), ("s2", [-1, 16]))]
    nodes = [helper.make_node("Gemm", ["x", "w1"], ["g"]), helper.make_node("Reshape", ["g", "s3"], ["r"]),
             helper.make_node("Gelu", ["r"], ["a"]), helper.make_node("Reshape", ["a", "s2"], ["r2"]),
             helper.make_node("Gemm", ["r2", "w2"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [6, 8])], [tensor_info("y", [6, 8])], [w1, w2, *shapes],
                       opset=20, extra_domains=())
    model = ai.load_model(proto)
    assert model.optimizations["simplify_reshapes"] == 2  # the Gelu moved, then the two Reshapes merged
    assert [l.kind for l in model.layers] == ["ReshapedGemm+Gelu", "Gemm"]
    x = rng.standard_normal((6, 8)).astype(np.float32)
    optimized, plain = _run_both(proto, x)
    np.testing.assert_array_equal(optimized, plain)


def test_activation_moved_before_a_reshape_keeps_the_graph_in_order(rng):
    """``Reshape → Relu`` where the Relu's result is a graph output (nothing to fuse into): the
    Relu runs first, then the Reshape, and the output is unchanged."""
    target = numpy_helper.from_array(np.array([4, 6], np.int64), "s")
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [3, 8])], [tensor_info("y", [4, 6])], [target], extra_domains=())
    model = ai.load_model(proto)
    assert [l.op_type for l in model.layers] == ["Relu", "Reshape"]
    x = rng.standard_normal((3, 8)).astype(np.float32)
    optimized, plain = _run_both(proto, x)
    np.testing.assert_array_equal(optimized, plain)


@pytest.mark.parametrize("target,merged", [([4, 6], True), ([0, 3, 4], False)])
def test_reshape_of_a_reshape_merges_unless_the_target_copies_a_dimension(rng, target, merged):
    shapes = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("s1", [2, 12]), ("s2", target))]
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["r"]), helper.make_node("Reshape", ["r", "s2"], ["y"])]
    proto = make_model(nodes, [tensor_info("x", [3, 8])], [tensor_info("y", None)], shapes, extra_domains=())
    model = ai.load_model(proto)
    assert [l.op_type for l in model.layers] == ["Reshape"] * (1 if merged else 2)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    optimized, plain = _run_both(proto, x)
    assert optimized.shape == plain.shape
    np.testing.assert_array_equal(optimized, plain)


def test_a_reshape_whose_result_a_shape_also_reads_stays_for_it(rng):
    """The outer Reshape reads x directly; the inner one stays only for the Shape."""
    shapes = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("s1", [-1, 12]), ("s2", [4, 6]))]
    nodes = [helper.make_node("Reshape", ["x", "s1"], ["r"], name="inner"),
             helper.make_node("Reshape", ["r", "s2"], ["y"], name="outer"),
             helper.make_node("Shape", ["r"], ["shape"], name="shape")]
    proto = make_model(nodes, [tensor_info("x", ["n", 8])], [tensor_info("y", None), tensor_info("shape", None, TensorProto.INT64)],
                       shapes, extra_domains=())
    model = ai.load_model(proto)
    outer = next(l for l in model.layers if l.name == "outer")
    assert outer.inputs[0] == "x" and "inner" in [l.name for l in model.layers]
    x = rng.standard_normal((3, 8)).astype(np.float32)
    with ai.Worker(model, "cpu") as worker:
        out = worker.run_blocking(x)
    np.testing.assert_array_equal(out["y"], x.reshape(4, 6))
    np.testing.assert_array_equal(out["shape"], [2, 12])
