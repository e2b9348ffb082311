"""Helpers to run the ONNX backend node test cases shipped with the ``onnx`` package.

``evaluate_with_kernels`` interprets a test-case model layer by layer with the registered Op
kernels alone (no runtime), so that kernels can be checked in isolation.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.test.case.node import collect_testcases

from asyncinfer import ops
from asyncinfer.model.attributes import attributes_dict
from asyncinfer.model.ir import Layer


@lru_cache(maxsize=1)
def node_cases() -> dict[str, object]:
    return {case.name: case for case in collect_testcases()}


def cases_for(op_type: str) -> list[object]:
    """Node test cases whose model contains ``op_type`` (a single-node model, usually)."""
    return [c for c in node_cases().values() if any(n.op_type == op_type for n in c.model.graph.node)]


def _to_array(value):
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    return value


def evaluate_with_kernels(model: onnx.ModelProto, inputs: list) -> list:
    opsets = {o.domain or "": o.version for o in model.opset_import}
    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for info, value in zip(model.graph.input, inputs):
        values[info.name] = _to_array(value)
    for i, node in enumerate(model.graph.node):
        layer = Layer(name=node.name or f"node{i}", op_type=node.op_type, inputs=list(node.input),
                      outputs=list(node.output), attrs=attributes_dict(node.attribute),
                      domain=node.domain, version=opsets.get(node.domain or "", 1))
        op = ops.create(layer)
        outs = op(*[values[n] if n else None for n in node.input])
        for name, out in zip(node.output, outs):
            if name:
                values[name] = out
    return [values[o.name] for o in model.graph.output]


def check_case(case) -> None:
    """Run one node test case through the kernels and assert every output matches."""
    for inputs, expected in case.data_sets:
        got = evaluate_with_kernels(case.model, inputs)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            e = _to_array(e)
            g = np.asarray(g)
            assert g.shape == e.shape, f"{case.name}: shape {g.shape} != {e.shape}"
            if e.dtype.kind in "fc" or e.dtype.kind == "V" or "float" in e.dtype.name:
                assert g.dtype == e.dtype, f"{case.name}: dtype {g.dtype} != {e.dtype}"
                # ml_dtypes floats (bfloat16, float8) compare through float64, where NaN == NaN holds
                np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), equal_nan=True,
                                           rtol=case.rtol, atol=case.atol, err_msg=case.name)
            else:
                assert g.dtype == e.dtype, f"{case.name}: dtype {g.dtype} != {e.dtype}"
                np.testing.assert_array_equal(g, e, err_msg=case.name)
