"""Tests of control flow (asyncinfer/ops/controlflow.py) and sequence/optional ops (asyncinfer/ops/sequence.py).

ONNX's own node cases for these ops run through the whole engine (load, optimize, Worker) on every
backend (tests/node_cases.py); the targeted tests cover what they do not: outer-scope reads, nested
bodies, scan axes and directions, refusal of unsupported inner ops at load, and the sequence ops
without node cases.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
from onnx import TensorProto, helper

import asyncinfer as ai
from asyncinfer import ops
from asyncinfer.errors import ExecutionError, UnsupportedOperatorError
from asyncinfer.model.ir import Layer
from node_cases import cases_using, expected_failures_among

CONTROL_FLOW_OPS = {"If", "Loop", "Scan", "SequenceMap"}
SEQUENCE_OPS = {
    "SequenceConstruct", "SequenceEmpty", "SequenceAt", "SequenceInsert", "SequenceErase", "SequenceLength",
    "SplitToSequence", "ConcatFromSequence", "Optional", "OptionalHasElement", "OptionalGetElement",
    "ReverseSequence",
}
MY_OPS = CONTROL_FLOW_OPS | SEQUENCE_OPS


def test_node_cases_cover_the_ops_and_all_pass() -> None:
    """The node cases using these ops anywhere (function-expanded cases and bodies included) run
    through the whole engine on every backend (tests/node_cases.py); none is expected to fail."""
    names = cases_using(MY_OPS, subgraphs=True)
    assert len(names) >= 60
    assert not expected_failures_among(names)


# -- model builders -------------------------------------------------------------------------------
# (not conftest's builders: importing conftest as a module would register its test ops a second time)
def tensor_info(name: str, shape, dtype: int = TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17):
    model = helper.make_model(_graph("test_graph", nodes, inputs, outputs, initializers),
                              opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _graph(name, nodes, inputs, outputs, initializers=()):
    return helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))


def _scalar(name, dtype=TensorProto.FLOAT):
    return tensor_info(name, [], dtype)


def _run(proto, feeds: dict) -> dict:
    with ai.Worker(ai.load_model(proto), "cpu") as worker:
        return worker.run_blocking(**feeds)


def _if_model(opset: int = 17):
    """a = x + x and b = x * x computed outside; the branches read them: then a + b, else a - b."""
    then = _graph("then", [helper.make_node("Add", ["a", "b"], ["t"])], [], [tensor_info("t", [3])])
    other = _graph("else", [helper.make_node("Sub", ["a", "b"], ["e"])], [], [tensor_info("e", [3])])
    nodes = [helper.make_node("Add", ["x", "x"], ["a"]),
             helper.make_node("Mul", ["x", "x"], ["b"]),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)]
    return make_model(nodes, [tensor_info("x", [3]), _scalar("cond", TensorProto.BOOL)],
                      [tensor_info("y", [3])], opset=opset)


# -- If ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", [11, 13, 17, 21])
def test_if_branches_read_outer_values_of_earlier_layers(opset: int) -> None:
    x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
    proto = _if_model(opset)
    np.testing.assert_allclose(_run(proto, {"x": x, "cond": np.array(True)})["y"], 2 * x + x * x)
    np.testing.assert_allclose(_run(proto, {"x": x, "cond": np.array(False)})["y"], 2 * x - x * x)


def test_if_runs_concurrently_without_mixing_values() -> None:
    """One kernel, many threads: each run sees only its own inputs and outer values."""
    model = ai.load_model(_if_model())
    results: dict[int, np.ndarray] = {}
    with ai.Worker(model, "cpu", threads=2) as worker:
        def go(i: int) -> None:
            x = np.full(3, float(i), dtype=np.float32)
            results[i] = worker.run_blocking(x=x, cond=np.array(i % 2 == 0))["y"]

        threads = [threading.Thread(target=go, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    for i, y in results.items():
        expected = 2 * i + i * i if i % 2 == 0 else 2 * i - i * i
        np.testing.assert_allclose(y, np.full(3, expected, dtype=np.float32))
    assert len(results) == 16


# -- Loop -------------------------------------------------------------------------------------------
def _loop_model(with_cond: bool = False):
    """s carries s + w (w = 2x, from outside); scan output per step: s * iteration."""
    body = _graph("body", [
        helper.make_node("Add", ["s_in", "w"], ["s_out"]),
        helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["s_out", "i_f"], ["scan"]),
        helper.make_node("Less", ["i", "stop_at"], ["c_out"]) if with_cond else
        helper.make_node("Identity", ["c_in"], ["c_out"]),
    ], [_scalar("i", TensorProto.INT64), _scalar("c_in", TensorProto.BOOL), tensor_info("s_in", [2])],
        [_scalar("c_out", TensorProto.BOOL), tensor_info("s_out", [2]), tensor_info("scan", [2])])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    stop_at = helper.make_tensor("stop_at", TensorProto.INT64, [], [1])
    nodes = [helper.make_node("Mul", ["x", "two"], ["w"]),
             helper.make_node("Loop", ["trip", "cond", "s0"], ["s_final", "scans"], body=body)]
    return make_model(nodes, [_scalar("trip", TensorProto.INT64), _scalar("cond", TensorProto.BOOL),
                              tensor_info("x", [2]), tensor_info("s0", [2])],
                      [tensor_info("s_final", [2]), tensor_info("scans", [None, 2])], [two, stop_at])


def _loop_reference(trip: int, x: np.ndarray, s0: np.ndarray, stop_at: int | None = None):
    s, scans = s0, []
    for i in range(trip):
        s = s + 2 * x
        scans.append(s * i)
        if stop_at is not None and not i < stop_at:
            break
    return s, np.array(scans, dtype=np.float32).reshape(-1, 2)


@pytest.mark.parametrize("trip", [0, 1, 4])
def test_loop_with_scan_output(trip: int) -> None:
    x, s0 = np.array([1.0, -1.0], np.float32), np.array([0.5, 0.25], np.float32)
    out = _run(_loop_model(), {"trip": np.array(trip), "cond": np.array(True), "x": x, "s0": s0})
    s, scans = _loop_reference(trip, x, s0)
    np.testing.assert_allclose(out["s_final"], s)
    assert out["scans"].shape == (trip, 2) and out["scans"].dtype == np.float32
    np.testing.assert_allclose(out["scans"], scans)


def test_loop_stops_on_the_body_condition() -> None:
    x, s0 = np.array([1.0, 2.0], np.float32), np.zeros(2, np.float32)
    out = _run(_loop_model(with_cond=True), {"trip": np.array(10), "cond": np.array(True), "x": x, "s0": s0})
    s, scans = _loop_reference(10, x, s0, stop_at=1)
    assert out["scans"].shape == (2, 2)
    np.testing.assert_allclose(out["s_final"], s)
    np.testing.assert_allclose(out["scans"], scans)


def test_loop_without_trip_count_or_condition_is_an_error() -> None:
    body = _graph("body", [helper.make_node("Identity", ["c_in"], ["c_out"])],
                  [_scalar("i", TensorProto.INT64), _scalar("c_in", TensorProto.BOOL)],
                  [_scalar("c_out", TensorProto.BOOL)])
    layer = Layer("loop0", "Loop", ["", ""], [], attrs={"body": body}, version=17)
    with pytest.raises(ExecutionError, match="never end"):
        ops.create(layer).run(None, None)


# -- nesting ----------------------------------------------------------------------------------------
def test_nested_if_in_loop_reads_values_from_both_enclosing_graphs() -> None:
    """Loop body: even iterations add w (from the main graph), odd ones subtract it from s_in
    (a body value); the If inside reads both."""
    then = _graph("then", [helper.make_node("Add", ["s_in", "w"], ["t"])], [], [tensor_info("t", [2])])
    other = _graph("else", [helper.make_node("Sub", ["s_in", "w"], ["e"])], [], [tensor_info("e", [2])])
    two = helper.make_tensor("two_i", TensorProto.INT64, [], [2])
    zero = helper.make_tensor("zero_i", TensorProto.INT64, [], [0])
    body = _graph("body", [
        helper.make_node("Mod", ["i", "two_i"], ["parity"]),
        helper.make_node("Equal", ["parity", "zero_i"], ["even"]),
        helper.make_node("If", ["even"], ["s_out"], then_branch=then, else_branch=other),
        helper.make_node("Identity", ["c_in"], ["c_out"]),
        helper.make_node("Identity", ["s_out"], ["step"]),
    ], [_scalar("i", TensorProto.INT64), _scalar("c_in", TensorProto.BOOL), tensor_info("s_in", [2])],
        [_scalar("c_out", TensorProto.BOOL), tensor_info("s_out", [2]), tensor_info("step", [2])],
        [two, zero])
    nodes = [helper.make_node("Mul", ["x", "x"], ["w"]),
             helper.make_node("Loop", ["trip", "", "s0"], ["s_final", "trace"], body=body)]
    proto = make_model(nodes, [_scalar("trip", TensorProto.INT64), tensor_info("x", [2]), tensor_info("s0", [2])],
                       [tensor_info("s_final", [2]), tensor_info("trace", [None, 2])])
    x, s0 = np.array([1.0, 3.0], np.float32), np.array([10.0, 20.0], np.float32)
    out = _run(proto, {"trip": np.array(5), "x": x, "s0": s0})
    s, trace = s0, []
    for i in range(5):
        s = s + x * x if i % 2 == 0 else s - x * x
        trace.append(s)
    np.testing.assert_allclose(out["s_final"], s)
    np.testing.assert_allclose(out["trace"], np.array(trace))


# -- refusal at load --------------------------------------------------------------------------------
def _with_inner_op(op_type: str, nested: bool):
    inner = _graph("inner", [helper.make_node(op_type, ["x"], ["t"])], [], [tensor_info("t", [3])])
    plain = _graph("plain", [helper.make_node("Neg", ["x"], ["e"])], [], [tensor_info("e", [3])])
    if nested:  # the unsupported op sits in an If inside the then-branch of another If
        inner = _graph("outer_then", [helper.make_node("If", ["cond"], ["u"], then_branch=inner, else_branch=plain)],
                       [], [tensor_info("u", [3])])
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=inner, else_branch=plain)]
    return make_model(nodes, [tensor_info("x", [3]), _scalar("cond", TensorProto.BOOL)], [tensor_info("y", [3])])


@pytest.mark.parametrize("nested", [False, True])
def test_unsupported_inner_op_is_refused_at_load(nested: bool) -> None:
    with pytest.raises(UnsupportedOperatorError, match=r"NoSuchOp.*If_0/then_branch/"):
        ai.load_model(_with_inner_op("NoSuchOp", nested))


# -- Scan -------------------------------------------------------------------------------------------
def _scan_model(opset: int, attrs: dict, x_shape: list, n_states_shape: list, with_lens: bool = False):
    """State: running sum of the scanned rows; scan output: the running sum after each step."""
    body = _graph("body", [helper.make_node("Add", ["sum_in", "row"], ["sum_out"]),
                           helper.make_node("Identity", ["sum_out"], ["so"])],
                  [tensor_info("sum_in", None), tensor_info("row", None)],
                  [tensor_info("sum_out", None), tensor_info("so", None)])
    inputs = ["lens" if with_lens else "", "init", "x"] if opset == 8 else ["init", "x"]
    nodes = [helper.make_node("Scan", inputs, ["final", "ys"], body=body, num_scan_inputs=1, **attrs)]
    graph_inputs = [tensor_info("init", n_states_shape), tensor_info("x", x_shape)]
    if with_lens:
        graph_inputs.append(tensor_info("lens", [None], TensorProto.INT64))
    return make_model(nodes, graph_inputs, [tensor_info("final", None), tensor_info("ys", None)],
                      opset=opset)


def test_scan_input_axis_directions_and_output_axis() -> None:
    x = np.arange(12, dtype=np.float32).reshape(2, 3, 2)  # scan axis 1 (3 steps) of rows of shape (2, 2)
    proto = _scan_model(11, {"scan_input_axes": [-2], "scan_input_directions": [1],
                             "scan_output_axes": [-1], "scan_output_directions": [1]}, [2, 3, 2], [2, 2])
    init = np.ones((2, 2), np.float32)
    out = _run(proto, {"init": init, "x": x})
    steps, s = [], init
    for t in reversed(range(3)):
        s = s + x[:, t, :]
        steps.append(s)
    np.testing.assert_allclose(out["final"], s)
    np.testing.assert_allclose(out["ys"], np.stack(steps[::-1], axis=-1))


def test_scan8_batch_with_sequence_lens_and_reverse_direction() -> None:
    x = np.arange(12, dtype=np.float32).reshape(2, 3, 2)  # batch 2, 3 steps of rows of 2
    lens = np.array([3, 1], np.int64)
    proto = _scan_model(8, {"directions": [1]}, [2, 3, 2], [2, 2], with_lens=True)
    init = np.zeros((2, 2), np.float32)
    out = _run(proto, {"init": init, "x": x, "lens": lens})
    finals, ys = [], []
    for b in range(2):
        s, steps = init[b], []
        for t in reversed(range(lens[b])):
            s = s + x[b, t]
            steps.append(s)
        finals.append(s)
        ys.append(np.concatenate([np.array(steps), np.zeros((3 - lens[b], 2), np.float32)]))
    np.testing.assert_allclose(out["final"], np.array(finals))
    np.testing.assert_allclose(out["ys"][0], ys[0])
    np.testing.assert_allclose(out["ys"][1, :1], ys[1][:1])  # past sequence_lens the values are undefined


# -- sequence and optional kernels (no ONNX node cases for most) ---------------------------------------
def make(op_type: str, version: int = 11, **attrs) -> ops.Op:
    layer = Layer(name=f"{op_type.lower()}0", op_type=op_type, inputs=[], outputs=["out"], attrs=attrs,
                  version=version)
    return ops.create(layer)


def test_sequence_ops_build_new_lists() -> None:
    a, b, c = (np.full(2, v, np.float32) for v in (1, 2, 3))
    seq = make("SequenceConstruct").run(a, b)
    assert make("SequenceEmpty").run() == []
    assert int(make("SequenceLength").run(seq)) == 2 and make("SequenceLength").run(seq).dtype == np.int64
    assert make("SequenceAt").run(seq, np.array(-1)) is b
    inserted = make("SequenceInsert").run(seq, c, np.array(1))
    assert [float(t[0]) for t in inserted] == [1, 3, 2] and len(seq) == 2  # input unchanged
    erased = make("SequenceErase").run(inserted, np.array(0))
    assert [float(t[0]) for t in erased] == [3, 2] and len(inserted) == 3
    assert [float(t[0]) for t in make("SequenceErase").run(seq)] == [1]
    with pytest.raises(ExecutionError, match="out of range"):
        make("SequenceAt").run(seq, np.array(2))


def test_concat_from_sequence_concatenates_or_stacks() -> None:
    seq = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)]
    np.testing.assert_array_equal(make("ConcatFromSequence", axis=1).run(seq), np.concatenate(seq, axis=1))
    np.testing.assert_array_equal(make("ConcatFromSequence", axis=-1, new_axis=1).run(seq), np.stack(seq, axis=-1))
    with pytest.raises(ExecutionError):
        make("ConcatFromSequence", axis=0).run([])


def test_split_to_sequence_scalar_split_leaves_a_shorter_last_piece() -> None:
    x = np.arange(10).reshape(5, 2)
    pieces = make("SplitToSequence").run(x, np.array(2))
    assert [p.shape for p in pieces] == [(2, 2), (2, 2), (1, 2)]
    with pytest.raises(ExecutionError, match="add up"):
        make("SplitToSequence").run(x, np.array([2, 2]))


def test_split_to_sequence_takes_zero_lengths() -> None:
    """Lengths are >= 0 (ONNX's simple test_sequence_model8 splits an empty tensor in three)."""
    pieces = make("SplitToSequence").run(np.arange(5.0), np.array([2, 0, 3]))
    assert [p.tolist() for p in pieces] == [[0.0, 1.0], [], [2.0, 3.0, 4.0]]
    assert [p.shape for p in make("SplitToSequence").run(np.zeros(0), np.array([0, 0, 0]))] == [(0,)] * 3
    with pytest.raises(ExecutionError, match="negative"):
        make("SplitToSequence").run(np.arange(5.0), np.array([6, -1]))
    with pytest.raises(ExecutionError, match="chunk length of 0"):
        make("SplitToSequence").run(np.arange(5.0), np.array(0))


def test_optional_ops() -> None:
    x = np.ones(2, np.float32)
    assert make("Optional", 15).run() is None and make("Optional", 15).run(x) is x
    assert bool(make("OptionalHasElement", 18).run(None)) is False
    assert bool(make("OptionalHasElement", 18).run([])) is True  # an empty sequence is still an element
    with pytest.raises(ExecutionError, match="empty"):
        make("OptionalGetElement", 18).run(None)


def test_reverse_sequence_on_higher_rank_input_does_not_mutate() -> None:
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)  # batch 0, time 1
    before = x.copy()
    y = make("ReverseSequence", 10, batch_axis=0, time_axis=1).run(x, np.array([2, 3]))
    np.testing.assert_array_equal(y[0], x[0][[1, 0, 2]])
    np.testing.assert_array_equal(y[1], x[1][::-1])
    np.testing.assert_array_equal(x, before)
