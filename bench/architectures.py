"""Real network architectures as ONNX graphs with random weights, for the ``real_models`` benchmark.

torch, torchvision and transformers are not needed: every network is written here with
``onnx.helper``, layer by layer, with the layer structure and sizes of the real one and the node
patterns a torch export produces (BatchNormalization kept after Conv, SiLU as Sigmoid+Mul, GELU as
the Div/Erf/Add/Mul/Mul expansion of opset 17, reshape targets computed from ``Shape`` where
exports compute them, ...). Weights are random (He-style scaling, one fixed seed per model), so
activations stay in a sane range through the depth of the network; the numbers mean nothing, the
work is the real one.

Each model is built once and cached as ``<cache>/<name>-<key>.onnx``, where ``<key>`` hashes
:data:`BUILDER_VERSION` and this file's source, so any change to a builder rebuilds. The cache
folder is ``$ASYNCINFER_BENCH_CACHE``, else ``$XDG_CACHE_HOME/asyncinfer-bench``, else
``~/.cache/asyncinfer-bench``.

    python3 bench/architectures.py            # build (or find) every model, print sizes and paths
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Bump to force a rebuild even when this file's text did not change (e.g. an onnx upgrade).
BUILDER_VERSION = 1
OPSET = 17
IR_VERSION = 8

FLOAT, FLOAT16, INT64 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64


# -- the graph builder ------------------------------------------------------------------------------
class GraphBuilder:
    """Accumulates nodes and initializers; names nodes after a module-like scope (``layer1.0/Conv_3``)."""

    def __init__(self, name: str, seed: int):
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._scope: list[str] = []
        self._count = 0
        self._scalars: dict[tuple[Any, str], str] = {}

    # naming
    def scope(self, name: str) -> "_Scope":
        return _Scope(self, name)

    def _fresh(self, kind: str) -> str:
        self._count += 1
        return "/".join(self._scope + [f"{kind}_{self._count}"])

    # values
    def input(self, name: str, elem_type: int, shape: Sequence[int | str]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: Sequence[int | str] | None) -> str:
        """Expose ``value`` as graph output ``name`` (renaming the producing node's output)."""
        for node in self.nodes:
            for i, out in enumerate(node.output):
                if out == value:
                    node.output[i] = name
            for i, inp in enumerate(node.input):
                if inp == value:
                    node.input[i] = name
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, None if shape is None else list(shape)))
        return name

    def const(self, value: np.ndarray, kind: str = "const") -> str:
        name = self._fresh(kind)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def scalar(self, value: float | int, dtype: Any = np.float32) -> str:
        """A 0-d constant, shared by every node that uses the same value."""
        key = (value, np.dtype(dtype).name)
        if key not in self._scalars:
            name = f"scalar_{np.dtype(dtype).name}_{len(self._scalars)}"
            self.initializers.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
            self._scalars[key] = name
        return self._scalars[key]

    def ints(self, values: Sequence[int]) -> str:
        """A 1-d int64 constant (shapes, axes, slice bounds)."""
        return self.const(np.asarray(values, dtype=np.int64), "ints")

    def weight(self, shape: Sequence[int], fan_in: int, gain: float = math.sqrt(2.0)) -> str:
        """Normal(0, gain/sqrt(fan_in)) weights: He scaling keeps activations O(1) through depth."""
        w = self.rng.standard_normal(tuple(shape), dtype=np.float32) * np.float32(gain / math.sqrt(fan_in))
        return self.const(w, "w")

    def uniform(self, shape: Sequence[int], low: float, high: float) -> str:
        return self.const(self.rng.uniform(low, high, tuple(shape)).astype(np.float32), "p")

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs: Any) -> Any:
        """Add a node; returns its output name, or the list of names when ``outputs > 1``."""
        name = self._fresh(op_type)
        outs = [f"{name}:{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, **attrs))
        return outs[0] if outputs == 1 else outs

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                                  producer_name="asyncinfer-bench")
        onnx.checker.check_model(proto)
        return proto

    # -- layers: convolution networks ---------------------------------------------------------------
    def conv(self, x: str, cin: int, cout: int, k: int | Sequence[int], stride: int = 1, group: int = 1,
             pad: int | None = None, bias: bool = False, gain: float = math.sqrt(2.0)) -> str:
        ks = [k, k] if isinstance(k, int) else list(k)
        pads = [(kk - 1) // 2 if pad is None else pad for kk in ks]
        fan_in = cin // group * int(np.prod(ks))
        inputs = [x, self.weight([cout, cin // group, *ks], fan_in, gain)]
        if bias:
            inputs.append(self.const(self.rng.normal(0, 0.05, cout).astype(np.float32), "b"))
        return self.op("Conv", *inputs, kernel_shape=ks, strides=[stride] * len(ks), pads=pads + pads,
                       group=group, dilations=[1] * len(ks))

    def batchnorm(self, x: str, c: int, eps: float = 1e-5) -> str:
        """Inference BatchNormalization with plausible trained statistics."""
        return self.op("BatchNormalization", x, self.uniform([c], 0.6, 1.2), self.const(
            self.rng.normal(0, 0.1, c).astype(np.float32), "beta"), self.const(
            self.rng.normal(0, 0.1, c).astype(np.float32), "mean"), self.uniform([c], 0.8, 1.6), epsilon=eps)

    def act(self, x: str, kind: str | None) -> str:
        if kind is None:
            return x
        if kind == "relu":
            return self.op("Relu", x)
        if kind == "relu6":
            return self.op("Clip", x, self.scalar(0.0), self.scalar(6.0))
        if kind == "hardswish":
            return self.op("HardSwish", x)
        if kind == "hardsigmoid":
            return self.op("HardSigmoid", x, alpha=1.0 / 6.0, beta=0.5)
        if kind == "sigmoid":
            return self.op("Sigmoid", x)
        if kind == "silu":  # torch exports SiLU as Sigmoid and Mul
            return self.op("Mul", x, self.op("Sigmoid", x))
        if kind == "gelu":  # nn.GELU() at opset 17: x * 0.5 * (1 + erf(x / sqrt(2)))
            erf = self.op("Erf", self.op("Div", x, self.scalar(math.sqrt(2.0))))
            return self.op("Mul", self.op("Mul", x, self.op("Add", erf, self.scalar(1.0))), self.scalar(0.5))
        if kind == "gelu_tanh":  # GPT-2's gelu_new: 0.5x(1 + tanh(sqrt(2/pi)(x + 0.044715 x^3)))
            cube = self.op("Mul", self.op("Pow", x, self.scalar(3.0)), self.scalar(0.044715))
            inner = self.op("Mul", self.op("Add", x, cube), self.scalar(math.sqrt(2.0 / math.pi)))
            return self.op("Mul", self.op("Mul", x, self.scalar(0.5)), self.op("Add", self.op("Tanh", inner),
                                                                                self.scalar(1.0)))
        raise ValueError(f"unknown activation {kind!r}")

    def conv_bn(self, x: str, cin: int, cout: int, k: int, stride: int = 1, group: int = 1, act: str | None = None,
                eps: float = 1e-5, gain: float = math.sqrt(2.0)) -> str:
        """Conv (no bias) → BatchNormalization → activation: torchvision's Conv2dNormActivation."""
        return self.act(self.batchnorm(self.conv(x, cin, cout, k, stride, group, gain=gain), cout, eps), act)

    def squeeze_excite(self, x: str, c: int, squeeze: int, inner: str, gate: str) -> str:
        """torchvision's SqueezeExcitation: GlobalAveragePool → 1×1 Conv → act → 1×1 Conv → gate → Mul."""
        with self.scope("se"):
            s = self.op("GlobalAveragePool", x)
            s = self.act(self.conv(s, c, squeeze, 1, bias=True), inner)
            s = self.act(self.conv(s, squeeze, c, 1, bias=True, gain=1.0), gate)
            return self.op("Mul", s, x)

    def linear(self, x: str, cin: int, cout: int, bias: bool = True, gain: float = 1.0) -> str:
        """nn.Linear on a rank>2 tensor as exported: MatMul with the transposed weight, then Add."""
        y = self.op("MatMul", x, self.weight([cin, cout], cin, gain))
        if bias:
            y = self.op("Add", y, self.const(self.rng.normal(0, 0.02, cout).astype(np.float32), "b"))
        return y

    def gemm(self, x: str, cin: int, cout: int, gain: float = 1.0) -> str:
        """nn.Linear on a 2-D tensor as exported: Gemm with transB=1."""
        return self.op("Gemm", x, self.weight([cout, cin], cin, gain),
                       self.const(self.rng.normal(0, 0.02, cout).astype(np.float32), "b"), alpha=1.0, beta=1.0,
                       transB=1)

    def layernorm(self, x: str, c: int, eps: float = 1e-5) -> str:
        """LayerNormalization over the last axis (what torch exports at opset 17)."""
        return self.op("LayerNormalization", x, self.uniform([c], 0.8, 1.2),
                       self.const(self.rng.normal(0, 0.02, c).astype(np.float32), "b"), axis=-1, epsilon=eps)

    def layernorm_expanded(self, x: str, c: int, eps: float = 1e-12) -> str:
        """LayerNorm as older exports write it: ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add."""
        mean = self.op("ReduceMean", x, axes=[-1], keepdims=1)
        d = self.op("Sub", x, mean)
        var = self.op("ReduceMean", self.op("Pow", d, self.scalar(2.0)), axes=[-1], keepdims=1)
        y = self.op("Div", d, self.op("Sqrt", self.op("Add", var, self.scalar(eps))))
        return self.op("Add", self.op("Mul", y, self.uniform([c], 0.8, 1.2)),
                       self.const(self.rng.normal(0, 0.02, c).astype(np.float32), "b"))

    def rmsnorm(self, x: str, c: int, eps: float = 1e-6) -> str:
        """Llama's RMSNorm as exported: Pow/ReduceMean/Add/Sqrt/Div/Mul, then the weight Mul."""
        var = self.op("ReduceMean", self.op("Pow", x, self.scalar(2.0)), axes=[-1], keepdims=1)
        inv = self.op("Div", self.scalar(1.0), self.op("Sqrt", self.op("Add", var, self.scalar(eps))))
        return self.op("Mul", self.uniform([c], 0.8, 1.2), self.op("Mul", x, inv))

    def shape_dims(self, x: str, dims: Sequence[int]) -> list[str]:
        """``[Unsqueeze(Shape(x)[d]) for d in dims]``: the 1-element tensors exports concat into shapes."""
        shape = self.op("Shape", x)
        return [self.op("Unsqueeze", self.op("Gather", shape, self.scalar(d, np.int64), axis=0), self.ints([0]))
                for d in dims]


class _Scope:
    def __init__(self, builder: GraphBuilder, name: str):
        self.builder, self.name = builder, name

    def __enter__(self) -> None:
        self.builder._scope.append(self.name)

    def __exit__(self, *exc: Any) -> None:
        self.builder._scope.pop()


def make_divisible(v: float, divisor: int = 8) -> int:
    """torchvision's channel rounding (MobileNet, EfficientNet)."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def classifier_tail(g: GraphBuilder, x: str) -> str:
    """GlobalAveragePool → Flatten, as torchvision's ``avgpool`` + ``torch.flatten(x, 1)`` export."""
    return g.op("Flatten", g.op("GlobalAveragePool", x), axis=1)


# -- convolution networks ---------------------------------------------------------------------------
def resnet18(batch: int = 1) -> onnx.ModelProto:
    """torchvision resnet18: 7×7 stem, max-pool, 4 stages of 2 BasicBlocks (64-128-256-512), fc 1000."""
    g = GraphBuilder("resnet18", seed=18)
    x = g.input("input", FLOAT, [batch, 3, 224, 224])
    y = g.op("MaxPool", g.conv_bn(x, 3, 64, 7, 2, act="relu"), kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, (c, stride) in enumerate([(64, 1), (128, 2), (256, 2), (512, 2)], start=1):
        for b in range(2):
            s = stride if b == 0 else 1
            with g.scope(f"layer{stage}.{b}"):
                h = g.conv_bn(y, cin, c, 3, s, act="relu")
                h = g.conv_bn(h, c, c, 3, 1, gain=1.0)
                identity = g.conv_bn(y, cin, c, 1, s, gain=1.0) if (s != 1 or cin != c) else y
                y = g.op("Relu", g.op("Add", h, identity))
            cin = c
    g.output(g.gemm(classifier_tail(g, y), 512, 1000), "logits", FLOAT, [batch, 1000])
    return g.model()


# (kernel, expanded, out, squeeze-excite, activation, stride): torchvision's mobilenet_v3_small
MOBILENET_V3_SMALL = [
    (3, 16, 16, True, "relu", 2), (3, 72, 24, False, "relu", 2), (3, 88, 24, False, "relu", 1),
    (5, 96, 40, True, "hardswish", 2), (5, 240, 40, True, "hardswish", 1), (5, 240, 40, True, "hardswish", 1),
    (5, 120, 48, True, "hardswish", 1), (5, 144, 48, True, "hardswish", 1), (5, 288, 96, True, "hardswish", 2),
    (5, 576, 96, True, "hardswish", 1), (5, 576, 96, True, "hardswish", 1),
]


def mobilenet_v3_small(batch: int = 1) -> onnx.ModelProto:
    """torchvision mobilenet_v3_small: inverted residuals with depthwise convs (group=C), HardSwish,
    squeeze-excite gated by HardSigmoid; 1×1 conv to 576, then 576→1024 (HardSwish)→1000."""
    g = GraphBuilder(f"mobilenet_v3_small_b{batch}", seed=3)
    x = g.input("input", FLOAT, [batch, 3, 224, 224])
    y = g.conv_bn(x, 3, 16, 3, 2, act="hardswish", eps=1e-3)
    cin = 16
    for i, (k, exp, out, se, act, s) in enumerate(MOBILENET_V3_SMALL, start=1):
        with g.scope(f"features.{i}"):
            h = y if exp == cin else g.conv_bn(y, cin, exp, 1, act=act, eps=1e-3)
            h = g.conv_bn(h, exp, exp, k, s, group=exp, act=act, eps=1e-3)
            if se:
                h = g.squeeze_excite(h, exp, make_divisible(exp // 4), "relu", "hardsigmoid")
            h = g.conv_bn(h, exp, out, 1, eps=1e-3, gain=1.0)
            y = g.op("Add", h, y) if s == 1 and cin == out else h
        cin = out
    y = classifier_tail(g, g.conv_bn(y, 96, 576, 1, act="hardswish", eps=1e-3))
    y = g.gemm(g.act(g.gemm(y, 576, 1024, gain=math.sqrt(2.0)), "hardswish"), 1024, 1000)
    g.output(y, "logits", FLOAT, [batch, 1000])
    return g.model()


# (expand ratio, kernel, stride, in, out, repeats): torchvision's efficientnet_b0
EFFICIENTNET_B0 = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
                   (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1)]


def efficientnet_b0(batch: int = 1) -> onnx.ModelProto:
    """torchvision efficientnet_b0: 16 MBConv blocks (depthwise 3×3/5×5, SiLU as Sigmoid*x, SE with
    SiLU inside and a Sigmoid gate), 1×1 conv to 1280, fc 1000."""
    g = GraphBuilder("efficientnet_b0", seed=0)
    x = g.input("input", FLOAT, [batch, 3, 224, 224])
    y = g.conv_bn(x, 3, 32, 3, 2, act="silu", eps=1e-3)
    n = 0
    for expand, k, stride, cin0, cout, repeats in EFFICIENTNET_B0:
        for r in range(repeats):
            cin, s = (cin0, stride) if r == 0 else (cout, 1)
            exp = cin * expand
            with g.scope(f"features.{n}"):
                h = y if expand == 1 else g.conv_bn(y, cin, exp, 1, act="silu", eps=1e-3)
                h = g.conv_bn(h, exp, exp, k, s, group=exp, act="silu", eps=1e-3)
                h = g.squeeze_excite(h, exp, max(1, cin // 4), "silu", "sigmoid")
                h = g.conv_bn(h, exp, cout, 1, eps=1e-3, gain=1.0)
                y = g.op("Add", h, y) if s == 1 and cin == cout else h
            n += 1
    y = classifier_tail(g, g.conv_bn(y, 320, 1280, 1, act="silu", eps=1e-3))
    g.output(g.gemm(y, 1280, 1000), "logits", FLOAT, [batch, 1000])
    return g.model()


def _layernorm2d(g: GraphBuilder, x: str, c: int) -> str:
    """torchvision's LayerNorm2d: permute to NHWC, LayerNormalization over C, permute back."""
    y = g.layernorm(g.op("Transpose", x, perm=[0, 2, 3, 1]), c, eps=1e-6)
    return g.op("Transpose", y, perm=[0, 3, 1, 2])


CONVNEXT_T = [(96, 3), (192, 3), (384, 9), (768, 3)]  # (channels, blocks) per stage


def convnext_tiny(batch: int = 1, stages: int = 4) -> onnx.ModelProto:
    """torchvision convnext_tiny: 4×4/4 stem + LayerNorm2d; blocks of depthwise 7×7 conv → NHWC →
    LayerNormalization → Linear 4C → GELU (Erf) → Linear C → NCHW → layer-scale Mul → residual Add;
    LayerNorm2d + 2×2/2 conv between stages; pooled LayerNorm2d and fc 1000. ``stages`` < 4 keeps
    the first stages only (and pools their output)."""
    g = GraphBuilder(f"convnext_tiny_s{stages}", seed=7)
    x = g.input("input", FLOAT, [batch, 3, 224, 224])
    with g.scope("stem"):
        y = _layernorm2d(g, g.conv(x, 3, 96, 4, 4, pad=0, bias=True), 96)
    cin = 96
    for si, (c, blocks) in enumerate(CONVNEXT_T[:stages]):
        if si > 0:
            with g.scope(f"downsample{si}"):
                y = g.conv(_layernorm2d(g, y, cin), cin, c, 2, 2, pad=0, bias=True)
        for b in range(blocks):
            with g.scope(f"stage{si}.{b}"):
                h = g.conv(y, c, c, 7, 1, group=c, bias=True, gain=1.0)
                h = g.layernorm(g.op("Transpose", h, perm=[0, 2, 3, 1]), c, eps=1e-6)
                h = g.linear(g.act(g.linear(h, c, 4 * c, gain=math.sqrt(2.0)), "gelu"), 4 * c, c)
                h = g.op("Transpose", h, perm=[0, 3, 1, 2])
                h = g.op("Mul", h, g.uniform([c, 1, 1], 0.1, 0.5))  # layer scale
                y = g.op("Add", h, y)
        cin = c
    y = g.op("Flatten", _layernorm2d(g, g.op("GlobalAveragePool", y), cin), axis=1)
    g.output(g.gemm(y, cin, 1000), "logits", FLOAT, [batch, 1000])
    return g.model()


# -- transformers -----------------------------------------------------------------------------------
def _split_heads(g: GraphBuilder, x: str, heads: int, head_dim: int, perm: Sequence[int]) -> str:
    """[b, s, h*d] → Reshape [b, s, h, d] (target from Shape, as exports compute it) → Transpose."""
    b, s = g.shape_dims(x, [0, 1])
    target = g.op("Concat", b, s, g.ints([heads]), g.ints([head_dim]), axis=0)
    return g.op("Transpose", g.op("Reshape", x, target), perm=list(perm))


def _merge_heads(g: GraphBuilder, x: str, hidden: int) -> str:
    """[b, h, s, d] → Transpose [b, s, h, d] → Reshape [b, s, h*d] (target from Shape)."""
    t = g.op("Transpose", x, perm=[0, 2, 1, 3])
    b, s = g.shape_dims(t, [0, 1])
    return g.op("Reshape", t, g.op("Concat", b, s, g.ints([hidden]), axis=0))


def bert_tiny(layers: int = 2, hidden: int = 128, heads: int = 2, ffn: int = 512, vocab: int = 30522,
              max_positions: int = 512, hf_mask: bool = False) -> onnx.ModelProto:
    """google/bert_uncased_L-2_H-128_A-2 as an older HF export: dynamic batch and sequence axes,
    embeddings by Gather, LayerNorm expanded (ReduceMean/Sub/Pow/Sqrt/Div), attention as
    MatMul+Add projections, Reshape/Transpose heads, QKᵀ MatMul, Div by √d, Add of the extended
    mask, Softmax, MatMul V; GELU by Erf; pooler Gather + Gemm + Tanh. ``hf_mask`` builds the
    extended mask with two Unsqueeze nodes, as HF exports it: ORT's transformer optimizer fuses
    attention only on that form."""
    g = GraphBuilder("bert_tiny", seed=128)
    d = hidden // heads
    ids = g.input("input_ids", INT64, ["batch", "sequence"])
    mask = g.input("attention_mask", INT64, ["batch", "sequence"])
    types = g.input("token_type_ids", INT64, ["batch", "sequence"])
    with g.scope("embeddings"):
        words = g.op("Gather", g.weight([vocab, hidden], 1, gain=0.5), ids, axis=0)
        [seq] = g.shape_dims(ids, [1])
        positions = g.op("Slice", g.const(np.arange(max_positions, dtype=np.int64)[None], "position_ids"),
                         g.ints([0]), seq, g.ints([1]))
        pos = g.op("Gather", g.weight([max_positions, hidden], 1, gain=0.5), positions, axis=0)
        tok = g.op("Gather", g.weight([2, hidden], 1, gain=0.5), types, axis=0)
        h = g.layernorm_expanded(g.op("Add", g.op("Add", words, tok), pos), hidden)
    with g.scope("extended_mask"):  # (1 - mask[:, None, None, :]) * -10000
        wide = (g.op("Unsqueeze", g.op("Unsqueeze", mask, g.ints([1])), g.ints([2])) if hf_mask
                else g.op("Unsqueeze", mask, g.ints([1, 2])))
        m = g.op("Cast", wide, to=FLOAT)
        ext = g.op("Mul", g.op("Sub", g.scalar(1.0), m), g.scalar(-10000.0))
    for i in range(layers):
        with g.scope(f"layer.{i}.attention"):
            q = _split_heads(g, g.linear(h, hidden, hidden), heads, d, [0, 2, 1, 3])
            k = _split_heads(g, g.linear(h, hidden, hidden), heads, d, [0, 2, 3, 1])
            v = _split_heads(g, g.linear(h, hidden, hidden), heads, d, [0, 2, 1, 3])
            scores = g.op("Add", g.op("Div", g.op("MatMul", q, k), g.scalar(math.sqrt(d))), ext)
            ctx = _merge_heads(g, g.op("MatMul", g.op("Softmax", scores, axis=-1), v), hidden)
            h = g.layernorm_expanded(g.op("Add", g.linear(ctx, hidden, hidden), h), hidden)
        with g.scope(f"layer.{i}.ffn"):
            f = g.linear(g.act(g.linear(h, hidden, ffn, gain=math.sqrt(2.0)), "gelu"), ffn, hidden)
            h = g.layernorm_expanded(g.op("Add", f, h), hidden)
    with g.scope("pooler"):
        first = g.op("Gather", h, g.scalar(0, np.int64), axis=1)
        pooled = g.op("Tanh", g.gemm(first, hidden, hidden))
    g.output(h, "last_hidden_state", FLOAT, ["batch", "sequence", hidden])
    g.output(pooled, "pooler_output", FLOAT, ["batch", hidden])
    return g.model()


def _conv1d_gpt(g: GraphBuilder, x: str, cin: int, cout: int, gain: float = 1.0) -> str:
    """HF GPT-2's Conv1D as exported: Reshape to 2-D, Gemm (addmm), Reshape back (target from Shape)."""
    flat = g.op("Reshape", x, g.ints([-1, cin]))
    y = g.op("Gemm", flat, g.weight([cin, cout], cin, gain), g.const(
        g.rng.normal(0, 0.02, cout).astype(np.float32), "b"))
    lead = g.op("Slice", g.op("Shape", x), g.ints([0]), g.ints([-1]), g.ints([0]))
    return g.op("Reshape", y, g.op("Concat", lead, g.ints([cout]), axis=0))


def gpt2_decode(layers: int = 4, hidden: int = 768, heads: int = 12, vocab: int = 50257,
                max_positions: int = 1024) -> onnx.ModelProto:
    """GPT-2 small's first ``layers`` blocks as one decode step with a KV cache (HF export with
    past): token and position embeddings by Gather; per layer LayerNormalization, Conv1D
    (Reshape/Gemm/Reshape) to qkv, Split, heads, present = Concat(past, new), causal mask sliced
    from the ``bias`` buffer at [past_len:total] (bounds from Shape) and applied by Where, Softmax,
    MatMul V, projection, gelu_new MLP (Pow/Tanh expansion); final LayerNorm and the untied-copy
    lm_head MatMul to 50257 logits."""
    g = GraphBuilder(f"gpt2_decode_l{layers}", seed=2)
    d = hidden // heads
    ids = g.input("input_ids", INT64, ["batch", "sequence"])
    positions = g.input("position_ids", INT64, ["batch", "sequence"])
    pasts = [(g.input(f"past_key_values.{i}.key", FLOAT, ["batch", heads, "past_sequence", d]),
              g.input(f"past_key_values.{i}.value", FLOAT, ["batch", heads, "past_sequence", d]))
             for i in range(layers)]
    with g.scope("embeddings"):
        h = g.op("Add", g.op("Gather", g.weight([vocab, hidden], 1, gain=0.3), ids, axis=0),
                 g.op("Gather", g.weight([max_positions, hidden], 1, gain=0.1), positions, axis=0))
    bias = g.const(np.tril(np.ones((max_positions, max_positions), dtype=bool))[None, None], "causal_bias")
    mask_value = g.scalar(float(np.finfo(np.float32).min))
    presents = []
    for i, (past_k, past_v) in enumerate(pasts):
        with g.scope(f"h.{i}.attn"):
            qkv = _conv1d_gpt(g, g.layernorm(h, hidden), hidden, 3 * hidden)
            q, k, v = g.op("Split", qkv, g.ints([hidden] * 3), axis=2, outputs=3)
            q = _split_heads(g, q, heads, d, [0, 2, 1, 3])
            present_k = g.op("Concat", past_k, _split_heads(g, k, heads, d, [0, 2, 1, 3]), axis=-2)
            present_v = g.op("Concat", past_v, _split_heads(g, v, heads, d, [0, 2, 1, 3]), axis=-2)
            presents += [present_k, present_v]
            scores = g.op("Div", g.op("MatMul", q, g.op("Transpose", present_k, perm=[0, 1, 3, 2])),
                          g.scalar(math.sqrt(d)))
            [q_len] = g.shape_dims(q, [2])
            [k_len] = g.shape_dims(present_k, [2])
            causal = g.op("Slice", bias, g.op("Sub", k_len, q_len), k_len, g.ints([2]))
            causal = g.op("Slice", causal, g.ints([0]), k_len, g.ints([3]))
            probs = g.op("Softmax", g.op("Where", causal, scores, mask_value), axis=-1)
            ctx = _merge_heads(g, g.op("MatMul", probs, present_v), hidden)
            h = g.op("Add", _conv1d_gpt(g, ctx, hidden, hidden), h)
        with g.scope(f"h.{i}.mlp"):
            f = g.act(_conv1d_gpt(g, g.layernorm(h, hidden), hidden, 4 * hidden, gain=math.sqrt(2.0)), "gelu_tanh")
            h = g.op("Add", _conv1d_gpt(g, f, 4 * hidden, hidden), h)
    with g.scope("lm_head"):
        logits = g.op("MatMul", g.layernorm(h, hidden), g.weight([hidden, vocab], hidden))
    g.output(logits, "logits", FLOAT, ["batch", "sequence", vocab])
    for i in range(layers):
        g.output(presents[2 * i], f"present.{i}.key", FLOAT, ["batch", heads, "total_sequence", d])
        g.output(presents[2 * i + 1], f"present.{i}.value", FLOAT, ["batch", heads, "total_sequence", d])
    return g.model()


def llama_block(layers: int = 2, hidden: int = 1024, heads: int = 16, ffn: int = 2816, seq: int = 128,
                theta: float = 10000.0) -> onnx.ModelProto:
    """``layers`` Llama decoder layers on a prefill of ``seq`` tokens (inputs_embeds in): RMSNorm
    (Pow/ReduceMean/Add/Sqrt/Div/Mul), q/k/v/o projections without bias, rotary embeddings (cos/sin
    from position_ids, rotate_half by Slice/Neg/Concat, Mul/Add), causal additive mask, Softmax,
    SiLU-gated MLP (Sigmoid*gate × up → down); final RMSNorm."""
    g = GraphBuilder(f"llama_l{layers}_h{hidden}", seed=42)
    d = hidden // heads
    x = g.input("inputs_embeds", FLOAT, [1, seq, hidden])
    positions = g.input("position_ids", INT64, [1, seq])
    with g.scope("rotary"):
        inv_freq = (1.0 / theta ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
        pos = g.op("Unsqueeze", g.op("Cast", positions, to=FLOAT), g.ints([1]))                  # [1, 1, s]
        freqs = g.op("Transpose", g.op("MatMul", g.const(inv_freq[None, :, None], "inv_freq"), pos), perm=[0, 2, 1])
        emb = g.op("Concat", freqs, freqs, axis=-1)                                                 # [1, s, d]
        cos = g.op("Unsqueeze", g.op("Cos", emb), g.ints([1]))
        sin = g.op("Unsqueeze", g.op("Sin", emb), g.ints([1]))
    causal = g.const(np.triu(np.full((seq, seq), np.finfo(np.float32).min, np.float32), 1)[None, None], "causal_mask")

    def rope(t: str) -> str:
        x1 = g.op("Slice", t, g.ints([0]), g.ints([d // 2]), g.ints([-1]))
        x2 = g.op("Slice", t, g.ints([d // 2]), g.ints([d]), g.ints([-1]))
        rotated = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
        return g.op("Add", g.op("Mul", t, cos), g.op("Mul", rotated, sin))

    h = x
    for i in range(layers):
        with g.scope(f"layers.{i}.self_attn"):
            n = g.rmsnorm(h, hidden)
            q = rope(_split_heads(g, g.linear(n, hidden, hidden, bias=False), heads, d, [0, 2, 1, 3]))
            k = rope(_split_heads(g, g.linear(n, hidden, hidden, bias=False), heads, d, [0, 2, 1, 3]))
            v = _split_heads(g, g.linear(n, hidden, hidden, bias=False), heads, d, [0, 2, 1, 3])
            scores = g.op("Div", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), g.scalar(math.sqrt(d)))
            probs = g.op("Softmax", g.op("Add", scores, causal), axis=-1)
            h = g.op("Add", h, g.linear(_merge_heads(g, g.op("MatMul", probs, v), hidden), hidden, hidden, bias=False))
        with g.scope(f"layers.{i}.mlp"):
            n = g.rmsnorm(h, hidden)
            gate = g.act(g.linear(n, hidden, ffn, bias=False, gain=math.sqrt(2.0)), "silu")
            up = g.linear(n, hidden, ffn, bias=False)
            h = g.op("Add", h, g.linear(g.op("Mul", gate, up), ffn, hidden, bias=False))
    g.output(g.rmsnorm(h, hidden), "last_hidden_state", FLOAT, [1, seq, hidden])
    return g.model()


def vit_b16(layers: int = 12, hidden: int = 768, heads: int = 12, mlp: int = 3072, size: int = 224,
            patch: int = 16) -> onnx.ModelProto:
    """torchvision's ViT-B/16 (86 M parameters, 330 MiB of float32): 16×16 patch Conv, Reshape and
    Transpose to tokens, the class token Expanded to the batch and Concatenated, position embedding
    Add; per block LayerNormalization, attention with one fused in-projection MatMul+Add Split into
    q/k/v (nn.MultiheadAttention's in_proj), heads, QKᵀ/√d, Softmax, MatMul V, out-projection,
    residual, LayerNormalization, GELU MLP (Erf), residual; final LayerNormalization, the class
    token by Gather and the 1000-way head Gemm. The issue's large-model load case."""
    g = GraphBuilder(f"vit_b{patch}_l{layers}", seed=16)
    d, tokens = hidden // heads, (size // patch) ** 2 + 1
    x = g.input("input", FLOAT, ["batch", 3, size, size])
    with g.scope("conv_proj"):
        p = g.conv(x, 3, hidden, patch, stride=patch, pad=0, bias=True, gain=1.0)
        b = g.shape_dims(p, [0])[0]
        p = g.op("Transpose", g.op("Reshape", p, g.op("Concat", b, g.ints([hidden, -1]), axis=0)), perm=[0, 2, 1])
    with g.scope("encoder"):
        cls = g.op("Expand", g.const(g.rng.normal(0, 0.02, (1, 1, hidden)).astype(np.float32), "class_token"),
                   g.op("Concat", b, g.ints([1, 1]), axis=0))
        h = g.op("Add", g.op("Concat", cls, p, axis=1),
                 g.const(g.rng.normal(0, 0.02, (1, tokens, hidden)).astype(np.float32), "pos_embedding"))
    for i in range(layers):
        with g.scope(f"encoder.layers.{i}.self_attention"):
            qkv = g.linear(g.layernorm(h, hidden, eps=1e-6), hidden, 3 * hidden)
            q, k, v = g.op("Split", qkv, g.ints([hidden] * 3), axis=2, outputs=3)
            q = _split_heads(g, q, heads, d, [0, 2, 1, 3])
            k = _split_heads(g, k, heads, d, [0, 2, 3, 1])
            v = _split_heads(g, v, heads, d, [0, 2, 1, 3])
            probs = g.op("Softmax", g.op("Div", g.op("MatMul", q, k), g.scalar(math.sqrt(d))), axis=-1)
            h = g.op("Add", g.linear(_merge_heads(g, g.op("MatMul", probs, v), hidden), hidden, hidden), h)
        with g.scope(f"encoder.layers.{i}.mlp"):
            f = g.act(g.linear(g.layernorm(h, hidden, eps=1e-6), hidden, mlp, gain=math.sqrt(2.0)), "gelu")
            h = g.op("Add", g.linear(f, mlp, hidden), h)
    with g.scope("heads"):
        first = g.op("Gather", g.layernorm(h, hidden, eps=1e-6), g.scalar(0, np.int64), axis=1)
        g.output(g.gemm(first, hidden, 1000), "logits", FLOAT, ["batch", 1000])
    return g.model()


# -- detection --------------------------------------------------------------------------------------
SSD_CLASSES = 91
SSD_ANCHORS = 6


def _ssd_anchors(sizes: Sequence[int]) -> np.ndarray:
    """(cx, cy, w, h) default boxes in [0, 1], 6 per cell (ssdlite's aspect ratios 1, 2, 3 and scales)."""
    boxes = []
    scales = np.linspace(0.2, 0.95, len(sizes) + 1)
    for k, n in enumerate(sizes):
        s, s_next = scales[k], scales[k + 1]
        shapes = [(s, s), (math.sqrt(s * s_next),) * 2]
        for ar in (2.0, 3.0):
            shapes += [(s * math.sqrt(ar), s / math.sqrt(ar)), (s / math.sqrt(ar), s * math.sqrt(ar))]
        for i in range(n):
            for j in range(n):
                boxes += [((j + 0.5) / n, (i + 0.5) / n, w, h) for w, h in shapes]
    return np.asarray(boxes, dtype=np.float32)


def ssdlite_nms(size: int = 320, candidates: int = 300, max_per_class: int = 100) -> onnx.ModelProto:
    """An SSDLite-style detector: MobileNet-like backbone (ReLU6 as Clip) to stride 16 and 32, four
    extra depthwise-separable stages (5×5 … 1×1), depthwise-separable class (91) and box heads on all
    six maps (3234 anchors), reshaped and concatenated; Softmax; box decoding against constant
    anchors (Slice/Mul/Exp/Add/Sub/Concat); ReduceMax over the 90 foreground classes, TopK 300
    candidates, Gather of their boxes and scores, NonMaxSuppression per class."""
    g = GraphBuilder("ssdlite_nms", seed=91)
    x = g.input("images", FLOAT, [1, 3, size, size])
    y = g.conv_bn(x, 3, 16, 3, 2, act="hardswish")

    def inverted(y: str, cin: int, exp: int, cout: int, s: int) -> str:
        h = g.conv_bn(y, cin, exp, 1, act="relu6")
        h = g.conv_bn(h, exp, exp, 3, s, group=exp, act="relu6")
        h = g.conv_bn(h, exp, cout, 1, gain=1.0)
        return g.op("Add", h, y) if s == 1 and cin == cout else h

    cin = 16
    for i, (exp, cout, s) in enumerate([(64, 24, 2), (72, 24, 1), (96, 40, 2), (120, 40, 1), (240, 80, 2),
                                        (480, 112, 1)]):
        with g.scope(f"backbone.{i}"):
            y = inverted(y, cin, exp, cout, s)
        cin = cout
    maps = [(y, 112)]                                                       # stride 16: 20×20
    with g.scope("backbone.6"):
        y = g.conv_bn(inverted(y, 112, 672, 160, 2), 160, 480, 1, act="relu6")  # stride 32: 10×10
    maps.append((y, 480))
    for i, cout in enumerate([512, 256, 256, 128]):                         # extras: 5, 3, 2, 1
        with g.scope(f"extra.{i}"):
            mid = cout // 2
            h = g.conv_bn(y, maps[-1][1], mid, 1, act="relu6")
            h = g.conv_bn(h, mid, mid, 3, 2, group=mid, act="relu6")
            y = g.conv_bn(h, mid, cout, 1, act="relu6")
        maps.append((y, cout))
    sizes = [size // 16]
    for _ in range(5):
        sizes.append((sizes[-1] + 1) // 2)

    def head(fm: str, c: int, n: int, per_anchor: int, gain: float) -> str:
        h = g.conv_bn(fm, c, c, 3, 1, group=c, act="relu6")
        h = g.conv(h, c, SSD_ANCHORS * per_anchor, 1, bias=True, gain=gain)
        # view(N, A, K, H, W).permute(0, 3, 4, 1, 2).reshape(N, -1, K)
        h = g.op("Reshape", h, g.ints([1, SSD_ANCHORS, per_anchor, n, n]))
        return g.op("Reshape", g.op("Transpose", h, perm=[0, 3, 4, 1, 2]), g.ints([0, -1, per_anchor]))

    with g.scope("head"):
        logits = g.op("Concat", *[head(fm, c, n, SSD_CLASSES, 3.0) for (fm, c), n in zip(maps, sizes)], axis=1)
        deltas = g.op("Concat", *[head(fm, c, n, 4, 0.5) for (fm, c), n in zip(maps, sizes)], axis=1)
    with g.scope("postprocess"):
        scores = g.op("Softmax", logits, axis=-1)
        anchors = _ssd_anchors(sizes)
        centers, wh = g.const(anchors[None, :, :2], "anchor_centers"), g.const(anchors[None, :, 2:], "anchor_sizes")
        dxy = g.op("Slice", deltas, g.ints([0]), g.ints([2]), g.ints([2]))
        dwh = g.op("Slice", deltas, g.ints([2]), g.ints([4]), g.ints([2]))
        ctr = g.op("Add", g.op("Mul", g.op("Mul", dxy, g.scalar(0.1)), wh), centers)
        half = g.op("Mul", g.op("Mul", g.op("Exp", g.op("Mul", dwh, g.scalar(0.2))), wh), g.scalar(0.5))
        boxes = g.op("Concat", g.op("Sub", ctr, half), g.op("Add", ctr, half), axis=2)         # [1, N, 4]
        foreground = g.op("Slice", scores, g.ints([1]), g.ints([SSD_CLASSES]), g.ints([2]))    # [1, N, 90]
        best = g.op("ReduceMax", foreground, axes=[2], keepdims=0)                            # [1, N]
        _, top = g.op("TopK", best, g.ints([candidates]), axis=1, largest=1, sorted=1, outputs=2)
        top = g.op("Squeeze", top, g.ints([0]))
        cand_boxes = g.op("Gather", boxes, top, axis=1)                                        # [1, K, 4]
        cand_scores = g.op("Transpose", g.op("Gather", foreground, top, axis=1), perm=[0, 2, 1])  # [1, 90, K]
        selected = g.op("NonMaxSuppression", cand_boxes, cand_scores, g.ints([max_per_class]),
                        g.const(np.array([0.5], np.float32), "iou"), g.const(np.array([0.02], np.float32), "score"),
                        center_point_box=0)
    g.output(cand_boxes, "boxes", FLOAT, [1, candidates, 4])
    g.output(cand_scores, "scores", FLOAT, [1, SSD_CLASSES - 1, candidates])
    g.output(selected, "selected_indices", INT64, ["selected", 3])
    return g.model()


# -- streaming audio --------------------------------------------------------------------------------
def lstm_vad(samples: int = 512, hidden: int = 64, window: int = 256, hop: int = 128) -> onnx.ModelProto:
    """A Silero-style voice-activity detector for one 512-sample chunk (16 kHz, 32 ms): reflect Pad,
    STFT as a strided Conv (258 real/imag filters), magnitude (Slice/Mul/Add/Sqrt), four Conv1d+ReLU
    encoder layers, the ONNX LSTM (hidden 64) with state in (h, c) and out (hn, cn), a 1×1 Conv
    decoder and a Sigmoid speech probability. Dozens of tiny layers: per-call overhead dominates."""
    g = GraphBuilder("lstm_vad", seed=16)
    x = g.input("audio", FLOAT, [1, samples])
    h0 = g.input("h", FLOAT, [1, 1, hidden])
    c0 = g.input("c", FLOAT, [1, 1, hidden])
    bins = window // 2 + 1
    with g.scope("stft"):
        padded = g.op("Pad", x, g.ints([0, hop // 2, 0, hop // 2]), mode="reflect")
        basis = np.arange(window)[None, :] * np.arange(bins)[:, None] * (2 * np.pi / window)
        hann = np.hanning(window + 1)[:-1]
        filters = np.concatenate([np.cos(basis) * hann, -np.sin(basis) * hann])[:, None, :].astype(np.float32)
        spec = g.op("Conv", g.op("Unsqueeze", padded, g.ints([1])), g.const(filters, "stft_basis"),
                    kernel_shape=[window], strides=[hop], pads=[0, 0])
        re = g.op("Slice", spec, g.ints([0]), g.ints([bins]), g.ints([1]))
        im = g.op("Slice", spec, g.ints([bins]), g.ints([2 * bins]), g.ints([1]))
        mag = g.op("Sqrt", g.op("Add", g.op("Mul", re, re), g.op("Mul", im, im)))
    y, cin = mag, bins
    with g.scope("encoder"):
        for cout, s in [(128, 1), (64, 2), (64, 1), (64, 1)]:
            y = g.op("Relu", g.conv(y, cin, cout, [3], s, bias=True))
            cin = cout
    with g.scope("lstm"):
        seq = g.op("Transpose", y, perm=[2, 0, 1])                     # [T, 1, 64]
        w = g.weight([1, 4 * hidden, cin], cin, gain=1.0)
        r = g.weight([1, 4 * hidden, hidden], hidden, gain=1.0)
        b = g.const(g.rng.normal(0, 0.1, (1, 8 * hidden)).astype(np.float32), "lstm_bias")
        _, hn, cn = g.op("LSTM", seq, w, r, b, "", h0, c0, hidden_size=hidden, outputs=3)
    with g.scope("decoder"):
        z = g.op("Reshape", g.op("Relu", hn), g.ints([1, hidden, 1]))
        prob = g.op("Reshape", g.op("Sigmoid", g.conv(z, hidden, 1, [1], bias=True, gain=1.0)), g.ints([1, 1]))
    g.output(prob, "speech_probability", FLOAT, [1, 1])
    g.output(hn, "hn", FLOAT, [1, 1, hidden])
    g.output(cn, "cn", FLOAT, [1, 1, hidden])
    return g.model()


# -- float16 ----------------------------------------------------------------------------------------
def to_float16(proto: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """Every float32 weight and activation in float16, as onnxconverter-common's conversion with
    the input kept float32: a Cast after each float input, float16 initializers, float16 outputs."""
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    graph = proto.graph
    graph.name = name
    for init in graph.initializer:
        if init.data_type == FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    casts = []
    for vi in graph.input:
        if vi.type.tensor_type.elem_type == FLOAT:
            half = f"{vi.name}_fp16"
            for node in graph.node:
                node.input[:] = [half if i == vi.name else i for i in node.input]
            casts.append(helper.make_node("Cast", [vi.name], [half], name=f"{vi.name}_to_fp16", to=FLOAT16))
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    for vi in graph.output:
        if vi.type.tensor_type.elem_type == FLOAT:
            vi.type.tensor_type.elem_type = FLOAT16
    del graph.value_info[:]
    onnx.checker.check_model(proto)
    return proto


# -- inputs -----------------------------------------------------------------------------------------
def image(batch: int, size: int = 224, seed: int = 0) -> np.ndarray:
    """A normalised image-like input: N(0, 1) noise (what mean/std normalisation produces)."""
    return np.random.default_rng(seed).standard_normal((batch, 3, size, size), dtype=np.float32)


def bert_inputs(seq: int = 128) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    mask = np.ones((1, seq), np.int64)
    mask[:, seq - 16:] = 0  # a padded tail
    types = np.zeros((1, seq), np.int64)
    types[:, seq // 2:] = 1
    return {"input_ids": rng.integers(0, 30522, (1, seq), dtype=np.int64), "attention_mask": mask,
            "token_type_ids": types}


def gpt2_inputs(layers: int = 4, past: int = 127, heads: int = 12, d: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    inputs = {"input_ids": np.array([[464]], np.int64), "position_ids": np.array([[past]], np.int64)}
    for i in range(layers):
        inputs[f"past_key_values.{i}.key"] = rng.standard_normal((1, heads, past, d), dtype=np.float32)
        inputs[f"past_key_values.{i}.value"] = rng.standard_normal((1, heads, past, d), dtype=np.float32)
    return inputs


def _llama_inputs(seq: int = 128, hidden: int = 1024) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    return {"inputs_embeds": rng.standard_normal((1, seq, hidden), dtype=np.float32) * np.float32(0.5),
            "position_ids": np.arange(seq, dtype=np.int64)[None]}


def _vad_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    t = np.arange(512) / 16000.0
    audio = (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(512)).astype(np.float32)[None]
    return {"audio": audio, "h": rng.normal(0, 0.1, (1, 1, 64)).astype(np.float32),
            "c": rng.normal(0, 0.1, (1, 1, 64)).astype(np.float32)}


# -- the catalogue ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    """One benchmark model: how to build it, its inputs, and how outputs are compared.

    ``rtol`` bounds each output's max abs difference relative to the reference output's largest
    magnitude; ``index_outputs`` are compared exactly, row by row (NMS selections); ``large``
    models are left out of the quick profile.
    """

    name: str
    build: Callable[[], onnx.ModelProto]
    inputs: Callable[[], dict[str, np.ndarray]]
    summary: str
    rtol: float = 1e-3
    index_outputs: tuple[str, ...] = ()
    large: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in [
    Architecture("resnet18", resnet18, lambda: {"input": image(1)}, "ResNet-18, 224², batch 1"),
    Architecture("mobilenet_v3_small", mobilenet_v3_small, lambda: {"input": image(1)},
                 "MobileNetV3-small, 224², batch 1"),
    Architecture("mobilenet_v3_small_b32", lambda: mobilenet_v3_small(32), lambda: {"input": image(32)},
                 "MobileNetV3-small, 224², batch 32", large=True),
    Architecture("mobilenet_v3_small_fp16", lambda: to_float16(mobilenet_v3_small(1), "mobilenet_v3_small_fp16"),
                 lambda: {"input": image(1)}, "MobileNetV3-small in float16 (input Cast), batch 1", rtol=1e-2),
    Architecture("efficientnet_b0", efficientnet_b0, lambda: {"input": image(1)}, "EfficientNet-B0, 224², batch 1"),
    Architecture("convnext_tiny", convnext_tiny, lambda: {"input": image(1)},
                 "ConvNeXt-T (all 4 stages, 3-3-9-3 blocks), 224², batch 1", large=True),
    Architecture("bert_tiny", bert_tiny, bert_inputs, "BERT-tiny encoder: 2 layers, hidden 128, 2 heads, seq 128"),
    Architecture("gpt2_decode", gpt2_decode, gpt2_inputs,
                 "GPT-2-small-style decode step: 4 layers of 768, 12 heads, past 127, 1 new token, 50257 logits",
                 large=True),
    Architecture("llama_block", llama_block, _llama_inputs,
                 "Llama-style decoder: 2 layers of 1024, 16 heads, MLP 2816, prefill seq 128", large=True),
    Architecture("vit_b16", vit_b16, lambda: {"input": image(1)},
                 "ViT-B/16 (86 M parameters), 224², batch 1", large=True),
    Architecture("ssdlite_nms", ssdlite_nms, lambda: {"images": image(1, 320)},
                 "SSDLite-style detector 320², 3234 anchors, TopK 300 + NonMaxSuppression",
                 index_outputs=("selected_indices",)),
    Architecture("lstm_vad", lstm_vad, _vad_inputs,
                 "Silero-style VAD: STFT conv, 4 Conv1d, LSTM 64, one 512-sample chunk"),
]}


# -- the cache --------------------------------------------------------------------------------------
def cache_dir() -> Path:
    if env := os.environ.get("ASYNCINFER_BENCH_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "asyncinfer-bench"


def builder_key() -> str:
    """Changes whenever this file or :data:`BUILDER_VERSION` (or the onnx version) does."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(f"{BUILDER_VERSION}/{onnx.__version__}".encode())
    return digest.hexdigest()[:12]


def model_path(name: str, *, rebuild: bool = False) -> Path:
    """The cached ``.onnx`` of architecture ``name``, built first if missing (or stale)."""
    if name not in ARCHITECTURES:
        raise KeyError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    folder = cache_dir()
    path = folder / f"{name}-{builder_key()}.onnx"
    if path.is_file() and not rebuild:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    data = ARCHITECTURES[name].build().SerializeToString()
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    for stale in folder.glob(f"{name}-*.onnx"):  # earlier builder versions
        if stale != path and stale.name.rsplit("-", 1)[0] == name:
            stale.unlink(missing_ok=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Build (or find in the cache) the real-architecture models.")
    parser.add_argument("names", nargs="*", default=list(ARCHITECTURES), help="architectures (default: all)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild even when cached")
    args = parser.parse_args(argv)
    for name in args.names:
        start = time.perf_counter()
        path = model_path(name, rebuild=args.rebuild)
        proto = onnx.load(str(path), load_external_data=False)
        print(f"{name:26s} {len(proto.graph.node):5d} nodes {path.stat().st_size / 2**20:8.1f} MiB "
              f"{time.perf_counter() - start:6.1f} s  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
