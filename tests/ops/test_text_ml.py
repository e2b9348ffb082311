"""Tests of the string (ops/text.py), traditional-ML (ops/ml.py) and training-optimizer
(ops/training.py) kernels.

ONNX's node test cases of these ops run through the whole engine on every backend
(tests/node_cases.py); the ml ops that ONNX ships no case for (linear models, legacy tree
ensembles, Normalizer…) are compared with ONNX Runtime on small models built here.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from asyncinfer import conformance, ops
from asyncinfer.errors import UnsupportedOperatorError
from asyncinfer.model.ir import Layer
from node_cases import expected_failures_among

CASES = (r"^test_(string_|strnormalizer|regex_full_match|tfidfvectorizer|ai_onnx_ml_|adagrad|adam|momentum"
         r"|nesterov_momentum)")


def test_case_selection() -> None:
    names = [c.name for c in conformance.load_cases(CASES)]
    assert len(names) >= 40
    assert not expected_failures_among(names)  # every node case of these ops passes on the CPU


# -- comparisons with ONNX Runtime ----------------------------------------------------------------
_ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE,
         np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
         np.dtype(object): TensorProto.STRING}


def ml_model(op_type: str, inputs: list[np.ndarray], n_outputs: int = 1, opset: int = 3, **attrs) -> onnx.ModelProto:
    """A one-node ai.onnx.ml model over ``inputs`` (output types left to inference)."""
    names = [f"x{i}" for i in range(len(inputs))]
    outs = [f"y{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, names, outs, domain="ai.onnx.ml", **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, _ELEM[a.dtype], list(a.shape)) for n, a in zip(names, inputs)],
        [helper.make_empty_tensor_value_info(o) for o in outs])
    return helper.make_model(graph, ir_version=8,
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", opset)])


def assert_like_onnxruntime(model: onnx.ModelProto, inputs: list[np.ndarray]) -> None:
    pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the reference")
    expected, _ = conformance.onnxruntime_engine()(model, inputs)
    got, _ = conformance.asyncinfer_engine("cpu")(model, inputs)
    conformance.compare_outputs(got, expected, rtol=1e-5, atol=1e-6)


RNG = np.random.default_rng(0)
X = RNG.normal(size=(7, 4)).astype(np.float32)
_TRANSFORMS = ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"]


@pytest.mark.parametrize("transform", _TRANSFORMS)
@pytest.mark.parametrize("n_classes", [2, 3])
def test_linear_classifier(n_classes: int, transform: str) -> None:
    coefficients = RNG.normal(size=(n_classes, 4)).reshape(-1).tolist()
    model = ml_model("LinearClassifier", [X], 2, post_transform=transform, coefficients=coefficients,
                     intercepts=RNG.normal(size=n_classes).tolist(), classlabels_ints=list(range(10, 10 + n_classes)))
    assert_like_onnxruntime(model, [X])


@pytest.mark.parametrize("transform", _TRANSFORMS)
def test_linear_classifier_binary_one_row(transform: str) -> None:
    model = ml_model("LinearClassifier", [X], 2, post_transform=transform, coefficients=[0.5, -1.0, 0.25, 2.0],
                     intercepts=[0.1], classlabels_strings=["no", "yes"])
    assert_like_onnxruntime(model, [X])


def test_linear_regressor() -> None:
    model = ml_model("LinearRegressor", [X], coefficients=RNG.normal(size=8).tolist(), intercepts=[1.0, -2.0],
                     targets=2)
    assert_like_onnxruntime(model, [X])


def _legacy_tree_attrs() -> dict[str, Any]:
    """Two trees over 4 features (node ids restart per tree), with a NaN-tracking node."""
    return dict(
        nodes_treeids=[0, 0, 0, 0, 0, 1, 1, 1],
        nodes_nodeids=[0, 1, 2, 3, 4, 0, 1, 2],
        nodes_featureids=[0, 1, 0, 0, 0, 2, 0, 0],
        nodes_modes=["BRANCH_LEQ", "BRANCH_GT", "LEAF", "LEAF", "LEAF", "BRANCH_LT", "LEAF", "LEAF"],
        nodes_values=[0.1, -0.3, 0, 0, 0, 0.2, 0, 0],
        nodes_truenodeids=[1, 2, 0, 0, 0, 1, 0, 0],
        nodes_falsenodeids=[4, 3, 0, 0, 0, 2, 0, 0],
        nodes_missing_value_tracks_true=[1, 0, 0, 0, 0, 0, 0, 0],
    )


@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
def test_tree_ensemble_regressor(aggregate: str) -> None:
    x = X.copy()
    x[0, 0] = np.nan
    model = ml_model("TreeEnsembleRegressor", [x], n_targets=2, aggregate_function=aggregate,
                     base_values=[0.5, -0.5], target_treeids=[0, 0, 0, 0, 1, 1], target_nodeids=[2, 3, 4, 4, 1, 2],
                     target_ids=[0, 0, 1, 0, 1, 0], target_weights=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
                     **_legacy_tree_attrs())
    assert_like_onnxruntime(model, [x])


# Not SOFTMAX (1) / LOGISTIC (2): onnxruntime 1.31 swaps those two enum values against the spec.
@pytest.mark.parametrize("aggregate, transform", [(0, 0), (1, 0), (2, 3), (3, 0)])
def test_tree_ensemble_v5(aggregate: int, transform: int) -> None:
    """Two trees, a NaN-tracking node and a BRANCH_MEMBER node, against onnxruntime."""
    x = X.astype(np.float64)
    x[0, 1], x[3, 0] = np.nan, 0.5
    model = ml_model(
        "TreeEnsemble", [x], opset=5, aggregate_function=aggregate, post_transform=transform, n_targets=2,
        tree_roots=[0, 2], nodes_featureids=[0, 1, 2, 0],
        nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [4], [0, 3, 1, 6]),
        nodes_splits=helper.make_tensor("s", TensorProto.DOUBLE, [4], [0.1, -0.2, 0.3, 0.0]),
        nodes_truenodeids=[1, 0, 3, 2], nodes_trueleafs=[0, 1, 0, 1], nodes_falsenodeids=[1, 1, 4, 3],
        nodes_falseleafs=[1, 1, 1, 1], nodes_missing_value_tracks_true=[0, 1, 0, 0],
        membership_values=helper.make_tensor("mv", TensorProto.DOUBLE, [3], [0.5, 2.0, np.nan]),
        leaf_targetids=[0, 1, 0, 1, 0], leaf_weights=helper.make_tensor("w", TensorProto.DOUBLE, [5], [1, 2, 3, 4, 5]))
    assert_like_onnxruntime(model, [x])


@pytest.mark.parametrize("transform", _TRANSFORMS)
def test_tree_ensemble_classifier(transform: str) -> None:
    model = ml_model("TreeEnsembleClassifier", [X], 2, post_transform=transform,
                     class_treeids=[0, 0, 0, 0, 0, 0, 1, 1, 1, 1], class_nodeids=[2, 2, 3, 3, 4, 4, 1, 1, 2, 2],
                     class_ids=[0, 2, 1, 2, 0, 1, 1, 2, 0, 2],
                     class_weights=[0.2, 0.1, 0.5, 0.3, 0.3, 0.2, 0.4, 0.1, 0.6, 0.2],
                     classlabels_strings=["a", "b", "c"], base_values=[0.1, 0.0, -0.1], **_legacy_tree_attrs())
    assert_like_onnxruntime(model, [X])


@pytest.mark.parametrize("norm", ["MAX", "L1", "L2"])
def test_normalizer(norm: str) -> None:
    x = X.copy()
    x[1] = 0.0
    assert_like_onnxruntime(ml_model("Normalizer", [x], norm=norm), [x])


@pytest.mark.parametrize("op_type, inputs, attrs", [
    ("Scaler", [X], dict(offset=[0.5, 0.1, -0.2, 0.0], scale=[2.0, 1.0, 0.5, 3.0])),
    ("Scaler", [X.astype(np.float64)], dict(offset=[0.5], scale=[2.0])),
    ("Imputer", [np.where(X > 1, np.nan, X).astype(np.float32)],
     dict(imputed_value_floats=[1.0, 2.0, 3.0, 4.0], replaced_value_float=float("nan"))),
    ("Imputer", [np.array([[1, -1, 3], [-1, 5, 6]], dtype=np.int64)],
     dict(imputed_value_int64s=[9], replaced_value_int64=-1)),
    ("OneHotEncoder", [np.array([[1, 5, 2]], dtype=np.int64)], dict(cats_int64s=[1, 2, 3])),
    ("OneHotEncoder", [np.array(["b", "z", "a"], dtype=object)], dict(cats_strings=["a", "b"])),
    ("FeatureVectorizer", [X[:, :2], X[:, 2:]], dict(inputdimensions=[2, 3])),
    ("ArrayFeatureExtractor", [np.array(["p", "q", "r"], dtype=object), np.array([2, 0], dtype=np.int64)], {}),
    ("Binarizer", [X], dict(threshold=0.2)),
    ("LabelEncoder", [np.array([1.0, np.nan, 3.0, 7.0], dtype=np.float32)],
     dict(keys_floats=[1.0, float("nan"), 3.0], values_strings=["one", "nan", "three"])),
])
def test_small_ml_ops(op_type: str, inputs: list[np.ndarray], attrs: dict[str, Any]) -> None:
    assert_like_onnxruntime(ml_model(op_type, inputs, opset=4, **attrs), inputs)


def test_label_encoder_repeated_key_last_wins() -> None:
    op = make("LabelEncoder", 4, "ai.onnx.ml", keys_int64s=[1, 2, 1], values_int64s=[10, 20, 30], default_int64=0)
    assert op.run(np.array([1, 2, 3], dtype=np.int64)).tolist() == [30, 20, 0]


# -- refusals, errors, no mutation ----------------------------------------------------------------
def make(op_type: str, version: int, domain: str = "", n_outputs: int = 1, **attrs: Any) -> ops.Op:
    layer = Layer(name=f"{op_type.lower()}0", op_type=op_type, inputs=[], attrs=attrs, domain=domain,
                  outputs=[f"out{i}" for i in range(n_outputs)], version=version)
    return ops.create(layer)


@pytest.mark.parametrize("op_type, version, domain, attrs, message", [
    ("StringNormalizer", 10, "", dict(locale="tr_TR"), "locale='tr_TR'"),
    ("StringNormalizer", 10, "", dict(case_change_action="TITLE"), "case_change_action='TITLE'"),
    ("RegexFullMatch", 20, "", dict(pattern="(?<name>x)"), "pattern"),
    ("LinearRegressor", 1, "ai.onnx.ml", dict(coefficients=[1.0], post_transform="PROBIT"), "PROBIT"),
    ("TreeEnsembleClassifier", 3, "ai.onnx.ml", dict(classlabels_int64s=[0, 1]), "2-class model"),
    ("Momentum", 1, "ai.onnx.preview.training",
     dict(alpha=0.9, beta=0.1, norm_coefficient=0.0, mode="heavy"), "mode='heavy'"),
])
def test_unsupported_attribute_is_refused_at_load(op_type: str, version: int, domain: str, attrs: dict[str, Any],
                                                  message: str) -> None:
    with pytest.raises(UnsupportedOperatorError, match=message.replace("(", r"\(").replace("?", r"\?")):
        make(op_type, version, domain, **attrs)


def test_string_ops_edge_cases() -> None:
    words = np.array([["Monday", "x"]], dtype=object)
    assert make("StringNormalizer", 10, stopwords=["monday", "X"]).run(words).tolist() == [[""]]
    split, counts = make("StringSplit", 20, n_outputs=2, delimiter="ab", maxsplit=1).run(
        np.array("xabyabz", dtype=object))
    assert split.tolist() == ["x", "yabz"] and counts.tolist() == 2 and counts.dtype == np.int64


def test_tfidf_strings_with_weights() -> None:
    op = make("TfIdfVectorizer", 9, mode="TFIDF", min_gram_length=1, max_gram_length=2, max_skip_count=1,
              ngram_counts=[0, 2], ngram_indexes=[2, 0, 1], weights=[0.5, 2.0, 3.0],
              pool_strings=["a", "b", "a", "b"])
    out = op.run(np.array([["a", "b", "a", "c"], ["c", "c", "c", "c"]], dtype=object))
    # row 0: "a" twice (weight .5 → col 2), "b" once (2.0 → col 0), "a b" once (at skip 0; 3.0 → col 1)
    np.testing.assert_allclose(out, [[2.0, 3.0, 1.0], [0.0, 0.0, 0.0]])
    assert out.dtype == np.float32


def test_inputs_are_not_mutated() -> None:
    cases = [
        (make("StringSplit", 20, n_outputs=2), [np.array(["a b", "c"], dtype=object)]),
        (make("StringNormalizer", 10, case_change_action="UPPER", stopwords=["a"]),
         [np.array(["a", "b"], dtype=object)]),
        (make("LabelEncoder", 4, "ai.onnx.ml", keys_int64s=[1, 2], values_floats=[0.5, 1.5]),
         [np.array([2, 1, 9], dtype=np.int64)]),
        (make("Imputer", 1, "ai.onnx.ml", imputed_value_floats=[0.0], replaced_value_float=float("nan")),
         [np.array([np.nan, 1.0], dtype=np.float32)]),
        (make("Adam", 1, "ai.onnx.preview.training", n_outputs=3),
         [np.array(0.1), np.array(1), X.copy(), X.copy() * 0.1, np.zeros_like(X), np.ones_like(X)]),
    ]
    for op, inputs in cases:
        before = [a.copy() for a in inputs]
        op(*inputs)
        for a, b in zip(inputs, before):
            np.testing.assert_array_equal(a, b, err_msg=op.op_type)


def test_tree_ensemble_post_transform_enum_follows_the_spec() -> None:
    """post_transform 1 is SOFTMAX and 2 LOGISTIC, as the TreeEnsemble-5 schema enumerates them."""
    attrs = dict(tree_roots=[0, 1], nodes_featureids=[0, 0], nodes_modes=np.array([0, 0], np.uint8),
                 nodes_splits=np.zeros(2), nodes_truenodeids=[0, 1], nodes_falsenodeids=[0, 1],
                 nodes_trueleafs=[1, 1], nodes_falseleafs=[1, 1], leaf_targetids=[0, 1],
                 leaf_weights=np.array([1.0, 2.0]), n_targets=2)
    x = np.zeros((1, 1))
    softmax = np.exp([1.0, 2.0]) / np.exp([1.0, 2.0]).sum()
    np.testing.assert_allclose(make("TreeEnsemble", 5, "ai.onnx.ml", post_transform=1, **attrs).run(x), [softmax])
    np.testing.assert_allclose(make("TreeEnsemble", 5, "ai.onnx.ml", post_transform=2, **attrs).run(x),
                               [1 / (1 + np.exp([-1.0, -2.0]))])
