"""Helpers for kernel tests: build one op, run one-node models through ONNX Runtime, compare."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from onnx import helper

from asyncinfer import ops
from asyncinfer.conformance import asyncinfer_engine, load_cases, run_case
from asyncinfer.model.ir import Layer


def make_op(op_type: str, attrs: dict | None = None, version: int = 21, n_inputs: int = 1, n_outputs: int = 1):
    layer = Layer(name="layer", op_type=op_type, inputs=[f"i{k}" for k in range(n_inputs)],
                  outputs=[f"o{k}" for k in range(n_outputs)], attrs=dict(attrs or {}), version=version)
    return ops.create(layer)


def ort_run(op_type: str, inputs: list, attrs: dict | None = None, opset: int = 21, n_outputs: int = 1):
    """Outputs of onnxruntime on a one-node model (``None`` inputs are omitted optional inputs)."""
    names, infos, feeds = [], [], {}
    for k, x in enumerate(inputs):
        if x is None:
            names.append("")
            continue
        names.append(f"i{k}")
        infos.append(helper.make_tensor_value_info(f"i{k}", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape))
        feeds[f"i{k}"] = x
    outs = [f"o{k}" for k in range(n_outputs)]
    node = helper.make_node(op_type, names, outs, **(attrs or {}))
    graph = helper.make_graph([node], "g", infos, [helper.make_empty_tensor_value_info(o) for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10 if opset >= 21 else 8
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the reference")
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def compare_with_ort(op_type: str, inputs: list, attrs: dict | None = None, opset: int = 21, n_outputs: int = 1,
                     rtol: float = 1e-4, atol: float = 1e-5):
    """Run ours and onnxruntime; check values, dtypes, and that no input was modified."""
    expected = ort_run(op_type, inputs, attrs, opset, n_outputs)
    op = make_op(op_type, attrs, opset, len(inputs), n_outputs)
    before = [None if x is None else x.copy() for x in inputs]
    got = op(*inputs)
    for x, b in zip(inputs, before):
        if x is not None:
            np.testing.assert_array_equal(x, b, err_msg="an input was modified")
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (g.dtype, g.shape, e.dtype, e.shape)
        if e.dtype.kind == "f":
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(g, e)
    return got


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# -- ONNX node cases through the whole engine ------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _all_cases() -> tuple:
    return tuple(load_cases())


def cases_using(op_types: set[str]) -> dict[str, object]:
    """Node test cases whose graph has a node of one of ``op_types``, by name."""
    return {c.name: c for c in _all_cases() if {n.op_type for n in c.model.graph.node} & op_types}


def case_params(cases: dict[str, object], excluded: dict[str, str]) -> list:
    """Case names for parametrize; the ``excluded`` ones are strict xfails carrying their reason."""
    return [pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=excluded[name])] if name in excluded
                         else []) for name in sorted(cases)]


def assert_case_passes(case: object) -> None:
    """Run one node case through load_model + Worker on the CPU and assert every output matches."""
    with np.errstate(all="ignore"):
        result = run_case(case, asyncinfer_engine("cpu"))
    assert result.passed, f"{result.name}: {result.status}: {result.detail}"
