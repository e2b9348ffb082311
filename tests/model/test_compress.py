"""Weight compression (asyncinfer/model/compress.py): float16 halves and uint8 quarters the weights,
the result is a standard ONNX model ONNX Runtime runs too, asyncinfer dequantizes it at load, and
the rounding stays within what each format promises."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
from asyncinfer import assets
from asyncinfer.cli import main
from conftest import make_model, tensor_info

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is a dev dependency")


@pytest.mark.parametrize("kind, ratio", [("float16", 0.55), ("uint8", 0.30)])
def test_the_default_model_shrinks_and_keeps_its_top1_on_its_samples(kind, ratio):
    images, _ = assets.default_samples()
    compressed = ai.quantize_weights(assets.default_model_path(), kind)
    assert compressed.size_after <= ratio * compressed.size_before
    assert {w.name for w in compressed.weights} == {"conv2.weight", "fc1.weight"}  # the small ones stay
    original = ai.load_model(assets.default_model_path())
    smaller = ai.load_model(compressed.proto)
    assert [l.kind for l in smaller.layers] == [l.kind for l in original.layers]  # decompression folded at load
    with ai.Worker(original) as a, ai.Worker(smaller) as b:
        ref, got = a.run_blocking(images)["probabilities"], b.run_blocking(images)["probabilities"]
    assert (ref.argmax(1) == got.argmax(1)).all()
    session = ort.InferenceSession(compressed.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"image": images})[1], got, rtol=1e-4, atol=1e-5)


def _matmul_model(w: np.ndarray, opset: int = 17, ir_version: int = 8) -> onnx.ModelProto:
    proto = make_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [2, w.shape[0]])],
                       [tensor_info("y", [2, w.shape[1]])], [numpy_helper.from_array(w, "w")], opset=opset,
                       extra_domains=())
    proto.ir_version = ir_version
    return proto


def _dequantized(compressed: ai.CompressedModel) -> np.ndarray:
    return ai.load_model(compressed.proto).constants["w"]


@pytest.mark.parametrize("opset, per_channel", [(17, True), (11, False)])
def test_uint8_rounds_each_value_by_at_most_half_a_step_and_keeps_zero_exact(opset, per_channel):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 48)) * rng.uniform(0.01, 10, (64, 1))).astype(np.float32)
    w[3] = 0.0  # an all-zero channel
    w[5, 7] = 0.0
    compressed = ai.quantize_weights(_matmul_model(w, opset), "uint8")
    dequantize = next(n for n in compressed.proto.graph.node if n.op_type == "DequantizeLinear")
    assert any(a.name == "axis" for a in dequantize.attribute) == per_channel  # no axis before opset 13
    got = _dequantized(compressed)
    rows = w if per_channel else w.reshape(1, -1)
    step = (np.maximum(rows.max(1), 0) - np.minimum(rows.min(1), 0)) / 255
    bound = (np.maximum(step, 1e-30)[:, None] * 0.5 * (1 + 1e-5)).repeat(rows.shape[1], 1).reshape(w.shape)
    assert (np.abs(got - w) <= bound).all()
    assert got[3].tolist() == [0.0] * 48 and got[5, 7] == 0.0


def test_float16_keeps_what_float16_cannot_hold_and_what_is_not_a_float32_weight():
    big = np.full((64, 32), 1e6, np.float32)  # beyond float16's range: stays float32
    nodes = [helper.make_node("MatMul", ["x", "big"], ["a"]), helper.make_node("MatMul", ["a", "w"], ["b"]),
             helper.make_node("Gather", ["b", "idx"], ["y"], axis=1)]
    inits = [numpy_helper.from_array(big, "big"), numpy_helper.from_array(np.ones((32, 2048), np.float32), "w"),
             numpy_helper.from_array(np.arange(2048, dtype=np.int64), "idx"),
             numpy_helper.from_array(np.ones(8, np.float32), "small")]
    proto = make_model(nodes, [tensor_info("x", [1, 64])], [tensor_info("y", [1, 2048])], inits, extra_domains=())
    compressed = ai.quantize_weights(proto, "float16")
    assert [w.name for w in compressed.weights] == ["w"]
    kept = {t.name: t.data_type for t in compressed.proto.graph.initializer}
    assert kept["big"] == TensorProto.FLOAT and kept["idx"] == TensorProto.INT64 and kept["small"] == TensorProto.FLOAT
    assert kept["w__float16"] == TensorProto.FLOAT16


def test_old_models_listing_initializers_as_inputs_are_compressed_and_overridable_inputs_are_not():
    w = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)
    old = _matmul_model(w, opset=9, ir_version=3)
    old.graph.input.append(tensor_info("w", [64, 32]))  # IR 3: every initializer is also an input
    compressed = ai.quantize_weights(old, "float16")
    assert [i.name for i in compressed.proto.graph.input] == ["x"]
    np.testing.assert_allclose(_dequantized(compressed), w, rtol=1e-3)
    new = _matmul_model(w)
    new.graph.input.append(tensor_info("w", [64, 32]))  # IR 8: a default the caller may override
    assert ai.quantize_weights(new, "float16").weights == []


def test_models_with_external_weights_and_unknown_kinds_are_refused(tmp_path):
    with pytest.raises(ValueError, match="kind must be one of"):
        ai.quantize_weights(assets.default_model_path(), "int4")
    proto = onnx.load(assets.default_model_path())
    onnx.save_model(proto, tmp_path / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0)
    with pytest.raises(ai.ModelLoadError, match="external data"):
        ai.quantize_weights(tmp_path / "m.onnx", "uint8")


def test_the_quantize_command_writes_the_file_and_reports_the_change(tmp_path, capsys):
    out = tmp_path / "digits_uint8.onnx"
    assert main(["quantize", str(assets.default_model_path()), str(out), "--type", "uint8"]) == 0
    text = capsys.readouterr().out
    assert "2 weights stored as uint8" in text and "top-1 unchanged on 100.0% of 360 rows" in text
    assert out.stat().st_size < 0.3 * assets.default_model_path().stat().st_size
    assert ai.load_model(out).outputs[1].name == "probabilities"
