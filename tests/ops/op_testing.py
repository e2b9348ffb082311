"""Helpers for kernel tests (tests/ops/): build one op, run one-node models through ONNX Runtime,
compare; interpret a node case's graph with the kernels alone."""
from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from asyncinfer import ops
from asyncinfer.model.attributes import attributes_dict
from asyncinfer.model.ir import Layer


def make_op(op_type: str, attrs: dict | None = None, version: int = 21, n_inputs: int = 1, n_outputs: int = 1):
    layer = Layer(name="layer", op_type=op_type, inputs=[f"i{k}" for k in range(n_inputs)],
                  outputs=[f"o{k}" for k in range(n_outputs)], attrs=dict(attrs or {}), version=version)
    return ops.create(layer)


def one_node(op_type: str, inputs: list, attrs: dict | None = None, opset: int = 21, n_outputs: int = 1, *,
             domain: str = "", outputs: list[str] | None = None,
             constants: Collection[int] = ()) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A one-node model of ``op_type`` and its feeds (``None`` inputs are omitted optional inputs).

    ``domain``: the op's domain (version 1 of it is imported too); ``outputs``: the output names,
    ``""`` for an optional output left out (default ``o0``, ``o1``… for ``n_outputs``);
    ``constants``: positions of inputs stored as initializers rather than fed."""
    names, infos, inits, feeds = [], [], [], {}
    for k, x in enumerate(inputs):
        if x is None:
            names.append("")
            continue
        name = f"i{k}"
        names.append(name)
        x = np.asarray(x)
        if k in constants:
            inits.append(numpy_helper.from_array(x, name))
        else:
            infos.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape))
            feeds[name] = x
    while names and names[-1] == "":  # trailing omitted inputs are simply absent
        names.pop()
    outs = outputs if outputs is not None else [f"o{k}" for k in range(n_outputs)]
    node = helper.make_node(op_type, names, outs, domain=domain or None, **(attrs or {}))
    graph = helper.make_graph([node], "g", infos, [helper.make_empty_tensor_value_info(o) for o in outs if o], inits)
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10 if opset >= 21 else 8
    return model, feeds


def reference_run(op_type: str, inputs: list, attrs: dict | None = None, opset: int = 21, n_outputs: int = 1):
    """Outputs of onnx's reference implementation (the definition) on a one-node model."""
    from onnx.reference import ReferenceEvaluator

    model, feeds = one_node(op_type, inputs, attrs, opset, n_outputs)
    return [np.asarray(o) for o in ReferenceEvaluator(model).run(None, feeds)]


def ort_run(op_type: str, inputs: list, attrs: dict | None = None, opset: int = 21, n_outputs: int = 1):
    """Outputs of onnxruntime on a one-node model: a second opinion, for ops whose results do not
    depend on the CPU (its u8×s8 integer kernels saturate on CPUs without VNNI, for instance)."""
    model, feeds = one_node(op_type, inputs, attrs, opset, n_outputs)
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime (a dev dependency) is the second opinion")
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


# The activations a kernel's epilogue applies (`ops.epilogue.Epilogue.of`): (attributes, extra inputs)
EPILOGUE_ACTIVATIONS = {
    "Relu": ({}, []),
    "Clip": ({}, [np.array(-0.5, np.float32), np.array(0.75, np.float32)]),
    "Clip_low_only": ({}, [np.array(0.0, np.float32), None]),
    "LeakyRelu": ({"alpha": 0.07}, []),
    "HardSigmoid": ({"alpha": 0.3, "beta": 0.4}, []),
    "HardSwish": ({}, []),
    "Sigmoid": ({}, []),
    "Swish": ({"alpha": 1.0}, []),
    "Swish_alpha": ({"alpha": 1.702}, []),
}


def activation_op(name: str) -> tuple:
    """The op of `EPILOGUE_ACTIVATIONS`' ``name`` and its extra inputs, as a fused activation's pair."""
    attrs, extras = EPILOGUE_ACTIVATIONS[name]
    op_type = name.split("_")[0]
    layer = Layer("act", op_type, ["y"] + [f"e{i}" if e is not None else "" for i, e in enumerate(extras)], ["z"],
                  attrs=attrs, version={"HardSwish": 14, "Swish": 24}.get(op_type, 13))
    return ops.create(layer), extras


