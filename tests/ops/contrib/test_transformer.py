"""The com.microsoft transformer-optimizer ops (asyncinfer/ops/contrib/transformer.py).

Each op runs as a one-node model through a ``cpu`` worker on random inputs and is compared with a
float64 NumPy reference written here from ORT's operator documentation (ContribOperators.md) and,
where the text is silent, from what ORT's CPU kernels are documented or observed to compute (said
at each reference), and with onnxruntime on the same model. Then the real thing: small BERT and
GPT-2 graphs go through ``onnxruntime.transformers.optimizer.optimize_model``; the fused models
must hold the com.microsoft ops, load, and agree with ORT on the fused and on the original model,
on the cpu backend and on gpu_pixel (whose layers fall back to the CPU for these ops).
"""
from __future__ import annotations

import collections
import math
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import helper

import asyncinfer as ai
from asyncinfer.errors import ExecutionError, UnsupportedOperatorError
from op_testing import one_node as _one_node

ort = pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the second opinion")

MS = "com.microsoft"
RTOL, ATOL = 1e-4, 1e-5


# -- harness ----------------------------------------------------------------------------------------
def one_node(op_type: str, inputs: list, attrs: dict | None = None, n_outputs: int = 1, domain: str = MS,
             opset: int = 17, outputs: list[str] | None = None) -> tuple[onnx.ModelProto, dict]:
    """`op_testing.one_node` for this file's ops: the com.microsoft domain at ONNX opset 17."""
    return _one_node(op_type, inputs, attrs, opset, n_outputs, domain=domain, outputs=outputs)


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def run_ours(model: onnx.ModelProto, feeds: dict, backend: str = "cpu",
             placed: dict | None = None) -> list[np.ndarray]:
    """Outputs of a ``backend`` worker; ``placed`` receives its placement (layer name → backend)."""
    with ai.Worker(ai.load_model(model), backend) as worker:
        got = worker.run_blocking(feeds)
        if placed is not None:
            placed.update(worker.placement.layers)
    return [got[o.name] for o in model.graph.output]


