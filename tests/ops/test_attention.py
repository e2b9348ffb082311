"""Kernels of asyncinfer/ops/attention.py: Attention, FlexAttention, LinearAttention,
RotaryEmbedding, TensorScatter, CausalConvWithState, SwiGLU and Swish.

Every ONNX backend node test case whose graph uses one of these ops runs through the whole engine,
on every backend (tests/node_cases.py; here: that those cases cover every op and none is expected to fail).
Targeted tests compare Attention (GQA, causal, masks, KV cache, external cache, windows, softcap)
with a float64 NumPy formula written out loop by loop and with onnxruntime, and check refusal of
what is not implemented, narrow-float dtypes, input immutability and thread safety.
"""
from __future__ import annotations

import math
import threading

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer import ops
from asyncinfer.conformance import case_op
from asyncinfer.errors import UnsupportedOperatorError
from asyncinfer.model.ir import Layer
from node_cases import cases_using, expected_failures_among

OPS = {"Attention", "FlexAttention", "LinearAttention", "RotaryEmbedding", "TensorScatter",
       "CausalConvWithState", "SwiGLU", "Swish"}


def _cases() -> dict[str, object]:
    return cases_using(OPS)


def test_node_case_selection_covers_every_op():
    names = _cases()
    assert len(names) >= 140
    assert not expected_failures_among(names)  # every node case of these ops passes on the CPU
    assert {case_op(c) for c in names.values()} >= OPS


# -- helpers --------------------------------------------------------------------------------------
def make_op(op_type: str, attrs: dict | None = None, version: int = 24, inputs: int | list[str] = 3,
            outputs: int | list[str] = 1, domain: str = ""):
    ins = [f"i{k}" for k in range(inputs)] if isinstance(inputs, int) else inputs
    outs = [f"o{k}" for k in range(outputs)] if isinstance(outputs, int) else outputs
    layer = Layer(name="layer", op_type=op_type, inputs=ins, outputs=outs, attrs=dict(attrs or {}),
                  domain=domain, version=version)
    return ops.create(layer)


