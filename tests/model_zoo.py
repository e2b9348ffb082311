"""Models for end-to-end tests: the ONNX light zoo, with their shipped or random weights, and
small hand-built networks of the common architectures (transformer block, RNNs, decoder)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

LIGHT_DIR = Path(os.path.dirname(onnx.__file__)) / "backend" / "test" / "data" / "light"
# (name, rtol, atol) exactly as onnx.backend.test.case.model lists them
LIGHT_MODELS = [("bvlc_alexnet", 1e-3, 1e-7), ("densenet121", 2e-3, 1e-7), ("inception_v1", 1e-3, 1e-7),
                ("inception_v2", 1e-3, 1e-7), ("resnet50", 1e-3, 1e-7), ("shufflenet", 1e-3, 1e-7),
                ("squeezenet", 1e-3, 1e-7), ("vgg19", 1e-3, 1e-7), ("zfnet512", 1e-3, 1e-7)]

#: The light models with large weights (VGG-19's 548 MB, ZFNet's 349, AlexNet's 233): a test of one
#: holds 1-2 GB while it runs, so their tests carry the ``memory_heavy`` mark (`light_params`)
#: and run first (tests/conftest.py).
LARGE_LIGHT_MODELS = frozenset({"bvlc_alexnet", "vgg19", "zfnet512"})


def light_params(entries):
    """``entries`` (light model names, or rows of `LIGHT_MODELS`) as pytest params named after
    the model, those of `LARGE_LIGHT_MODELS` marked ``memory_heavy``."""
    params = []
    for entry in entries:
        name, values = (entry, (entry,)) if isinstance(entry, str) else (entry[0], tuple(entry))
        marks = (pytest.mark.memory_heavy,) if name in LARGE_LIGHT_MODELS else ()
        params.append(pytest.param(*values, id=name, marks=marks))
    return params


def light_path(name: str) -> Path:
    return LIGHT_DIR / f"light_{name}.onnx"


def light_input(proto: onnx.ModelProto) -> tuple[str, np.ndarray]:
    """The input the ONNX backend test runner feeds light models: arange(n)/n."""
    inits = {i.name for i in proto.graph.initializer}
    info = next(i for i in proto.graph.input if i.name not in inits)
    shape = tuple(d.dim_value or 1 for d in info.type.tensor_type.shape.dim)
    n = int(np.prod(shape))
    return info.name, (np.arange(n).reshape(shape) / n).astype(np.float32)


def light_expected(name: str) -> np.ndarray:
    return numpy_helper.to_array(onnx.load_tensor(str(LIGHT_DIR / f"light_{name}_output_0.pb")))


def with_random_weights(proto: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """Replace the light model's ConstantOfShape weights by random initializers of the same shape.

    The shipped weights are constants (outputs are uniform after Softmax), which hides most kernel
    bugs; random weights scaled by fan-in keep activations in a sane range through deep networks.
    """
    rng = np.random.default_rng(seed)
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    graph = proto.graph
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    role: dict[str, tuple[str, int]] = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            role.setdefault(name, (node.op_type, k))
    keep, new_inits = [], []
    for node in graph.node:
        if node.op_type != "ConstantOfShape" or node.input[0] not in consts:
            keep.append(node)
            continue
        shape = tuple(int(d) for d in consts[node.input[0]])
        op, index = role.get(node.output[0], ("", 0))
        if op == "BatchNormalization" and index in (1, 4):      # scale, variance: positive
            value = rng.uniform(0.5, 1.5, shape)
        elif op == "BatchNormalization":                         # bias, mean
            value = rng.normal(0, 0.1, shape)
        elif len(shape) >= 2:                                     # Conv/Gemm weights: He-like scaling
            fan_in = int(np.prod(shape[1:])) if op == "Conv" else min(shape)
            value = rng.normal(0, np.sqrt(2.0 / max(fan_in, 1)), shape)
        else:
            value = rng.normal(0, 0.1, shape)
        new_inits.append(numpy_helper.from_array(value.astype(np.float32), node.output[0]))
    del graph.node[:]
    graph.node.extend(keep)
    graph.initializer.extend(new_inits)
    return proto


def _init(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(array, name)


def transformer_block(d: int = 32, heads: int = 4, seed: int = 0) -> onnx.ModelProto:
    """Pre-norm self-attention + GELU MLP, symbolic batch and sequence, shapes computed in-graph."""
    rng = np.random.default_rng(seed)
    w = lambda *s: (rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)  # noqa: E731
    hd = d // heads
    inits = [_init("ln1_s", rng.uniform(0.5, 1.5, d).astype(np.float32)), _init("ln1_b", w(d) * 0.1),
             _init("wq", w(d, d)), _init("wk", w(d, d)), _init("wv", w(d, d)), _init("wo", w(d, d)),
             _init("ln2_s", rng.uniform(0.5, 1.5, d).astype(np.float32)), _init("ln2_b", w(d) * 0.1),
             _init("w1", w(d, 4 * d)), _init("b1", w(4 * d) * 0.1), _init("w2", w(4 * d, d)),
             _init("heads_hd", np.array([heads, hd], np.int64)), _init("minus_d", np.array([d], np.int64)),
             _init("zero_one", np.array([0, 1], np.int64)),
             _init("scale", np.array(1 / np.sqrt(hd), np.float32)), _init("half", np.array(0.5, np.float32)),
             _init("one", np.array(1.0, np.float32)), _init("rsqrt2", np.array(1 / np.sqrt(2), np.float32))]
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln1_s", "ln1_b"], ["h"], axis=-1, epsilon=1e-5),
        n("Shape", ["x"], ["xshape"]), n("Gather", ["xshape", "zero_one"], ["bt"], axis=0),
        n("Concat", ["bt", "heads_hd"], ["split_shape"], axis=0),
        n("Concat", ["bt", "minus_d"], ["merge_shape"], axis=0),
    ]
    for proj in ("q", "k", "v"):
        nodes += [n("MatMul", ["h", f"w{proj}"], [f"{proj}0"]),
                  n("Reshape", [f"{proj}0", "split_shape"], [f"{proj}1"]),
                  n("Transpose", [f"{proj}1"], [proj], perm=[0, 2, 1, 3])]
    nodes += [
        n("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), n("MatMul", ["q", "kt"], ["scores0"]),
        n("Mul", ["scores0", "scale"], ["scores"]), n("Softmax", ["scores"], ["attn"], axis=-1),
        n("MatMul", ["attn", "v"], ["ctx0"]), n("Transpose", ["ctx0"], ["ctx1"], perm=[0, 2, 1, 3]),
        n("Reshape", ["ctx1", "merge_shape"], ["ctx"]), n("MatMul", ["ctx", "wo"], ["attn_out"]),
        n("Add", ["x", "attn_out"], ["r1"]),
        n("LayerNormalization", ["r1", "ln2_s", "ln2_b"], ["h2"], axis=-1, epsilon=1e-5),
        n("MatMul", ["h2", "w1"], ["m0"]), n("Add", ["m0", "b1"], ["m1"]),
        n("Mul", ["m1", "rsqrt2"], ["g0"]), n("Erf", ["g0"], ["g1"]), n("Add", ["g1", "one"], ["g2"]),
        n("Mul", ["m1", "half"], ["g3"]), n("Mul", ["g3", "g2"], ["gelu"]),
        n("MatMul", ["gelu", "w2"], ["m2"]), n("Add", ["r1", "m2"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "transformer_block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", d])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", d])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def recurrent_net(seed: int = 0) -> onnx.ModelProto:
    """Bidirectional LSTM → GRU → ReduceMean → Gemm → LogSoftmax, with symbolic batch."""
    rng = np.random.default_rng(seed)
    t, i, h = 7, 5, 6
    r = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    inits = [_init("lw", r(2, 4 * h, i)), _init("lr", r(2, 4 * h, h)), _init("lb", r(2, 8 * h)),
             _init("gw", r(1, 3 * h, 2 * h)), _init("gr", r(1, 3 * h, h)), _init("gb", r(1, 6 * h)),
             _init("fc", r(h, 3)), _init("fcb", r(3)), _init("tb_shape", np.array([0, 0, -1], np.int64)),
             _init("axes1", np.array([1], np.int64))]
    n = helper.make_node
    nodes = [n("LSTM", ["x", "lw", "lr", "lb"], ["ly"], hidden_size=h, direction="bidirectional"),
             n("Transpose", ["ly"], ["lyt"], perm=[0, 2, 1, 3]),
             n("Reshape", ["lyt", "tb_shape"], ["lyr"]),
             n("GRU", ["lyr", "gw", "gr", "gb"], ["gy"], hidden_size=h, linear_before_reset=1),
             n("Squeeze", ["gy", "axes1"], ["gys"]),
             n("ReduceMean", ["gys"], ["pooled"], axes=[0], keepdims=0),
             n("Gemm", ["pooled", "fc", "fcb"], ["logits"]),
             n("LogSoftmax", ["logits"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "recurrent_net",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [t, "batch", i])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def decoder_net(seed: int = 0) -> onnx.ModelProto:
    """ConvTranspose/Resize upsampling with Concat skip, Pad, Clip, HardSwish, LeakyRelu, Where, Einsum."""
    rng = np.random.default_rng(seed)
    r = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    inits = [_init("ct_w", r(4, 3, 2, 2)), _init("ct_b", r(3)), _init("cw", r(5, 7, 3, 3)),
             _init("scales", np.array([1, 1, 2, 2], np.float32)), _init("lo", np.array(-1.0, np.float32)),
             _init("hi", np.array(1.5, np.float32)), _init("pads", np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)),
             _init("zero", np.array(0.0, np.float32)), _init("proj", r(5, 2))]
    n = helper.make_node
    nodes = [n("ConvTranspose", ["x", "ct_w", "ct_b"], ["up1"], strides=[2, 2]),
             n("Resize", ["x", "", "scales"], ["up2"], mode="linear", coordinate_transformation_mode="half_pixel"),
             n("Concat", ["up1", "up2"], ["cat"], axis=1),
             n("Pad", ["cat", "pads"], ["padded"], mode="reflect"),
             n("Conv", ["padded", "cw"], ["c"]),
             n("HardSwish", ["c"], ["hs"]), n("Clip", ["hs", "lo", "hi"], ["cl"]),
             n("LeakyRelu", ["cl"], ["lr"], alpha=0.2),
             n("Greater", ["lr", "zero"], ["pos"]), n("Neg", ["lr"], ["neg"]),
             n("Where", ["pos", "lr", "neg"], ["absish"]),
             n("Einsum", ["absish", "proj"], ["y"], equation="nchw,cd->ndhw")]
    graph = helper.make_graph(nodes, "decoder_net",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 12, 12])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
