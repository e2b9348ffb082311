"""NonMaxSuppression: the overlap-matrix path and the per-pick path agree with the ONNX reference."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import asyncinfer as ai
from asyncinfer.model.ir import Layer
from asyncinfer.ops import image


def _nms_model(center_point_box: int = 0):
    node = helper.make_node("NonMaxSuppression", ["b", "s", "m", "i", "t"], ["y"], center_point_box=center_point_box)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "bs"]
    inputs += [helper.make_tensor_value_info("m", TensorProto.INT64, [1]),
               helper.make_tensor_value_info("i", TensorProto.FLOAT, [1]),
               helper.make_tensor_value_info("t", TensorProto.FLOAT, [1])]
    graph = helper.make_graph([node], "nms", inputs, [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


@pytest.mark.parametrize("matrix", [True, False], ids=["overlap-matrix", "per-pick"])
def test_nms_matches_the_reference_on_random_boxes_with_ties_and_empty_boxes(matrix, monkeypatch):
    if not matrix:
        monkeypatch.setattr(image, "MATRIX_NMS_MAX_BOXES", 0)
    proto = _nms_model()
    reference = ReferenceEvaluator(proto)
    rng = np.random.default_rng(7)
    with ai.Worker(ai.load_model(proto)) as worker:
        for _ in range(25):
            n_boxes, n_classes = int(rng.integers(1, 120)), int(rng.integers(1, 5))
            corner = rng.uniform(0, 50, (2, n_boxes, 2))
            size = rng.uniform(0, 20, (2, n_boxes, 2))
            size[:, ::9] = 0  # boxes without area never suppress nor get suppressed
            boxes = np.concatenate([corner, corner + size], axis=-1).astype(np.float32)
            scores = np.round(rng.random((2, n_classes, n_boxes)), 1).astype(np.float32)  # many ties
            feeds = {"b": boxes, "s": scores, "m": np.array([int(rng.integers(1, 30))]),
                     "i": np.array([rng.uniform(0, 0.9)], np.float32), "t": np.array([rng.uniform(0, 0.5)], np.float32)}
            got = worker.run_blocking(feeds)["y"]
            np.testing.assert_array_equal(got, reference.run(None, feeds)[0])


def test_nms_paths_agree_with_nan_scores_and_without_a_score_threshold(monkeypatch):
    """The compiled walk over the overlap matrix and the per-pick path give the same picks when
    scores hold NaN (never a candidate under a threshold) and when no threshold is given."""
    rng = np.random.default_rng(11)
    corner = rng.uniform(0, 50, (1, 80, 2))
    boxes = np.concatenate([corner, corner + rng.uniform(1, 20, (1, 80, 2))], axis=-1).astype(np.float32)
    scores = np.round(rng.random((1, 6, 80)), 1).astype(np.float32)
    scores[0, :, ::7] = np.nan
    iou = np.array([0.4], np.float32)
    for threshold in (np.array([0.2], np.float32), None):
        results = []
        for matrix_limit in (image.MATRIX_NMS_MAX_BOXES, 0):
            monkeypatch.setattr(image, "MATRIX_NMS_MAX_BOXES", matrix_limit)
            op = image.NonMaxSuppression(Layer(name="nms", op_type="NonMaxSuppression", inputs=[], attrs={},
                                               outputs=["y"], version=11))
            results.append(op(boxes, scores, np.array([10]), iou, threshold)[0])
        np.testing.assert_array_equal(results[0], results[1])
        assert len(results[0]) > 0