def run_unmodified(op, *inputs):
    """``op(*inputs)``, asserting no input was written to."""
    before = [None if x is None else x.copy() for x in inputs]
    out = op(*inputs)
    for x, b in zip(inputs, before):
        if x is not None:
            np.testing.assert_array_equal(x, b, err_msg="an input was modified")
    return out


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def reference_attention(q, k, v, mask=None, causal=False, scale=None, softcap=0.0, past=None, nonpad=None,
                        left=-1, right=-1):
    """Float64 attention on 4-D inputs, the masks built element by element from the ONNX text."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    past_len = 0
    if past is not None:
        past_len = past[0].shape[2]
        k, v = np.concatenate([past[0], k], axis=2), np.concatenate([past[1], v], axis=2)
    batch, q_heads, q_len, head = q.shape
    total = k.shape[2]
    group = q_heads // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * (1 / math.sqrt(head) if scale is None else scale)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    bias = np.zeros((batch, q_heads, q_len, total))
    if mask is not None:
        m = np.broadcast_to(mask, bias.shape)
        bias += np.where(m, 0, -np.inf) if mask.dtype == bool else m
    for b in range(batch):
        offset = past_len if nonpad is None else nonpad[b] - q_len
        for i in range(q_len):
            for j in range(total):
                p = offset + i
                if ((causal and j > p) or (left >= 0 and j < p - left) or (right >= 0 and j > p + right)
                        or (nonpad is not None and j >= nonpad[b])):
                    bias[b, :, i, j] = -np.inf
    s = s + bias
    with np.errstate(invalid="ignore"):
        e = np.exp(s - s.max(-1, keepdims=True))
        p = e / e.sum(-1, keepdims=True)
    p = np.where(np.all(bias == -np.inf, axis=-1, keepdims=True), 0, p)
    return p @ v


def to_3d(x):
    b, h, s, d = x.shape
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(b, s, h * d))


# -- Attention vs a float64 formula ----------------------------------------------------------------
ATTENTION_CASES = {
    # name: (q heads, kv heads, q len, kv len, past len, options, opset)
    "gqa_causal_bool_mask": (6, 2, 5, 5, 0, dict(causal=True, mask="bool"), 23),
    "gqa_causal_float_mask_past": (4, 2, 3, 4, 5, dict(causal=True, mask="float"), 23),
    "mqa_cross_scaled_softcap": (4, 1, 3, 7, 0, dict(scale=0.05, softcap=2.5), 23),
    "mha_float_mask_3d": (3, 3, 4, 6, 0, dict(mask="float", three_d=True), 23),
    "gqa_nonpad_causal": (4, 2, 2, 8, 0, dict(causal=True, nonpad=[5, 8]), 24),
    "gqa_short_mask_nonpad": (4, 2, 3, 8, 0, dict(mask="short", nonpad=[4, 6]), 24),
    "window_left_causal_past": (4, 2, 3, 3, 4, dict(causal=True, left=2), 25),
    "window_bidirectional": (2, 2, 6, 6, 0, dict(left=2, right=1, mask="bool"), 25),
}


@pytest.mark.parametrize("name", sorted(ATTENTION_CASES))
def test_attention_matches_float64_formula(name):
    hq, hkv, lq, lkv, lp, opt, opset = ATTENTION_CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    batch, d, dv = 2, 8, 6
    q, k, v = randn(rng, batch, hq, lq, d), randn(rng, batch, hkv, lkv, d), randn(rng, batch, hkv, lkv, dv)
    total = lp + lkv
    mask = {"bool": rng.random((batch, 1, lq, total)) > 0.3,
            "float": randn(rng, lq, total),
            "short": rng.random((batch, hq, lq, 6)) > 0.2}.get(opt.get("mask"))
    past = (randn(rng, batch, hkv, lp, d), randn(rng, batch, hkv, lp, dv)) if lp else None
    nonpad = np.array(opt["nonpad"], dtype=np.int64) if "nonpad" in opt else None
    attrs = {k: v for k, v in dict(is_causal=int(opt.get("causal", False)), scale=opt.get("scale"),
                                    softcap=opt.get("softcap"), left_window_size=opt.get("left"),
                                    right_window_size=opt.get("right")).items() if v is not None}
    if opt.get("three_d"):
        attrs.update(q_num_heads=hq, kv_num_heads=hkv)
    inputs = [to_3d(q), to_3d(k), to_3d(v)] if opt.get("three_d") else [q, k, v]
    inputs += [mask, *(past or (None, None)), nonpad]
    op = make_op("Attention", attrs, version=opset, inputs=[f"i{n}" if x is not None else "" for n, x in
                                                             enumerate(inputs)],
                 outputs=["y", "present_key", "present_value"] if past else ["y"])
    y, present_k, present_v = run_unmodified(op, *inputs)[:3]

    ref_mask = mask
    if mask is not None and mask.shape[-1] < total:  # shorter masks are padded with masked keys
        ref_mask = np.concatenate([mask, np.zeros(mask.shape[:-1] + (total - mask.shape[-1],), bool)], -1)
    expected = reference_attention(q, k, v, ref_mask, opt.get("causal", False), opt.get("scale"),
                                   opt.get("softcap", 0.0), past, nonpad, opt.get("left", -1), opt.get("right", -1))
    if opt.get("three_d"):
        expected = to_3d(expected)
    assert y.dtype == np.float32 and y.shape == expected.shape
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)
    if past is not None:
        np.testing.assert_array_equal(present_k, np.concatenate([past[0], k], axis=2))
        np.testing.assert_array_equal(present_v, np.concatenate([past[1], v], axis=2))


def test_attention_gqa_causal_mask_matches_onnxruntime():
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the reference")
    rng = np.random.default_rng(7)
    q, k, v = randn(rng, 2, 8, 5, 16), randn(rng, 2, 2, 7, 16), randn(rng, 2, 2, 7, 16)
    mask = randn(rng, 2, 1, 5, 7)
    node = helper.make_node("Attention", ["q", "k", "v", "mask"], ["y", "", "", "qk"], is_causal=1,
                            qk_matmul_output_mode=2)
    infos = [helper.make_tensor_value_info(n, TensorProto.FLOAT, x.shape)
             for n, x in zip("q k v mask".split(), (q, k, v, mask))]
    graph = helper.make_graph([node], "g", infos, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                                                   helper.make_tensor_value_info("qk", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 10
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"q": q, "k": k, "v": v, "mask": mask})
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        got = worker.run_blocking(q, k, v, mask)
    np.testing.assert_allclose(got["y"], expected[0], rtol=1e-4, atol=1e-5)
    # ONNX Runtime writes masked scores as -FLT_MAX where ONNX (and the node cases) say -inf
    ort_masked = expected[1] <= np.finfo(np.float32).min
    np.testing.assert_array_equal(np.isneginf(got["qk"]), ort_masked)
    np.testing.assert_allclose(got["qk"][~ort_masked], expected[1][~ort_masked], rtol=1e-4, atol=1e-5)


def test_attention_fully_masked_rows_are_zero_in_every_output():
    rng = np.random.default_rng(3)
    q, k, v = randn(rng, 1, 2, 3, 4), randn(rng, 1, 2, 3, 4), randn(rng, 1, 2, 3, 4)
    mask = np.array([[True, True, False], [False, False, False], [True, False, True]])
    op = make_op("Attention", dict(qk_matmul_output_mode=3), version=23, inputs=4, outputs=["y", "", "", "qk"])
    y, _, _, probs = op(q, k, v, mask)
    assert np.isfinite(y).all() and np.isfinite(probs).all()
    assert not y[:, :, 1].any() and not probs[:, :, 1].any()
    np.testing.assert_allclose(probs[:, :, [0, 2]].sum(-1), 1, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_narrow_float_dtypes_are_kept(dtype):
    rng = np.random.default_rng(1)
    q, k, v = randn(rng, 1, 4, 3, 8, dtype=dtype), randn(rng, 1, 2, 5, 8, dtype=dtype), randn(rng, 1, 2, 5, 8, dtype=dtype)
    y, pk, pv, qk = make_op("Attention", dict(is_causal=1), inputs=3, outputs=4)(q, k, v)
    assert y.dtype == pk.dtype == pv.dtype == qk.dtype == np.dtype(dtype)
    np.testing.assert_allclose(y.astype(np.float64), reference_attention(q, k, v, causal=True), rtol=0.05, atol=0.05)
    x = randn(rng, 1, 4, 3, 8, dtype=dtype)
    cos, sin = randn(rng, 1, 3, 4, dtype=dtype), randn(rng, 1, 3, 4, dtype=dtype)
    assert make_op("RotaryEmbedding", version=23)(x, cos, sin)[0].dtype == np.dtype(dtype)
    assert make_op("SwiGLU", version=28, inputs=2)(x, x)[0].dtype == np.dtype(dtype)
    assert make_op("Swish", version=24, inputs=1)(x)[0].dtype == np.dtype(dtype)
    seq, w = randn(rng, 2, 3, 5, dtype=dtype), randn(rng, 3, 1, 3, dtype=dtype)
    assert {o.dtype for o in make_op("CausalConvWithState", version=27, inputs=2, outputs=2)(seq, w)} == {np.dtype(dtype)}


# -- refusals ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("op_type, attrs, version, inputs", [
    ("Attention", dict(qk_matmul_output_mode=4), 23, 3),
    ("Attention", dict(softmax_precision=TensorProto.INT32), 23, 3),
    ("Attention", {}, 23, ["q", "k", "v", "", "past_key"]),
    ("Attention", {}, 24, ["q", "k", "v", "", "past_key", "past_value", "nonpad"]),
    ("LinearAttention", dict(q_num_heads=2, kv_num_heads=2, update_rule="mamba"), 27, 6),
    ("LinearAttention", dict(q_num_heads=2, kv_num_heads=2, update_rule="gated"), 27, 3),
    ("LinearAttention", dict(q_num_heads=3, kv_num_heads=2, update_rule="linear"), 27, 3),
    ("TensorScatter", dict(mode="ring"), 24, 3),
    ("CausalConvWithState", dict(activation="relu"), 27, 2),
    ("Attention", {}, 22, 3),  # no Attention before opset 23
])
def test_unsupported_is_refused_at_creation(op_type, attrs, version, inputs):
    with pytest.raises(UnsupportedOperatorError):
        make_op(op_type, attrs, version=version, inputs=inputs)


def test_flex_attention_subgraph_with_unknown_op_is_refused_at_load():
    body = helper.make_graph([helper.make_node("NoSuchOp", ["s"], ["t"])], "mod",
                             [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    node = helper.make_node("FlexAttention", ["q", "k", "v"], ["y"], domain="ai.onnx.preview", score_mod=body)
    infos = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, 2, 4]) for n in "qkv"]
    graph = helper.make_graph([node], "g", infos, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26),
                                                    helper.make_opsetid("ai.onnx.preview", 1)])
    with pytest.raises(UnsupportedOperatorError):
        ai.load_model(model)


# -- the other ops ----------------------------------------------------------------------------------
def test_rotary_embedding_rotates_pairs_and_keeps_the_rest():
    rng = np.random.default_rng(5)
    x = randn(rng, 2, 3, 4, 8)  # (B, H, S, D), rotary dim 4 → 2 angles per position
    angles = rng.random((10, 2)) * 6
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pos = rng.integers(0, 10, (2, 4))
    for interleaved in (0, 1):
        op = make_op("RotaryEmbedding", dict(rotary_embedding_dim=4, interleaved=interleaved), version=23, inputs=4)
        y = run_unmodified(op, x, cos, sin, pos)[0]
        pairs = [(0, 1), (2, 3)] if interleaved else [(0, 2), (1, 3)]
        for n, (a, b) in enumerate(pairs):
            c, s = cos[pos, n][:, None], sin[pos, n][:, None]
            np.testing.assert_allclose(y[..., a], c * x[..., a] - s * x[..., b], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(y[..., b], s * x[..., a] + c * x[..., b], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(y[..., 4:], x[..., 4:])


def test_tensor_scatter_writes_per_batch_and_wraps():
    cache = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 4, 3)  # axis 1 is the sequence
    update = -np.ones((2, 2, 3), np.float32)
    idx = np.array([1, 3])
    out = run_unmodified(make_op("TensorScatter", dict(axis=1, mode="circular")), cache, update, idx)[0]
    expected = cache.copy()
    expected[0, 1:3] = -1
    expected[1, [3, 0]] = -1
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ai.ExecutionError):  # linear mode may not run past the end
        with ai.Worker(_one_node_model("TensorScatter", [cache, update, idx], dict(axis=1)), "cpu") as w:
            w.run_blocking(cache, update, idx)


def _one_node_model(op_type, inputs, attrs, opset=24):
    names = [f"i{k}" for k in range(len(inputs))]
    infos = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
             for n, x in zip(names, inputs)]
    graph = helper.make_graph([helper.make_node(op_type, names, ["y"], **attrs)], "g", infos,
                              [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)])
    return ai.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def test_causal_conv_state_carries_across_calls():
    rng = np.random.default_rng(9)
    x, w, bias = randn(rng, 2, 3, 7), randn(rng, 3, 1, 4), randn(rng, 3)
    op = make_op("CausalConvWithState", dict(activation="silu"), version=27, inputs=4, outputs=2)
    whole, state = run_unmodified(op, x, w, bias, None)
    first, carry = op(x[:, :, :5], w, bias, None)
    second, state2 = op(x[:, :, 5:], w, bias, carry)
    np.testing.assert_allclose(np.concatenate([first, second], axis=2), whole, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state, state2)
    np.testing.assert_array_equal(state, x[:, :, -3:])


def test_linear_attention_prefill_equals_decode_steps():
    rng = np.random.default_rng(11)
    b, t, hq, hkv, dk, dv = 2, 5, 4, 2, 3, 4
    q, k, v = randn(rng, b, t, hq * dk), randn(rng, b, t, hkv * dk), randn(rng, b, t, hkv * dv)
    decay, beta = -rng.random((b, t, hkv * dk)).astype(np.float32), rng.random((b, t, hkv)).astype(np.float32)
    op = make_op("LinearAttention", dict(q_num_heads=hq, kv_num_heads=hkv), version=27, inputs=6, outputs=2)
    y, state = run_unmodified(op, q, k, v, None, decay, beta)
    carried = None
    for i in range(t):
        step = slice(i, i + 1)
        yi, carried = op(q[:, step], k[:, step], v[:, step], carried, decay[:, step], beta[:, step])
        np.testing.assert_allclose(yi, y[:, step], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(carried, state, rtol=1e-5, atol=1e-6)


def test_swiglu_is_swish_of_a_times_b():
    rng = np.random.default_rng(2)
    a, b = randn(rng, 3, 5), randn(rng, 3, 5)
    y = run_unmodified(make_op("SwiGLU", dict(alpha=0.7), version=28, inputs=2), a, b)[0]
    np.testing.assert_allclose(y, a / (1 + np.exp(-0.7 * a)) * b, rtol=1e-6)


def test_attention_runs_concurrently_from_threads():
    rng = np.random.default_rng(4)
    q, k, v = randn(rng, 2, 4, 16, 8), randn(rng, 2, 2, 16, 8), randn(rng, 2, 2, 16, 8)
    op = make_op("Attention", dict(is_causal=1), version=23)
    expected = op(q, k, v)[0]
    results, errors = [], []

    def work():
        try:
            for _ in range(20):
                results.append(op(q, k, v)[0])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for r in results:
        np.testing.assert_array_equal(r, expected)