def randn(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# -- node-case data through the kernels alone ------------------------------------------------------
# (The node cases themselves run through the whole engine on every backend: tests/node_cases.py.
# These interpret a case's graph with the registered Op kernels only, no runtime, to check kernel
# properties on that data: inputs left unwritten, narrow floats bit-exact.)
def to_array(value):
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else value


def evaluate_with_kernels(model: onnx.ModelProto, inputs: list) -> list:
    """Outputs of ``model`` on ``inputs``, layer by layer with the registered kernels (no runtime)."""
    opsets = {o.domain or "": o.version for o in model.opset_import}
    values = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    for info, value in zip(model.graph.input, inputs):
        values[info.name] = to_array(value)
    for i, node in enumerate(model.graph.node):
        layer = Layer(name=node.name or f"node{i}", op_type=node.op_type, inputs=list(node.input),
                      outputs=list(node.output), attrs=attributes_dict(node.attribute),
                      domain=node.domain, version=opsets.get(node.domain or "", 1))
        outs = ops.create(layer)(*[values[n] if n else None for n in node.input])
        for name, out in zip(node.output, outs):
            if name:
                values[name] = out
    return [values[o.name] for o in model.graph.output]


class TeamRuns:
    """A spin team of ``helpers`` threads for kernel tests (`spin_team_bound`), counting the
    kernels that shared their work with it (claims of the team that got it: `SpinTeam.try_run`
    calls that ran, and kernels posting from compiled code) and its wake-ups (``wakes``)."""

    def __init__(self, helpers: int):
        from asyncinfer.concurrency.spin_team import SpinTeam
        from asyncinfer.ops.compiled.team_parts import prepare_part, serve_parts

        self.team = SpinTeam(helpers, serve_parts, prepare_part, name="test-team")
        self.shared = self.wakes = 0
        self._claim = real = self.team.claim
        wake = self.team.wake

        def counted():
            control = real()
            self.shared += control is not None
            return control

        def woken() -> None:
            self.wakes += 1
            wake()
        self.team.claim = counted
        self.team.wake = woken

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Within the block, the team is claimed by another poster: kernels find it busy."""
        assert self._claim() is not None
        try:
            yield
        finally:
            self.team.release()


def assert_conv_takes(monkeypatch: Any, planner: str, attrs: dict, x: np.ndarray, w: np.ndarray, b: np.ndarray,
                      rtol: float = 1e-4, atol: float = 1e-4) -> None:
    """A Conv op of ``attrs`` plans with ``asyncinfer.ops.conv``'s ``planner`` (the full way takes
    that kernel) and matches onnx's reference, with and without the bias; run again (the short
    way, planned once) it gives the same bits."""
    from asyncinfer.ops import conv

    planned = []
    real = getattr(conv, planner)
    monkeypatch.setattr(conv, planner, lambda *a, **k: planned.append(1) or real(*a, **k))
    op = make_op("Conv", attrs, n_inputs=3)
    got = op(x, w, b)[0]
    assert planned, f"the conv did not take {planner}"
    want = reference_run("Conv", [x, w, b], attrs)[0]
    assert got.shape == want.shape and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)
    np.testing.assert_array_equal(op(x, w, b)[0], got)
    no_bias = make_op("Conv", attrs, n_inputs=2)(x, w)[0]
    np.testing.assert_allclose(no_bias, reference_run("Conv", [x, w], attrs)[0], rtol=rtol, atol=atol)


def assert_fused_activation_bits(conv: Any, x: np.ndarray, w: np.ndarray, b: np.ndarray, activation: str) -> None:
    """The conv op ``conv`` with ``activation`` fused (run twice: the full way, then the short way
    planned once) gives the very bits of the conv followed by the activation op, on ``x`` with
    NaN and infinities strewn in (as on the pool's threads, they are values, not warnings)."""
    x = x * 3
    x.flat[::17] = np.nan
    x.flat[5::29] = np.inf
    x.flat[7::31] = -np.inf
    act, extras = activation_op(activation)
    with np.errstate(all="ignore"):
        fused = conv(x, w, b, activations=[(act, extras)])[0]
        separate = act(conv(x, w, b)[0], *extras)[0]
        again = conv(x, w, b, activations=[(act, extras)])[0]
    np.testing.assert_array_equal(fused, separate)
    np.testing.assert_array_equal(again, fused)
    assert np.isnan(fused).any()


@contextmanager
def spin_team_bound(helpers: int = 1) -> Iterator[TeamRuns]:
    """Within the block, kernels on this thread may share parts with a fresh spin team (as on a
    CPU backend's threads). Skips the test where NumPy's BLAS exports no ``cblas_sgemm`` (Apple's
    Accelerate, MKL builds): the team's GEMM and conv parts are then never used."""
    from concurrent.futures import ThreadPoolExecutor

    from asyncinfer.concurrency import parallel
    from asyncinfer.ops.compiled import blas_call

    if not blas_call.available():
        pytest.skip("NumPy's BLAS exports no cblas_sgemm here: kernels keep their NumPy path")
    runs = TeamRuns(helpers)
    pool = ThreadPoolExecutor(helpers, thread_name_prefix="test-pool")
    try:
        with parallel.pool_bound(pool.submit, helpers + 1, runs.team):
            yield runs
    finally:
        runs.team.close()
        pool.shutdown()