def close(got: np.ndarray, want: np.ndarray, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got.astype(np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol,
                               err_msg=what)


def check(op_type: str, inputs: list, attrs: dict | None, reference: list, *, n_outputs: int | None = None,
          outputs: list[str] | None = None, domain: str = MS, opset: int = 17, with_ort: bool = True,
          rtol: float = RTOL, atol: float = ATOL, rows: Callable | None = None) -> list[np.ndarray]:
    """Run ``op_type`` through a cpu worker; compare with ``reference`` (None entries skipped) and
    with onnxruntime. ``rows(i, array)`` may select the part of output ``i`` that is defined."""
    model, feeds = one_node(op_type, inputs, attrs, n_outputs or len(reference), domain, opset, outputs)
    before = {k: v.copy() for k, v in feeds.items()}
    got = run_ours(model, feeds)
    for k, v in feeds.items():
        np.testing.assert_array_equal(v, before[k], err_msg=f"{op_type} modified its input {k}")
    pick = rows or (lambda i, a: a)
    refs = reference if outputs is None else [r for r, name in zip(reference, outputs) if name]
    for i, (g, want) in enumerate(zip(got, refs)):
        if want is not None:
            assert g.dtype == np.asarray(want).dtype or np.asarray(want).dtype == np.float64, (g.dtype, i)
            close(pick(i, g), pick(i, np.asarray(want)), f"{op_type} output {i} vs the NumPy reference", rtol, atol)
    if with_ort:
        for i, (g, e) in enumerate(zip(got, run_ort(model, feeds))):
            assert g.dtype == e.dtype, f"{op_type} output {i}: dtype {g.dtype} != ORT's {e.dtype}"
            close(pick(i, g), pick(i, e), f"{op_type} output {i} vs onnxruntime", rtol, atol)
    return got



def randn(rng, *shape, dtype=np.float32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


# -- references (float64) -----------------------------------------------------------------------------
_erf = np.vectorize(math.erf)


def gelu(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def gelu_tanh(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))


def sigmoid(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


def layer_norm(x, gamma, beta, eps):
    x = np.asarray(x, np.float64)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    inv = 1 / np.sqrt(var + eps)
    y = (x - mean) * inv * gamma + (0 if beta is None else beta)
    return y, mean, inv


def rms_norm(x, gamma, eps, axis=-1):
    x = np.asarray(x, np.float64)
    axes = tuple(range(axis % x.ndim, x.ndim))
    inv = 1 / np.sqrt((x ** 2).mean(axes, keepdims=True) + eps)
    return x * inv * gamma, inv


def softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def attend(q, k, v, bias, scale):
    """q (B, N, S, H), k/v (B, N, T, H), additive bias broadcast to (B, N, S, T): softmax(scale·QKᵀ + bias) V."""
    s = np.einsum("bnsh,bnth->bnst", q, k) * scale + bias
    return np.einsum("bnst,bnth->bnsh", softmax(s), v)


def merge(y):
    b, n, s, h = y.shape
    return y.transpose(0, 2, 1, 3).reshape(b, s, n * h)


def heads(x, n):
    b, s, d = x.shape
    return np.asarray(x, np.float64).reshape(b, s, n, d // n).transpose(0, 2, 1, 3)


def rotate(x, cos, sin, interleaved, rot=None):
    """RoPE on x (..., S, H) with cos/sin (..., S, rot/2), rotating the first ``rot`` features."""
    x = np.asarray(x, np.float64).copy()
    rot = rot or 2 * cos.shape[-1]
    if interleaved:
        a, b = x[..., 0:rot:2].copy(), x[..., 1:rot:2].copy()
        x[..., 0:rot:2], x[..., 1:rot:2] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., :rot // 2].copy(), x[..., rot // 2:rot].copy()
        x[..., :rot // 2], x[..., rot // 2:rot] = a * cos - b * sin, a * sin + b * cos
    return x


# -- element-wise ops -------------------------------------------------------------------------------------
def test_gelu_family():
    rng = np.random.default_rng(0)
    x, bias = randn(rng, 2, 5, 8, scale=2), randn(rng, 8)
    check("Gelu", [x], None, [gelu(x)])
    check("BiasGelu", [x, bias], None, [gelu(x + bias)])
    check("FastGelu", [x], None, [gelu_tanh(x)])
    check("FastGelu", [x, bias], None, [gelu_tanh(x + bias)])
    check("QuickGelu", [x], None, [x * sigmoid(1.702 * x)])
    check("QuickGelu", [x], {"alpha": 0.5}, [x * sigmoid(0.5 * x)])
    skip = randn(rng, 2, 5, 8)
    # ORT runs BiasAdd and BiasSplitGelu on CUDA only: the reference alone judges them
    check("BiasAdd", [x, bias, skip], None, [x + bias + skip], with_ort=False)
    wide = randn(rng, 2, 4, 16)
    bias16 = randn(rng, 16)
    h = wide.astype(np.float64) + bias16
    check("BiasSplitGelu", [wide, bias16], None, [h[..., :8] * gelu(h[..., 8:])], with_ort=False)


def test_gelu_family_narrow_floats_compute_in_float32():
    x = np.linspace(-4, 4, 64, dtype=np.float32).reshape(2, 32)
    model, feeds = one_node("FastGelu", [x.astype(np.float16)], None)
    (got,) = run_ours(model, feeds)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), gelu_tanh(x.astype(np.float16)), rtol=2e-3, atol=2e-3)


def test_bias_of_the_wrong_length_is_an_execution_error():
    model, feeds = one_node("BiasGelu", [np.ones((2, 8), np.float32), np.ones(7, np.float32)], None)
    with pytest.raises(ExecutionError, match="bias of shape"):
        run_ours(model, feeds)


# -- fused GEMMs and convolution ---------------------------------------------------------------------
@pytest.mark.parametrize("attrs, a_shape, b_shape", [
    ({}, (3, 4), (4, 5)),
    ({"alpha": 0.5, "transA": 1}, (2, 4, 3), (2, 4, 5)),
    ({"transB": 1}, (2, 3, 3, 4), (5, 4)),
    ({"transBatchA": 1}, (3, 2, 2, 4), (2, 2, 4, 5)),
    ({"transBatchA": 1, "transA": 1, "alpha": 2.0}, (4, 2, 2, 3), (2, 2, 4, 5)),
    ({"transBatchB": 1, "transB": 1}, (2, 3, 3, 4), (5, 2, 3, 4)),
    ({"transBatchB": 1}, (2, 3, 3, 4), (4, 2, 3, 5)),
])
def test_fused_matmul(attrs, a_shape, b_shape):
    rng = np.random.default_rng(1)
    a, b = randn(rng, *a_shape), randn(rng, *b_shape)

    def view(x, tb, t):  # ORT's definition: batch transpose moves dim 0 behind the batch dims
        x = np.asarray(x, np.float64)
        if tb:
            x = np.moveaxis(x, 0, -2)
        return np.swapaxes(x, -1, -2) if t else x

    want = attrs.get("alpha", 1.0) * np.matmul(view(a, attrs.get("transBatchA"), attrs.get("transA")),
                                               view(b, attrs.get("transBatchB"), attrs.get("transB")))
    check("FusedMatMul", [a, b], attrs, [want])


ACTIVATIONS = {
    "Relu": (lambda y, p: np.maximum(y, 0), {}),
    "LeakyRelu": (lambda y, p: np.where(y >= 0, y, p.get("alpha", 0.01) * y), {"alpha": 0.2}),
    "Sigmoid": (lambda y, p: sigmoid(y), {}),
    "Tanh": (lambda y, p: np.tanh(y), {}),
    "HardSigmoid": (lambda y, p: np.clip(p.get("alpha", 0.2) * y + p.get("beta", 0.5), 0, 1),
                    {"alpha": 0.3, "beta": 0.4}),
}


@pytest.mark.parametrize("activation", [None, *ACTIVATIONS])
def test_fused_gemm(activation):
    rng = np.random.default_rng(2)
    a, b, c = randn(rng, 4, 6), randn(rng, 5, 6), randn(rng, 5)
    attrs = {"transB": 1, "alpha": 0.7, "beta": 1.5}
    params = {}
    if activation:
        fn, params = ACTIVATIONS[activation]
        attrs["activation"] = activation
        attrs.update({f"activation_{k}": v for k, v in params.items()})
    y = 0.7 * (a.astype(np.float64) @ b.T) + 1.5 * c
    # ORT's CPU FusedGemm insists on an activation ("unknown kernel type" without one)
    check("FusedGemm", [a, b, c], attrs, [y if not activation else fn(y, params)], with_ort=activation is not None)


@pytest.mark.parametrize("activation, params", [
    (None, []), ("Relu", []), ("LeakyRelu", [0.3]), ("Sigmoid", []), ("Tanh", []),
    ("HardSigmoid", [0.25, 0.45]), ("Clip", [-0.5, 0.75])])
@pytest.mark.parametrize("with_z", [False, True])
def test_fused_conv(activation, params, with_z):
    rng = np.random.default_rng(3)
    x, w, b = randn(rng, 2, 4, 7, 6), randn(rng, 6, 2, 3, 3, scale=0.3), randn(rng, 6)
    attrs = {"pads": [1, 0, 1, 1], "strides": [2, 1], "group": 2}
    if activation:
        attrs["activation"] = activation
        if params:
            attrs["activation_params"] = params
    # the convolution in float64 by direct summation (groups of 2 input channels, 3 output channels)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (0, 1)))
    oh, ow = (xp.shape[2] - 3) // 2 + 1, xp.shape[3] - 3 + 1
    y = np.zeros((2, 6, oh, ow))
    for m in range(6):
        g = m // 3
        for i in range(oh):
            for j in range(ow):
                y[:, m, i, j] = np.einsum("ncij,cij->n", xp[:, 2 * g:2 * g + 2, 2 * i:2 * i + 3, j:j + 3], w[m])
    y += b.reshape(1, 6, 1, 1)
    z = randn(rng, *y.shape) if with_z else None
    if with_z:
        y = y + z
    named = dict(zip({"LeakyRelu": ["alpha"], "HardSigmoid": ["alpha", "beta"]}.get(activation, []), params))
    if activation == "Clip":
        y = np.clip(y, *params)
    elif activation:
        y = ACTIVATIONS[activation][0](y, named)
    check("FusedConv", [x, w, b, z], attrs, [y])


def test_fused_activation_not_supported_is_refused_at_load():
    model, _ = one_node("FusedGemm", [np.ones((2, 2), np.float32)] * 2, {"activation": "Erf"})
    with pytest.raises(UnsupportedOperatorError, match="activation='Erf'"):
        ai.Worker(ai.load_model(model), "cpu")


# -- layer normalizations ---------------------------------------------------------------------------------
@pytest.mark.parametrize("skip_shape", [(2, 5, 16), (1, 5, 16), (5, 16)])
@pytest.mark.parametrize("with_beta, with_bias", [(True, True), (False, False), (True, False)])
def test_skip_layer_normalization(skip_shape, with_beta, with_bias):
    rng = np.random.default_rng(4)
    x, skip = randn(rng, 2, 5, 16), randn(rng, *skip_shape)
    gamma, beta, bias = randn(rng, 16), randn(rng, 16) if with_beta else None, randn(rng, 16) if with_bias else None
    s = x.astype(np.float64) + skip + (0 if bias is None else bias)
    y, mean, inv = layer_norm(s, gamma, beta, 1e-5)
    check("SkipLayerNormalization", [x, skip, gamma, beta, bias], {"epsilon": 1e-5},
          [y.astype(np.float32), mean.astype(np.float32), inv.astype(np.float32), s.astype(np.float32)])


def test_skip_layer_normalization_default_epsilon_and_single_output():
    rng = np.random.default_rng(5)
    x, skip, gamma = randn(rng, 3, 4, 8), randn(rng, 3, 4, 8), randn(rng, 8)
    check("SkipLayerNormalization", [x, skip, gamma], None, [layer_norm(x + skip.astype(np.float64), gamma,
                                                                        None, 1e-12)[0]])
    # only the sum is read: the optional outputs in between are left out of the node
    check("SkipLayerNormalization", [x, skip, gamma], None,
          [layer_norm(x + skip.astype(np.float64), gamma, None, 1e-12)[0], None, None, x + skip.astype(np.float64)],
          outputs=["o0", "", "", "o3"])


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_simplified_layer_normalization(with_bias):
    rng = np.random.default_rng(6)
    x, skip, gamma = randn(rng, 2, 3, 16), randn(rng, 2, 3, 16), randn(rng, 16)
    bias = randn(rng, 16) if with_bias else None
    s = x.astype(np.float64) + skip + (0 if bias is None else bias)
    y, inv = rms_norm(s, gamma, 1e-6)
    # ORT writes zeros for the mean output of the RMS norms (an RMS norm has no mean)
    check("SkipSimplifiedLayerNormalization", [x, skip, gamma, bias], {"epsilon": 1e-6},
          [y, np.zeros((2, 3, 1), np.float32), inv.astype(np.float32), s.astype(np.float32)])


@pytest.mark.parametrize("axis", [-1, 1])
def test_simplified_layer_normalization(axis):
    """ORT's RMS norm lives in the ONNX domain (version 1), where its optimizer writes it."""
    rng = np.random.default_rng(7)
    x = randn(rng, 2, 3, 8)
    gamma = randn(rng, *x.shape[axis % 3:])
    y, inv = rms_norm(x, gamma, 1e-5, axis)
    check("SimplifiedLayerNormalization", [x, gamma], {"axis": axis}, [y, inv.astype(np.float32)], domain="")
    # the com.microsoft spelling is accepted too (ORT does not know it there: no second opinion)
    check("SimplifiedLayerNormalization", [x, gamma], {"axis": axis}, [y, inv.astype(np.float32)], with_ort=False)


def test_layer_normalization_of_opsets_before_17():
    """ORT's fusions write LayerNormalization into models of any opset; before 17 it is ORT's schema."""
    rng = np.random.default_rng(8)
    x, gamma, beta = randn(rng, 2, 3, 8), randn(rng, 8), randn(rng, 8)
    y, mean, inv = layer_norm(x, gamma, beta, 1e-5)
    check("LayerNormalization", [x, gamma, beta], None, [y, mean.astype(np.float32), inv.astype(np.float32)],
          domain="", opset=13)


@pytest.mark.parametrize("segments, mask, position_ids", [
    (True, "prefix", None), (True, "holes", "batch"), (False, None, "shared"), (True, None, None)])
def test_embed_layer_normalization(segments, mask, position_ids):
    rng = np.random.default_rng(9)
    batch, seq, hidden = 2, 6, 8
    ids = rng.integers(0, 20, (batch, seq)).astype(np.int32)
    seg_ids = rng.integers(0, 2, (batch, seq)).astype(np.int32) if segments else None
    word, pos_table, seg_table = randn(rng, 20, hidden), randn(rng, 10, hidden), randn(rng, 2, hidden)
    gamma, beta = randn(rng, hidden), randn(rng, hidden)
    masks = {"prefix": np.array([[1, 1, 1, 1, 0, 0], [1] * 6]), "holes": np.array([[1, 0, 1, 1, 0, 1], [0] * 6])}
    m = None if mask is None else masks[mask].astype(np.int32)
    pids = {"batch": rng.integers(0, 10, (batch, seq)), "shared": rng.integers(0, 10, (1, seq)),
            None: None}[position_ids]
    pids = None if pids is None else pids.astype(np.int32)
    positions = np.arange(seq)[None] if pids is None else pids
    total = word[ids].astype(np.float64) + pos_table[positions] + (seg_table[seg_ids] if segments else 0)
    y = layer_norm(total, gamma, beta, 1e-12)[0]
    # mask_index: per row the count of ones (ORT's CPU kernel counts them; zeros without a mask)
    mask_index = (np.zeros(batch) if m is None else (m == 1).sum(1)).astype(np.int32)
    check("EmbedLayerNormalization",
          [ids, seg_ids, word, pos_table, seg_table if segments else None, gamma, beta, m, pids], None,
          [y, mask_index, total.astype(np.float32)])


def test_embed_layer_normalization_ids_out_of_range():
    rng = np.random.default_rng(10)
    ids = np.array([[1, 25]], np.int32)
    model, feeds = one_node("EmbedLayerNormalization", [ids, None, randn(rng, 20, 4), randn(rng, 4, 4), None,
                                                        randn(rng, 4), randn(rng, 4)], None, 1)
    with pytest.raises(ExecutionError, match=r"input ids must lie in \[0, 20\)"):
        run_ours(model, feeds)


# -- Attention ------------------------------------------------------------------------------------------
def attention_reference(x, w, bias, n, sizes, masked, attention_bias, past, scale, fill=-10000.0):
    """ORT's Attention: packed projection, masked keys' bias = mask_filter_value, then softmax."""
    qkv = x.astype(np.float64) @ w + (0 if bias is None else bias)
    q, k, v = np.split(qkv, np.cumsum(sizes)[:2], axis=2)
    q, k, v = heads(q, n), heads(k, n), heads(v, n)
    if past is not None:
        k, v = np.concatenate([past[0], k], 2), np.concatenate([past[1], v], 2)
    add = np.where(masked, fill, 0.0) if masked is not None else 0.0
    if attention_bias is not None:
        add = add + attention_bias
    scale = scale or 1 / math.sqrt(q.shape[-1])
    return merge(attend(q, k, v, add, scale)), np.stack([k, v]) if k.shape == v.shape else None


def _key_padding_mask(form: str, rng, lengths: np.ndarray, b: int, s: int, total: int):
    """An attention mask in ``form`` ("lengths": one key count per batch entry; "2d": (B, total);
    "3d": (B, S, total)) and the (B, 1|heads, S, total)-broadcastable boolean of masked keys."""
    if form == "lengths":
        keys = np.arange(total)
        return lengths.astype(np.int32), keys[None, None, None] >= lengths[:, None, None, None]
    if form == "2d":
        mask = (rng.random((b, total)) > 0.3).astype(np.int32)
        return mask, (mask == 0)[:, None, None]
    mask = (rng.random((b, s, total)) > 0.3).astype(np.int32)
    return mask, (mask == 0)[:, None]


@pytest.mark.parametrize("mask_form", [None, "lengths", "ends_starts", "2d", "3d", "4d"])
@pytest.mark.parametrize("past_len, unidirectional", [(0, 0), (3, 1), (2, 0)])
def test_attention_mask_forms_and_past(mask_form, past_len, unidirectional):
    rng = np.random.default_rng(11)
    b, s, d, n = 2, 4, 16, 4
    total = past_len + s
    x, w, bias = randn(rng, b, s, d), randn(rng, d, 3 * d, scale=0.3), randn(rng, 3 * d)
    past = randn(rng, 2, b, n, past_len, d // n) if past_len else None
    keys = np.arange(total)
    lengths = np.array([total - 1, total - 2])
    starts = np.array([1, 0])
    if mask_form in ("lengths", "2d", "3d"):
        mask, masked = _key_padding_mask(mask_form, rng, lengths, b, s, total)
    elif mask_form == "ends_starts":
        mask = np.concatenate([lengths, starts]).astype(np.int32)
        masked = (keys >= lengths[:, None]) | (keys < starts[:, None])
        masked = masked[:, None, None]
    elif mask_form == "4d":  # Megatron: (B, 1, max, max), rows past..past+S used
        mask = (rng.random((b, 1, 10, 10)) > 0.3).astype(np.int32)
        masked = (mask[:, :, past_len:past_len + s, :total] == 0)
    else:
        mask, masked = None, None
    if unidirectional:
        causal = keys[None, :] > past_len + np.arange(s)[:, None]
        masked = causal if masked is None else masked | causal
    y, present = attention_reference(x, w, bias, n, [d] * 3, masked, None, past, None)
    attrs = {"num_heads": n, "unidirectional": unidirectional}
    # ORT's CPU kernel refuses the 4-D (Megatron) mask: the documented reading alone judges it
    check("Attention", [x, w, bias, mask, past], attrs, [y, present if past is not None else None],
          n_outputs=2 if past is not None else 1, with_ort=mask_form != "4d")


def test_attention_sizes_scale_bias_and_filter_value():
    rng = np.random.default_rng(12)
    b, s, d, n = 2, 3, 12, 2
    sizes = [8, 8, 6]
    x, w, bias = randn(rng, b, s, d), randn(rng, d, 22, scale=0.3), randn(rng, 22)
    attention_bias = randn(rng, 1, n, s, s)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.int32)
    masked = (mask == 0)[:, None, None]
    y, _ = attention_reference(x, w, bias, n, sizes, masked, attention_bias, None, 0.3, fill=-50.0)
    check("Attention", [x, w, bias, mask, None, attention_bias],
          {"num_heads": n, "qkv_hidden_sizes": sizes, "scale": 0.3, "mask_filter_value": -50.0}, [y])


def test_attention_fully_masked_row_matches_ort():
    """Masked keys get the (finite) filter value: a row masked everywhere is the plain softmax."""
    rng = np.random.default_rng(13)
    x, w = randn(rng, 1, 3, 8), randn(rng, 8, 24, scale=0.3)
    mask = np.zeros((1, 3), np.int32)
    y, _ = attention_reference(x, w, None, 2, [8] * 3, np.ones((1, 1, 1, 3), bool), None, None, None)
    # scores near -10000 keep ~1e-3 of their float32 precision, in ORT as here (-inf would give NaN or 0)
    check("Attention", [x, w, None, mask], {"num_heads": 2}, [y], rtol=5e-3, atol=5e-3)


def test_attention_refuses_what_it_does_not_implement():
    x = np.ones((1, 2, 8), np.float32)
    for attrs in ({"num_heads": 2, "do_rotary": 1}, {"num_heads": 2, "past_present_share_buffer": 1},
                  {"num_heads": 2, "qkv_hidden_sizes": [8, 6, 10]}):
        model, _ = one_node("Attention", [x, np.ones((8, 24), np.float32)], attrs)
        with pytest.raises(UnsupportedOperatorError):
            ai.Worker(ai.load_model(model), "cpu")
    model, feeds = one_node("Attention", [x, np.ones((8, 24), np.float32), None, np.ones((5, 5), np.int32)],
                            {"num_heads": 2})
    with pytest.raises(ExecutionError, match="mask of shape"):
        run_ours(model, feeds)


# -- MultiHeadAttention -----------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["separate", "packed_kv", "packed_qkv", "bnsh_kv"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_multi_head_attention_input_forms(form, with_bias):
    rng = np.random.default_rng(14)
    b, s, kv, n, h = 2, 3, 5, 2, 4
    d = n * h
    if form == "packed_qkv":
        kv = s
    q, k, v = randn(rng, b, s, d), randn(rng, b, kv, d), randn(rng, b, kv, d)
    bias = randn(rng, 3 * d) if with_bias else None
    qb = q + (bias[:d] if with_bias else 0)
    kb = k + (bias[d:2 * d] if with_bias and form != "bnsh_kv" else 0)
    vb = v + (bias[2 * d:] if with_bias and form != "bnsh_kv" else 0)
    y = merge(attend(heads(qb, n), heads(kb, n), heads(vb, n), 0.0, 1 / math.sqrt(h)))
    if form == "separate":
        inputs = [q, k, v, bias]
    elif form == "packed_kv":
        inputs = [q, np.stack([k.reshape(b, kv, n, h), v.reshape(b, kv, n, h)], axis=3), None, bias]
    elif form == "packed_qkv":
        inputs = [np.stack([x.reshape(b, s, n, h) for x in (q, k, v)], axis=3), None, None, bias]
    else:  # keys already in heads: no bias on them
        inputs = [q, k.reshape(b, kv, n, h).transpose(0, 2, 1, 3), v.reshape(b, kv, n, h).transpose(0, 2, 1, 3), bias]
    # ORT's CPU kernel runs the separate and BNSH forms; packed K/V and Q/K/V only on CUDA
    check("MultiHeadAttention", inputs, {"num_heads": n}, [y], with_ort=form in ("separate", "bnsh_kv"))


@pytest.mark.parametrize("mask_form", [None, "lengths", "2d", "3d"])
@pytest.mark.parametrize("past_len, unidirectional", [(0, 0), (2, 1), (3, 0)])
def test_multi_head_attention_masks_bias_and_cache(mask_form, past_len, unidirectional):
    rng = np.random.default_rng(15)
    b, s, n, h = 2, 3, 2, 4
    d, total = n * h, past_len + s
    q, k, v, bias = randn(rng, b, s, d), randn(rng, b, s, d), randn(rng, b, s, d), randn(rng, 3 * d)
    past_k = randn(rng, b, n, past_len, h) if past_len else None
    past_v = randn(rng, b, n, past_len, h) if past_len else None
    attention_bias = randn(rng, b, 1, s, total)
    keys = np.arange(total)
    if mask_form is not None:
        mask, masked = _key_padding_mask(mask_form, rng, np.array([total, total - 1]), b, s, total)
    else:
        mask, masked = None, None
    if unidirectional:
        causal = keys[None, :] > past_len + np.arange(s)[:, None]
        masked = causal if masked is None else masked | causal
    kh, vh = heads(k + bias[d:2 * d], n), heads(v + bias[2 * d:], n)
    if past_len:
        kh, vh = np.concatenate([past_k, kh], 2), np.concatenate([past_v, vh], 2)
    add = (0.0 if masked is None else np.where(masked, -10000.0, 0.0)) + attention_bias
    y = merge(attend(heads(q + bias[:d], n), kh, vh, add, 1 / math.sqrt(h)))
    check("MultiHeadAttention", [q, k, v, bias, mask, attention_bias, past_k, past_v],
          {"num_heads": n, "unidirectional": unidirectional},
          [y, kh if past_len else None, vh if past_len else None], n_outputs=3 if past_len else 1)


def test_multi_head_attention_refuses_decoder_buffers():
    q = np.ones((1, 2, 8), np.float32)
    model, _ = one_node("MultiHeadAttention", [q, q, q, None, None, None, None, None, np.array([0], np.int32)],
                        {"num_heads": 2})
    with pytest.raises(UnsupportedOperatorError, match="past_sequence_length"):
        ai.Worker(ai.load_model(model), "cpu")


# -- RotaryEmbedding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["3d", "4d"])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("positions", ["start", "batch"])
def test_rotary_embedding(layout, interleaved, positions):
    rng = np.random.default_rng(16)
    b, s, n, h, max_seq = 2, 3, 2, 8, 12
    x4 = randn(rng, b, n, s, h)
    angles = rng.random((max_seq, h // 2)) * 3
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pos = np.array([4], np.int64) if positions == "start" else rng.integers(0, max_seq, (b, s)).astype(np.int64)
    full = np.broadcast_to(pos[0] + np.arange(s), (b, s)) if positions == "start" else pos
    y4 = rotate(x4, cos[full][:, None], sin[full][:, None], interleaved)
    if layout == "4d":
        check("RotaryEmbedding", [x4, pos, cos, sin], {"interleaved": interleaved}, [y4])
    else:
        x3 = x4.transpose(0, 2, 1, 3).reshape(b, s, n * h)
        check("RotaryEmbedding", [x3, pos, cos, sin], {"interleaved": interleaved}, [merge(y4)])


def test_rotary_embedding_partial_dimension():
    rng = np.random.default_rng(17)
    b, s, n, h, rot = 1, 4, 2, 8, 4
    x3 = randn(rng, b, s, n * h)
    angles = rng.random((6, rot // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pos = np.array([[0, 2, 1, 5]], np.int64)
    y4 = rotate(heads(x3, n), cos[pos][:, None], sin[pos][:, None], False, rot)
    check("RotaryEmbedding", [x3, pos, cos, sin], {"num_heads": n, "rotary_embedding_dim": rot}, [merge(y4)])


def test_rotary_embedding_position_outside_the_cache():
    x = np.ones((1, 2, 8), np.float32)
    cache = np.ones((4, 4), np.float32)
    model, feeds = one_node("RotaryEmbedding", [x, np.array([3], np.int64), cache, cache], None)
    with pytest.raises(ExecutionError, match="outside the 4 rows"):
        run_ours(model, feeds)


# -- GroupQueryAttention ---------------------------------------------------------------------------------
def gqa_reference(q, k, v, past_k, past_v, lengths, total, n, nkv, *, window=-1, rotary=None, softcap=0.0,
                  sink=None, attention_bias=None, causal=True):
    """ORT's GroupQueryAttention, row by row: the row's past (its first ``length - S`` tokens, or none
    for the first prompt), then its new tokens; each query sees the row's keys at or before it, within
    the window; K/V head ``i // (n / nkv)`` serves query head i. Returns (output, present_k, present_v)."""
    b, s, _ = q.shape
    qh, kh, vh = heads(q, n), heads(k, nkv), heads(v, nkv)
    first = s == total
    slots = max(total, 0 if past_k is None else past_k.shape[2])
    pk, pv = np.zeros((b, nkv, slots, qh.shape[3])), np.zeros((b, nkv, slots, qh.shape[3]))
    out = np.zeros((b, n, s, qh.shape[3]))
    scale = 1 / math.sqrt(qh.shape[3])
    for r in range(b):
        past = 0 if first else lengths[r] - s
        pos = past + np.arange(s)
        qr, kr = qh[r], kh[r]
        if rotary is not None:
            cos, sin, interleaved = rotary
            qr, kr = rotate(qr, cos[pos], sin[pos], interleaved), rotate(kr, cos[pos], sin[pos], interleaved)
        if past:
            pk[r, :, :past], pv[r, :, :past] = past_k[r, :, :past], past_v[r, :, :past]
        pk[r, :, past:past + s], pv[r, :, past:past + s] = kr, vh[r]
        for i in range(n):
            scores = qr[i] @ pk[r, i // (n // nkv)].T * scale
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            if attention_bias is not None:
                scores = scores + np.pad(attention_bias[min(r, attention_bias.shape[0] - 1),
                                                        min(i, attention_bias.shape[1] - 1)],
                                         ((0, 0), (0, slots - attention_bias.shape[3])))
            keys = np.arange(slots)
            ok = keys[None, :] < lengths[r]
            if causal:
                ok = ok & (keys[None, :] <= pos[:, None])
            if window > 0:  # the window's most recent keys, the query's own included
                ok = ok & (keys[None, :] > pos[:, None] - window)
            scores = np.where(ok, scores, -np.inf)
            peak = scores.max(-1, keepdims=True)
            if sink is not None:
                peak = np.maximum(peak, sink[i])
            e = np.exp(scores - peak)
            denominator = e.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink[i] - peak))
            out[r, i] = (e / denominator) @ pv[r, i // (n // nkv)]
    return merge(out), pk, pv


def gqa_case(rng, *, b, s, past_cap, lengths, n=4, nkv=2, h=8, packed=False, rotary=False, interleaved=0,
             **attrs):
    lengths = np.asarray(lengths)
    total = int(lengths.max())
    q, k, v = randn(rng, b, s, n * h), randn(rng, b, s, nkv * h), randn(rng, b, s, nkv * h)
    past_k = randn(rng, b, nkv, past_cap, h) if past_cap else None
    past_v = randn(rng, b, nkv, past_cap, h) if past_cap else None
    cos = sin = None
    if rotary:
        angles = rng.random((32, h // 2)) * 3
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    inputs = [np.concatenate([q, k, v], axis=2) if packed else q, None if packed else k, None if packed else v,
              past_k, past_v, (lengths - 1).astype(np.int32), np.array(total, np.int32), cos, sin]
    node_attrs = {"num_heads": n, "kv_num_heads": nkv, **attrs}
    if rotary:
        node_attrs.update(do_rotary=1, rotary_interleaved=interleaved)
    return inputs, node_attrs, (q, k, v, past_k, past_v, lengths, total, n, nkv), (cos, sin, interleaved) if rotary else None


def valid_rows(lengths, s, total):
    """Output i's defined part: the queries of each row that are real tokens, the cache rows filled."""
    first = s == total

    def pick(i, a):
        if i == 0 and first:  # padded queries of a first prompt are undefined
            return np.concatenate([a[r, :lengths[r]].ravel() for r in range(a.shape[0])])
        if i in (1, 2):
            return np.concatenate([a[r, :, :lengths[r]].ravel() for r in range(a.shape[0])])
        return a
    return pick


@pytest.mark.parametrize("case", [
    dict(b=2, s=5, past_cap=0, lengths=[5, 3]),                  # first prompt, right padding
    dict(b=2, s=1, past_cap=6, lengths=[5, 7]),                  # ragged decode step into a shared buffer
    dict(b=1, s=3, past_cap=4, lengths=[7]),                      # a chunk after a past
    dict(b=2, s=1, past_cap=6, lengths=[6, 4], packed=True),
    dict(b=2, s=4, past_cap=0, lengths=[4, 4], rotary=True, h=16),  # ORT's rotary: head size % 16 == 0
    dict(b=2, s=1, past_cap=8, lengths=[6, 9], rotary=True, interleaved=1, h=16),
    dict(b=1, s=6, past_cap=0, lengths=[6], local_window_size=2),
    dict(b=2, s=1, past_cap=8, lengths=[8, 9], local_window_size=3),
    dict(b=2, s=3, past_cap=0, lengths=[3, 3], softcap=2.0),
], ids=["prompt-padded", "decode-ragged", "chunk", "packed", "rotary", "rotary-interleaved-decode",
        "window-prompt", "window-decode", "softcap"])
def test_group_query_attention(case):
    rng = np.random.default_rng(18)
    inputs, attrs, args, rotary = gqa_case(rng, **case)
    y, pk, pv = gqa_reference(*args, window=attrs.get("local_window_size", -1), rotary=rotary,
                              softcap=attrs.get("softcap", 0.0))
    lengths, total = args[5], args[6]
    check("GroupQueryAttention", inputs, attrs, [y.astype(np.float32), pk, pv],
          rows=valid_rows(lengths, case["s"], total))


@pytest.mark.parametrize("sink", ["head_sink", "smooth_softmax"])
def test_group_query_attention_sinks_and_bias(sink):
    rng = np.random.default_rng(19)
    inputs, attrs, args, _ = gqa_case(rng, b=2, s=1, past_cap=5, lengths=[6, 4])
    attention_bias = randn(rng, 2, 1, 1, 6)
    sinks = randn(rng, 4) if sink == "head_sink" else np.zeros(4, np.float32)
    inputs += [None, attention_bias, sinks if sink == "head_sink" else None]
    if sink == "smooth_softmax":
        attrs["smooth_softmax"] = 1
    y, pk, pv = gqa_reference(*args, sink=sinks, attention_bias=attention_bias)
    check("GroupQueryAttention", inputs, attrs, [y.astype(np.float32), pk, pv], rows=valid_rows(args[5], 1, 6))


def test_group_query_attention_refuses_quantized_cache_and_bad_lengths():
    rng = np.random.default_rng(20)
    inputs, attrs, _, _ = gqa_case(rng, b=1, s=1, past_cap=4, lengths=[5])
    model, _ = one_node("GroupQueryAttention", inputs, {**attrs, "k_quant_type": "PER_TENSOR"}, 3)
    with pytest.raises(UnsupportedOperatorError, match="quantized KV cache"):
        ai.Worker(ai.load_model(model), "cpu")
    inputs[5] = np.array([9], np.int32)  # a length past total_sequence_length
    model, feeds = one_node("GroupQueryAttention", inputs, attrs, 3)
    with pytest.raises(ExecutionError, match="seqlens_k"):
        run_ours(model, feeds)


# -- the real thing: models fused by ORT's transformer optimizer ------------------------------------------
def _optimize(tmp_path, model: onnx.ModelProto, name: str, model_type: str, heads: int, hidden: int) -> onnx.ModelProto:
    pytest.importorskip("sympy", reason="ORT's transformer optimizer needs sympy (symbolic shape inference)")
    from onnxruntime.transformers.optimizer import optimize_model

    src = tmp_path / f"{name}.onnx"
    onnx.save(model, src)
    # opt_level=0: only the Python fusions (ORT's own graph optimizer pass would need torch)
    fused = optimize_model(str(src), model_type=model_type, num_heads=heads, hidden_size=hidden, opt_level=0)
    dst = tmp_path / f"{name}_fused.onnx"
    fused.save_model_to_file(str(dst))
    return onnx.load(dst)


def _ms_ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node if n.domain == MS)


def _feeds_for(model: onnx.ModelProto, feeds: dict) -> dict:
    """``feeds`` in the input types of ``model`` (the optimizer casts masks and ids to int32)."""
    types = {i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type) for i in model.graph.input}
    return {k: v.astype(types[k]) for k, v in feeds.items() if k in types}


def _agree(original: onnx.ModelProto, fused: onnx.ModelProto, feeds: dict, backends: tuple[str, ...]) -> None:
    fused_feeds = _feeds_for(fused, feeds)
    on_fused = run_ort(fused, fused_feeds)
    on_original = run_ort(original, _feeds_for(original, feeds))
    for backend in backends:
        placed: dict = {}
        ours = run_ours(fused, fused_feeds, backend, placed)
        # no backend but the CPU has kernels for these ops: a device worker places them on the CPU
        assert {placed[n.name] for n in fused.graph.node if n.domain == MS and n.name in placed} == {"cpu"}, placed
        for out, got, a, b in zip(fused.graph.output, ours, on_fused, on_original):
            for want, what in ((a, "ORT on the fused model"), (b, "ORT on the original model")):
                err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
                assert err <= 1e-3, f"{backend}: {out.name} differs from {what} by {err:.2e} (relative)"


def _backends() -> tuple[str, ...]:
    from pixel_testing import pixel_unavailable_reason

    return ("cpu",) if pixel_unavailable_reason() else ("cpu", "gpu_pixel")


def _hf_bert(layers=2, hidden=64, heads=4):
    """bench's bert_tiny, small, with its extended mask built by two Unsqueeze nodes as HF exports it:
    ORT's Attention fusion matches only that (one Unsqueeze with axes [1, 2] is left unfused)."""
    from bench.architectures import bert_tiny

    model = bert_tiny(layers=layers, hidden=hidden, heads=heads, ffn=2 * hidden, vocab=100, max_positions=32,
                      hf_mask=True)
    onnx.checker.check_model(model)
    return model


def test_bert_fused_by_ort_optimizer(tmp_path):
    original = _hf_bert()
    fused = _optimize(tmp_path, original, "bert", "bert", 4, 64)
    ops = _ms_ops(fused)
    assert ops["Attention"] == 2 and ops["SkipLayerNormalization"] == 4, ops
    assert ops["EmbedLayerNormalization"] == 1 and ops["BiasGelu"] == 2, ops
    rng = np.random.default_rng(21)
    mask = np.ones((2, 7), np.int64)
    mask[1, 5:] = 0  # right padding: EmbedLayerNormalization's mask_index is the row length
    types = np.zeros((2, 7), np.int64)
    types[:, 4:] = 1
    feeds = {"input_ids": rng.integers(0, 100, (2, 7)), "attention_mask": mask, "token_type_ids": types}
    _agree(original, fused, feeds, _backends())


def test_gpt2_decode_fused_by_ort_optimizer(tmp_path):
    """bench's gpt2_decode (separate past key/value inputs): ORT fuses its layer norms and GELUs; its
    GPT-2 Attention fusion wants the packed ``past`` of older exports (next test), so no Attention."""
    from bench.architectures import gpt2_decode

    original = gpt2_decode(layers=2, hidden=64, heads=4, vocab=100, max_positions=32)
    fused = _optimize(tmp_path, original, "gpt2", "gpt2", 4, 64)
    ops = _ms_ops(fused)
    assert ops["SkipLayerNormalization"] >= 4 and ops["FastGelu"] == 2 and "Attention" not in ops, ops
    rng = np.random.default_rng(22)
    feeds = {"input_ids": np.array([[5], [7]]), "position_ids": np.array([[3], [3]])}
    for i in range(2):
        feeds[f"past_key_values.{i}.key"] = randn(rng, 2, 4, 3, 16)
        feeds[f"past_key_values.{i}.value"] = randn(rng, 2, 4, 3, 16)
    _agree(original, fused, feeds, _backends())


def _gpt2_packed_past(layers=2, hidden=64, heads=4, vocab=100, max_positions=32) -> onnx.ModelProto:
    """GPT-2 as transformers 4.x exported it with past: one ``past_i`` (2, B, N, P, H) per layer split
    and squeezed into K/V, ``present_i`` stacked back, the causal mask sliced from the ``bias``
    buffer by the score shape, the attention mask applied as ``(1 - mask) * -10000``."""
    from bench.architectures import FLOAT, INT64, GraphBuilder, _conv1d_gpt

    g = GraphBuilder("gpt2_packed_past", seed=3)
    d = hidden // heads
    ids = g.input("input_ids", INT64, ["batch", "sequence"])
    positions = g.input("position_ids", INT64, ["batch", "sequence"])
    mask = g.input("attention_mask", INT64, ["batch", "total_sequence"])
    pasts = [g.input(f"past_{i}", FLOAT, [2, "batch", heads, "past_sequence", d]) for i in range(layers)]
    h = g.op("Add", g.op("Gather", g.weight([vocab, hidden], 1, gain=0.3), ids, axis=0),
             g.op("Gather", g.weight([max_positions, hidden], 1, gain=0.1), positions, axis=0))
    m = g.op("Unsqueeze", g.op("Unsqueeze", g.op("Reshape", mask, g.ints([0, -1])), g.ints([1])), g.ints([2]))
    ext = g.op("Mul", g.op("Sub", g.scalar(1.0), g.op("Cast", m, to=FLOAT)), g.scalar(-10000.0))
    bias = g.const(np.tril(np.ones((max_positions, max_positions), dtype=bool))[None, None], "causal_bias")
    presents = []
    for i, past in enumerate(pasts):
        qkv = _conv1d_gpt(g, g.layernorm(h, hidden), hidden, 3 * hidden)
        q, k, v = (g.op("Transpose", g.op("Reshape", t, g.ints([0, 0, heads, d])), perm=[0, 2, 1, 3])
                   for t in g.op("Split", qkv, g.ints([hidden] * 3), axis=2, outputs=3))
        past_k, past_v = (g.op("Squeeze", t, g.ints([0])) for t in g.op("Split", past, g.ints([1, 1]), axis=0,
                                                                          outputs=2))
        key, value = g.op("Concat", past_k, k, axis=-2), g.op("Concat", past_v, v, axis=-2)
        presents.append(g.op("Concat", g.op("Unsqueeze", key, g.ints([0])), g.op("Unsqueeze", value, g.ints([0])),
                             axis=0))
        w = g.op("Div", g.op("MatMul", q, g.op("Transpose", key, perm=[0, 1, 3, 2])), g.scalar(math.sqrt(d)))
        shape = g.op("Shape", w)
        ns = g.op("Squeeze", g.op("Slice", shape, g.ints([-1]), g.ints([2 ** 62]), g.ints([0])), g.ints([0]))
        nd = g.op("Squeeze", g.op("Slice", shape, g.ints([-2]), g.ints([-1]), g.ints([0])), g.ints([0]))
        end = g.op("Unsqueeze", ns, g.ints([0]))
        rows = g.op("Slice", bias, g.op("Unsqueeze", g.op("Sub", ns, nd), g.ints([0])), end, g.ints([2]))
        causal = g.op("Slice", rows, g.ints([0]), end, g.ints([3]))
        scores = g.op("Add", g.op("Where", causal, w, g.scalar(-10000.0)), ext)
        ctx = g.op("MatMul", g.op("Softmax", scores, axis=-1), value)
        merged = g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]), g.ints([0, 0, hidden]))
        h = g.op("Add", _conv1d_gpt(g, merged, hidden, hidden), h)
        f = g.act(_conv1d_gpt(g, g.layernorm(h, hidden), hidden, 4 * hidden, gain=math.sqrt(2.0)), "gelu_tanh")
        h = g.op("Add", _conv1d_gpt(g, f, 4 * hidden, hidden), h)
    g.output(g.op("MatMul", g.layernorm(h, hidden), g.weight([hidden, vocab], hidden)), "logits", FLOAT,
             ["batch", "sequence", vocab])
    for i, present in enumerate(presents):
        g.output(present, f"present_{i}", FLOAT, [2, "batch", heads, "total_sequence", d])
    return g.model()


def test_gpt2_with_past_fused_into_unidirectional_attention(tmp_path):
    original = _gpt2_packed_past()
    fused = _optimize(tmp_path, original, "gpt2_past", "gpt2", 4, 64)
    ops = _ms_ops(fused)
    assert ops["Attention"] == 2 and ops["FastGelu"] == 2 and ops["SkipLayerNormalization"] >= 3, ops
    attention = next(n for n in fused.graph.node if n.op_type == "Attention")
    assert helper.get_attribute_value(next(a for a in attention.attribute if a.name == "unidirectional")) == 1
    assert attention.input[4].startswith("past_") and attention.output[1].startswith("present_")
    rng = np.random.default_rng(23)
    b, s, p = 2, 3, 4
    mask = np.ones((b, p + s), np.int64)
    mask[1, :2] = 0  # left padding in row 1
    feeds = {"input_ids": rng.integers(0, 100, (b, s)), "position_ids": np.tile(np.arange(p, p + s), (b, 1)),
             "attention_mask": mask}
    for i in range(2):
        feeds[f"past_{i}"] = randn(rng, 2, b, 4, p, 16)
    _agree(original, fused, feeds, _backends())


def test_fused_ops_fall_back_to_the_cpu_on_gpu_pixel():
    from pixel_testing import require_pixel

    require_pixel()
    rng = np.random.default_rng(24)
    x, skip, gamma = randn(rng, 2, 3, 8), randn(rng, 2, 3, 8), randn(rng, 8)
    model, feeds = one_node("SkipLayerNormalization", [x, skip, gamma], None)
    placed: dict = {}
    (got,) = run_ours(model, feeds, "gpu_pixel", placed)
    assert set(placed.values()) == {"cpu"}, placed
    close(got, layer_norm(x + skip.astype(np.float64), gamma, None, 1e-12)[0], "SkipLayerNormalization on gpu_pixel")
