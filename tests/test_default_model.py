"""The embedded default model (``asyncinfer/assets``) and its sample inputs.

These tests read the shipped files directly with ``onnx``/``onnxruntime`` and do not
import the asyncinfer runtime, so they check the assets on their own. Regenerate the
assets with ``python3 examples/train_digits_cnn.py``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

ASSETS = Path(__file__).resolve().parents[1] / "asyncinfer" / "assets"
MODEL_PATH = ASSETS / "digits_cnn.onnx"
SAMPLES_PATH = ASSETS / "digits_samples.npz"


def _dims(value_info: onnx.ValueInfoProto) -> list[int | str]:
    """Shape as a list: ints for fixed dims, names for symbolic ones."""
    return [
        d.dim_param if d.HasField("dim_param") else d.dim_value
        for d in value_info.type.tensor_type.shape.dim
    ]


@pytest.fixture(scope="module")
def model() -> onnx.ModelProto:
    return onnx.load(str(MODEL_PATH))


@pytest.fixture(scope="module")
def samples() -> tuple[np.ndarray, np.ndarray]:
    with np.load(SAMPLES_PATH) as data:
        return data["images"], data["labels"]


def test_assets_exist_and_are_small():
    assert MODEL_PATH.is_file(), MODEL_PATH
    assert SAMPLES_PATH.is_file(), SAMPLES_PATH
    # They ship inside the wheel, so keep them well under 1 MB together.
    assert MODEL_PATH.stat().st_size + SAMPLES_PATH.stat().st_size < 1_000_000


def test_model_passes_checker(model):
    onnx.checker.check_model(model, full_check=True)


def test_model_versions_stay_loadable_by_older_runtimes(model):
    assert model.ir_version <= 8
    default = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    assert default and default[0] <= 17
    assert model.doc_string.strip(), "model should document what it is and how it was trained"


def test_model_signature(model):
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    assert [i.name for i in inputs] == ["image"]
    assert inputs[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert _dims(inputs[0]) == ["N", 1, 8, 8]

    outputs = {o.name: o for o in graph.output}
    assert list(outputs) == ["logits", "probabilities"]
    for out in outputs.values():
        assert out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
        assert _dims(out) == ["N", 10]


def test_samples_format(samples):
    images, labels = samples
    assert images.dtype == np.float32 and labels.dtype == np.int64
    assert images.ndim == 4 and images.shape[1:] == (1, 8, 8)
    assert labels.shape == (images.shape[0],)
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert set(np.unique(labels)) == set(range(10))


def test_onnxruntime_accuracy_on_samples(samples):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is needed to run the model")
    images, labels = samples
    sess = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    logits, probs = sess.run(["logits", "probabilities"], {"image": images})

    assert logits.shape == probs.shape == (len(labels), 10)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, atol=1e-5)
    # Softmax preserves the arg-max, so both outputs must pick the same class.
    np.testing.assert_array_equal(logits.argmax(axis=1), probs.argmax(axis=1))

    accuracy = float((logits.argmax(axis=1) == labels).mean())
    assert accuracy >= 0.95, f"accuracy {accuracy:.4f} on {len(labels)} samples"


def test_onnxruntime_batch_dimension_is_dynamic(samples):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is needed to run the model")
    images, _ = samples
    sess = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    (full,) = sess.run(["logits"], {"image": images[:7]})
    # Rows must not depend on the batch they are computed in.
    for n in (1, 3):
        (part,) = sess.run(["logits"], {"image": images[:n]})
        np.testing.assert_allclose(part, full[:n], rtol=1e-5, atol=1e-5)
