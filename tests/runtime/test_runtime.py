"""Task-graph runtime: scheduling returns at once, dependencies, parallelism, isolation, lifecycle."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import asyncinfer as ai
from conftest import BARRIERS, TEST_DOMAIN, LoopTicker, make_model, shape_arithmetic_model, tensor_info


def _record_layer_threads(monkeypatch, record) -> None:
    """Call ``record(step)`` on the thread that computes each CPU layer, whether a job runs it
    inline or it is dispatched alone (patched before the worker is made: plans bind both)."""
    import asyncinfer.backends.cpu.backend as cpu_backend

    compute = cpu_backend._compute
    monkeypatch.setattr(cpu_backend, "_compute", lambda step, args: record(step) or compute(step, args))
    inline_compute = cpu_backend.CPUBackend.inline_compute

    def recorded(backend, step):
        inline = inline_compute(backend, step)
        if step.activations:  # computed by `_compute`, which records it
            return inline
        return lambda args: record(step) or inline(args)

    monkeypatch.setattr(cpu_backend.CPUBackend, "inline_compute", recorded)


def test_schedule_returns_before_the_work_is_done(gated_model):
    model, gate = gated_model
    with ai.Worker(model, "cpu") as worker:
        execution = worker.schedule(np.ones((2, 3), np.float32))
        y = worker.peek_output()
        assert y.is_pending and not execution.done()
        assert not y.is_readback_request_done()
        gate.set()
        np.testing.assert_array_equal(y.readback_and_clone().numpy(), np.full((2, 3), 2, np.float32))
        assert execution.done()


def test_futures_sharing_a_lock_complete_each_other_from_callbacks_and_waiters():
    """A run's layer futures share one lock: a callback of one completing another, a callback
    added to a done future, and a thread blocked in `result` all proceed (nothing holds the lock
    while it calls out, so sharing cannot deadlock)."""
    from asyncinfer.concurrency.future import TaskFuture

    lock = threading.Lock()
    first, second, third = (TaskFuture(name, lock) for name in ("first", "second", "third"))
    first.add_done_callback(lambda f: second.set_result([f.result()[0] + 1]))
    second.add_done_callback(lambda f: third.add_done_callback(lambda _: None) or third.set_result([0]))
    seen: list = []
    waiter = threading.Thread(target=lambda: seen.append(second.result(timeout=5)), daemon=True)
    completer = threading.Thread(target=first.set_result, args=([1],), daemon=True)  # a deadlock: it stays alive
    waiter.start()
    completer.start()
    completer.join(5)
    waiter.join(5)
    assert not completer.is_alive() and seen == [[2]]
    assert third.result(timeout=0) == [0] and not lock.locked()


def test_a_blocked_waiter_wakes_when_its_future_completes_inside_another_ones_callback():
    """Callbacks of a completion made inside a callback wait for the outer one to return (constant
    stack depth), but a thread blocked in `wait` is woken at the completion itself: here the outer
    callback waits for that thread, which would deadlock if its wake-up were queued too."""
    from asyncinfer.concurrency.future import TaskFuture

    outer, inner = TaskFuture("outer"), TaskFuture("inner")
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: inner.wait(5) and woke.set(), daemon=True)
    waiter.start()
    while inner._callbacks is None:  # (the waiter is registered)
        time.sleep(0.001)
    order: list = []
    inner.add_done_callback(lambda _: order.append("inner callback"))

    def complete_inner_then_wait_for_the_waiter(_: TaskFuture) -> None:
        inner.set_result([1])
        order.append("waiter woke" if woke.wait(5) else "waiter still blocked")

    outer.add_done_callback(complete_inner_then_wait_for_the_waiter)
    outer.set_result([0])
    waiter.join(5)
    assert order == ["waiter woke", "inner callback"]
    assert inner.exception() is None and inner.peek() == [1]


def test_each_layer_is_a_future_completing_in_dependency_order(add_chain_model):
    model = ai.load_model(add_chain_model(4), optimize=False)
    with ai.Worker(model) as worker:
        execution = worker.schedule(np.zeros((1, 4), np.float32))
        worker.peek_output().readback_and_clone()
        layer_futures = [execution.step_future(i) for i in range(len(model.layers))]
        assert all(f.done() and not f.failed() for f in layer_futures)
        assert [f.label for f in layer_futures] == [l.name for l in model.layers]
        last = model.layers[-1].name
        np.testing.assert_array_equal(execution.layer_future(last).result()[0], np.full((1, 4), 4, np.float32))
        with pytest.raises(ai.AsyncInferError, match="no layer 'nope'"):
            execution.layer_future("nope")


def test_independent_layers_run_in_parallel():
    # Two layers that can only finish if both run at once: a barrier of 2 parties.
    BARRIERS["pair"] = threading.Barrier(2)
    nodes = [helper.make_node("Rendezvous", ["x"], ["a"], domain=TEST_DOMAIN, barrier="pair", name="left"),
             helper.make_node("Rendezvous", ["x"], ["b"], domain=TEST_DOMAIN, barrier="pair", name="right"),
             helper.make_node("Add", ["a", "b"], ["y"], name="join")]
    model = ai.load_model(make_model(nodes, [tensor_info("x", [3])], [tensor_info("y", [3])]))
    with ai.Worker(model, threads=2) as worker:
        worker.schedule(np.arange(3, dtype=np.float32))
        out = worker.peek_output().readback_and_clone().numpy()
    np.testing.assert_array_equal(out, 2 * np.arange(3, dtype=np.float32))
    assert not BARRIERS["pair"].broken


def test_one_lane_runs_layers_on_one_thread_and_splits_large_kernels(monkeypatch):
    """ASYNCINFER_CPU_LANES=1: layers run one at a time, on the lane thread or on the blocking
    caller working in its place; a large GEMM still uses the other core through a helper
    thread, and the results are the same."""
    from asyncinfer.ops import linalg

    monkeypatch.setenv("ASYNCINFER_CPU_LANES", "1")
    monkeypatch.setattr(linalg, "SPLIT_MIN_MACS", 0)
    monkeypatch.setattr(linalg, "PANEL_GEMM_MAX_A_BYTES", 0)  # the BLAS way, split across the pool
    monkeypatch.setenv("ASYNCINFER_PACKED_WEIGHTS", "0")  # (a packed weight takes the panel GEMM at any size)
    lane_threads, part_threads = set(), set()
    run_parts = linalg.parallel.run_parts

    helper_took_one = threading.Event()

    def spy_parts(count, part):
        def spied(i):
            name = threading.current_thread().name
            part_threads.add(name)
            if name.startswith("asyncinfer-part"):
                helper_took_one.set()
            else:  # (leave a part to a helper: a thread of higher priority could take them all first)
                helper_took_one.wait(1)
            part(i)
        return run_parts(count, spied)

    running, most = [0], [0]
    lock = threading.Lock()

    def record(step):
        lane_threads.add(threading.current_thread().name)
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.002)  # (long enough for a second thread's layer to overlap, if one ran)
        with lock:
            running[0] -= 1

    _record_layer_threads(monkeypatch, record)
    monkeypatch.setattr(linalg.parallel, "run_parts", spy_parts)
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="left"),
             helper.make_node("Relu", ["x"], ["b"], name="right"),
             helper.make_node("Add", ["a", "b"], ["y"], name="join")]
    model = ai.load_model(make_model(nodes, [tensor_info("x", [64, 64])], [tensor_info("y", [64, 64])],
                                     [helper.make_tensor("w", TensorProto.FLOAT, [64, 64], w.ravel())]))
    x = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    with ai.Worker(model, threads=2) as worker:
        assert worker._backend.lanes == 1
        for _ in range(5):
            np.testing.assert_allclose(worker.run_blocking(x)["y"], x @ w + np.maximum(x, 0), rtol=1e-5, atol=1e-5)
    assert most == [1]
    lanes = {n for n in lane_threads if n.startswith("asyncinfer-cpu")}
    assert len(lanes) == 1 and lane_threads <= lanes | {threading.current_thread().name}
    assert any(n.startswith("asyncinfer-part") for n in part_threads)


def _branching_model(first: list, source: str, length: int) -> ai.Model:
    """``first`` layers, then a root Relu of ``source`` feeding three paths of ``length``
    alternating Abs/Neg layers, joined by a Sum into ``y`` (x and y: 8 floats)."""
    nodes = first + [helper.make_node("Relu", [source], ["r"], name="root")]
    branches = []
    for b in range(3):
        last = "r"
        for i in range(length):
            out = f"b{b}_{i}"
            nodes.append(helper.make_node("Neg" if i % 2 else "Abs", [last], [out], name=out))
            last = out
        branches.append(last)
    nodes.append(helper.make_node("Sum", branches, ["y"], name="join"))
    return ai.load_model(make_model(nodes, [tensor_info("x", [8])], [tensor_info("y", [8])]))


def test_a_serial_run_keeps_the_branches_a_layer_makes_ready_on_its_thread(monkeypatch):
    """Execution(serial=True) (the generation engine's decode steps): the branches that one layer
    makes ready run after it on its thread, each path as one job, not handed to the other lane.
    (The root waits until the whole run is scheduled: a job found ready while the scheduling
    thread still walks the plan goes to the pool from there.)"""
    from asyncinfer.runtime.execution import Execution

    threads: dict[str, set[str]] = {}
    _record_layer_threads(monkeypatch, lambda step: threads.setdefault(step.layer.name, set()).add(
        threading.current_thread().name))
    gate = helper.make_node("Rendezvous", ["x"], ["g"], domain=TEST_DOMAIN, barrier="scheduled", name="gate")
    model = _branching_model([gate], "g", length=3)  # three paths of three layers each, all fed by the root
    x = np.linspace(-2, 2, 8).astype(np.float32)
    expected = np.abs(np.maximum(x, 0)) * 3  # Abs(Neg(Abs(relu))) on each branch
    with ai.Worker(model, threads=2) as worker:
        for _ in range(20):
            threads.clear()
            BARRIERS["scheduled"] = threading.Barrier(2)
            execution = Execution(worker._plan, _completed_inputs(x), worker=worker, serial=True)
            execution.submit_all()
            BARRIERS["scheduled"].wait(30)
            np.testing.assert_array_equal(execution.read_outputs_blocking()["y"], expected)
            used = set().union(*threads.values())
            assert len(used) == 1, f"a serial run used {sorted(used)}: {threads}"


def test_a_plan_for_serial_runs_makes_branches_one_segment_and_keeps_every_layer_future():
    """`Plan.for_serial_runs` (the generation engine's plans): a root feeding three paths and a
    join is one job instead of five (paths cut at every branch otherwise); every layer still
    completes its own future, and the result is the same."""
    from asyncinfer.runtime.execution import Execution

    model = _branching_model([], "x", length=2)
    x = np.linspace(-2, 2, 8).astype(np.float32)
    with ai.Worker(model, threads=2) as worker:
        assert len(worker._plan.segments) == 4  # root and the first branch, two more branches, the join
        serial = worker._plan.for_serial_runs()
        assert [len(s.nodes) for s in serial.segments] == [len(serial.nodes)]
        assert len(worker._plan.segments) == 4  # a variant: the worker's own plan is unchanged
        execution = Execution(serial, _completed_inputs(x), worker=worker, serial=True).submit_all()
        np.testing.assert_array_equal(execution.read_outputs_blocking()["y"], -np.abs(np.maximum(x, 0)) * 3)
        futures = [execution.layer_future(n.layer.name) for n in serial.nodes]
        assert all(f.done() and not f.failed() for f in futures)


def test_a_serial_segment_stops_at_a_step_that_reads_a_value_from_outside_it(monkeypatch):
    """A step reading a value its segment does not make (here a MatMul's, which takes turns in
    the lane when BLAS is kept multi-threaded, so is a step of its own) starts a new segment:
    a segment never waits midway."""
    from asyncinfer.backends.cpu import blas
    from asyncinfer.runtime.execution import Execution

    monkeypatch.setattr(blas, "acquire", lambda: False)
    monkeypatch.setattr(blas, "release", lambda: None)
    w = numpy_helper.from_array(np.eye(2, dtype=np.float32) * 2, "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Add", ["r", "m"], ["y"], name="join")]
    model = ai.load_model(make_model(nodes, [tensor_info("x", [1, 2])], [tensor_info("y", [1, 2])],
                                     initializers=[w]))
    with ai.Worker(model, threads=2) as worker:
        serial = worker._plan.for_serial_runs()
        assert [[n.layer.name for n in s.nodes] for s in serial.segments] == [["matmul"], ["relu"], ["join"]]
        execution = Execution(serial, _completed_inputs(np.array([[-1, 2]], np.float32)), worker=worker,
                              serial=True).submit_all()
        np.testing.assert_array_equal(execution.read_outputs_blocking()["y"], [[-2, 6]])


def _completed_inputs(x: np.ndarray) -> dict:
    from asyncinfer.concurrency.future import TaskFuture

    return {"x": TaskFuture.completed([x], label="x")}


@pytest.mark.anyio
async def test_concurrent_runs_never_mix_tensors(add_chain_model):
    import anyio

    model = ai.load_model(add_chain_model(20))
    results: dict[int, dict] = {}

    async def one(i: int) -> None:
        results[i] = await worker.run(np.full((3, 4), i, np.float32))

    async with ai.Worker(model) as worker:
        async with anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(one, i)
    for i, out in sorted(results.items()):
        np.testing.assert_array_equal(out["y"], np.full((3, 4), i + 20, np.float32))


def test_peek_output_by_name_and_take_output(failing_model, add_chain_model):
    model = ai.load_model(add_chain_model(2))
    worker = ai.Worker(model)
    worker.schedule(np.zeros((2, 4), np.float32))
    peeked = worker.peek_output("y")
    taken = worker.take_output("y")
    np.testing.assert_array_equal(taken.download_to_array(), np.full((2, 4), 2, np.float32))
    with pytest.raises(ai.AsyncInferError, match="no output 'nope'"):
        worker.peek_output("nope")
    worker.dispose()
    np.testing.assert_array_equal(taken.numpy(), np.full((2, 4), 2, np.float32))  # caller-owned survives
    with pytest.raises(ai.DisposedError):
        peeked.readback_and_clone()  # worker-owned does not


def test_schedule_iterable_schedules_one_layer_per_step(add_chain_model):
    model = ai.load_model(add_chain_model(3), optimize=False)
    with ai.Worker(model) as worker:
        steps = worker.schedule_iterable(np.zeros((1, 4), np.float32))
        names = []
        for name in steps:
            names.append(name)
        assert names == [l.name for l in model.layers]
        np.testing.assert_array_equal(worker.peek_output().download_to_array(), np.full((1, 4), 3, np.float32))


def test_schedule_iterable_checks_inputs_before_the_first_step(add_chain_model):
    model = ai.load_model(add_chain_model(3))
    with ai.Worker(model) as worker, pytest.raises(ai.InputError):
        worker.schedule_iterable(np.zeros((1, 5), np.float32))


def test_peek_before_schedule_is_a_clear_error(add_chain_model):
    with ai.Worker(ai.load_model(add_chain_model(1))) as worker:
        with pytest.raises(ai.AsyncInferError, match="nothing scheduled"):
            worker.peek_output()


@pytest.mark.parametrize("threads, error, message", [
    (0, ValueError, "at least 1, got 0"), (-2, ValueError, "at least 1, got -2"),
    ("2", TypeError, "positive integer .*got str '2'"), (1.5, TypeError, "got float 1.5"),
    (True, TypeError, "got True")])
def test_a_thread_count_that_is_not_a_positive_integer_is_refused(add_chain_model, threads, error, message):
    model = ai.load_model(add_chain_model(1))
    before = set(threading.enumerate())
    with pytest.raises(error, match=message):
        ai.Worker(model, threads=threads)
    assert not {t for t in threading.enumerate() if t.name.startswith("asyncinfer")} - before


def test_a_numpy_integer_is_a_thread_count(add_chain_model):
    with ai.Worker(ai.load_model(add_chain_model(1)), threads=np.int64(2)) as worker:
        assert worker._backend.threads == 2 and type(worker._backend.threads) is int


def test_dispose_stops_the_threads_and_refuses_use(add_chain_model):
    before = {t.name for t in threading.enumerate()}
    worker = ai.Worker(ai.load_model(add_chain_model(2)), threads=2)
    worker.schedule(np.zeros((1, 4), np.float32))
    worker.peek_output().readback_and_clone()
    worker.dispose()
    worker.dispose()  # idempotent
    alive = [t for t in threading.enumerate() if t.name.startswith("asyncinfer-cpu") and t.name not in before]
    assert alive == []
    with pytest.raises(ai.DisposedError):
        worker.schedule(np.zeros((1, 4), np.float32))


@pytest.mark.anyio
async def test_async_context_manager_disposes(add_chain_model):
    async with ai.Worker(ai.load_model(add_chain_model(2))) as worker:
        out = await worker.run(np.zeros((1, 4), np.float32))
        np.testing.assert_array_equal(out["y"], np.full((1, 4), 2, np.float32))
    assert worker.disposed


def test_lifecycle_states_are_enums(add_chain_model):
    worker = ai.Worker(ai.load_model(add_chain_model(2)))
    assert worker.state is ai.WorkerState.OPEN
    worker.schedule(np.zeros((1, 4), np.float32))
    tensor = worker.take_output()
    tensor.readback_and_clone()
    assert tensor.state is ai.TensorState.READY
    tensor.dispose()
    assert tensor.state is ai.TensorState.DISPOSED
    worker.dispose()
    assert worker.state is ai.WorkerState.DISPOSED and "disposed" in repr(worker)


@pytest.mark.anyio
async def test_deprecated_aliases_warn_and_still_work(add_chain_model):
    worker = ai.Worker(ai.load_model(add_chain_model(2)))
    execution = worker.schedule(np.ones((1, 4), np.float32))
    with pytest.warns(DeprecationWarning, match="read_outputs_blocking"):
        np.testing.assert_array_equal(execution.output_arrays()["y"], execution.read_outputs_blocking()["y"])
    with pytest.warns(DeprecationWarning, match="dispose_async"):
        await worker.aclose()
    assert worker.disposed


def test_run_blocking_twin(add_chain_model):
    with ai.Worker(ai.load_model(add_chain_model(2))) as worker:
        out = worker.run_blocking({"x": np.ones((2, 4), np.float32)})
    np.testing.assert_array_equal(out["y"], np.full((2, 4), 3, np.float32))


@pytest.mark.anyio
async def test_run_twins_return_caller_owned_copies_of_the_same_values():
    """``run`` and ``run_blocking`` read their host outputs straight from the steps' values (no
    tensor readback): each output is the caller's own, never the input read in place nor another
    output's buffer, and the blocking twin raises a failed run's error as the awaited one does."""
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["same"]), helper.make_node("Relu", ["x"], ["relu"])], "g", [x_info],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("relu", "same")])
    model = ai.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
    with ai.Worker(model, "cpu") as worker:
        for out in (worker.run_blocking(x), await worker.run(x)):
            assert list(out) == ["relu", "same"]
            np.testing.assert_array_equal(out["same"], x)
            np.testing.assert_array_equal(out["relu"], np.maximum(x, 0))
            assert not np.shares_memory(out["same"], x) and not np.shares_memory(out["same"], out["relu"])
    shape_info = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "g", [x_info, shape_info],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = ai.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with ai.Worker(model, "cpu") as worker:
        for run in (worker.run_blocking, worker.run):
            with pytest.raises(ai.ExecutionError, match="Reshape"):
                result = run(x, np.array([4, 4], np.int64))
                if not isinstance(result, dict):
                    await result
        np.testing.assert_array_equal(worker.run_blocking(x, np.array([3, 2], np.int64))["y"], x.reshape(3, 2))



@pytest.mark.anyio
async def test_a_waited_run_hands_over_the_arrays_only_it_holds_and_copies_the_rest(monkeypatch):
    """``run``/``run_blocking`` give the caller an output array a step made and nothing else
    holds as it is (no copy), or a view of one; an output the worker still holds (a constant, a shape the worker
    keeps for later runs of that signature, the caller's own input, another output's array) is
    copied. Whatever the caller then does to its arrays, later runs' outputs do not change."""
    import asyncinfer.runtime.execution as execution

    copied = []
    copy_value = execution.copy_value

    def copying(value):
        copied.append(copy_value(value))
        return copied[-1]
    monkeypatch.setattr(execution, "copy_value", copying)
    weight = numpy_helper.from_array(np.full((6,), 2, np.float32), "w")
    nodes = [helper.make_node("Relu", ["x"], ["fresh"]),
             helper.make_node("Mul", ["x", "w"], ["scaled"]),
             helper.make_node("Reshape", ["scaled", "flat"], ["view"]),
             helper.make_node("Identity", ["w"], ["constant"]),
             helper.make_node("Identity", ["x"], ["same"]),
             helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Sigmoid", ["x"], ["twice"]),
             helper.make_node("Identity", ["twice"], ["again"])]
    flat = numpy_helper.from_array(np.array([-1], np.int64), "flat")
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
               for n in ("fresh", "view", "constant", "same", "twice", "again")]
    outputs.append(helper.make_tensor_value_info("shape", TensorProto.INT64, [2]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])], outputs,
                              [weight, flat])
    model = ai.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.arange(-6, 6, dtype=np.float32).reshape(2, 6)
    expected = {"fresh": np.maximum(x, 0), "view": (x * 2).reshape(-1), "constant": np.full((6,), 2, np.float32),
                "same": x, "shape": np.array([2, 6], np.int64), "twice": 1 / (1 + np.exp(-x)),
                "again": 1 / (1 + np.exp(-x))}
    views_handed = 0
    with ai.Worker(model, "cpu") as worker:
        for i in range(6):  # (the first run of a signature records its shapes; later ones take them as known)
            copied.clear()
            out = worker.run_blocking(x) if i % 2 else await worker.run(x)
            for name, value in expected.items():
                np.testing.assert_allclose(out[name], value, rtol=1e-6)
            assert not np.shares_memory(out["twice"], out["again"])
            for name in expected:
                out[name][...] = 7  # the caller's to change
            handed = {name for name, value in out.items() if not any(value is c for c in copied)}
            assert "fresh" in handed and not {"constant", "same"} & handed, handed
            views_handed += "view" in handed
        np.testing.assert_array_equal(x, np.arange(-6, 6, dtype=np.float32).reshape(2, 6))
        assert not np.shares_memory(worker.run_blocking(x)["same"], x)
    # a view of an array nothing else holds goes as it is too (now and then a pool thread still
    # holds its base a moment after its step completed: then it is copied)
    assert views_handed, "the Reshape's view was copied in every run"


def test_schedule_copies_its_inputs_and_a_waited_run_reads_them_in_place(gated_model):
    """``schedule`` returns while its run is pending, so it runs on a copy (the caller may reuse
    its buffer at once); ``run``/``run_blocking`` read a C-contiguous, writeable array of the
    input's type in place, as ONNX Runtime does, and copy anything else (another layout or byte
    order, a read-only array)."""
    from asyncinfer.runtime.inputs import bind_inputs

    model, gate = gated_model
    x = np.ones((2, 3), np.float32)
    with ai.Worker(model, "cpu") as worker:
        execution = worker.schedule(x)
        x[:] = 7  # while the run waits at the gate
        gate.set()
        np.testing.assert_array_equal(execution.take_output("y").download_to_array(), np.full((2, 3), 2, np.float32))
    assert bind_inputs(model, (x,), {}, borrow=True)["x"].peek()[0] is x
    assert bind_inputs(model, (x,), {})["x"].peek()[0] is not x
    read_only = np.ones((2, 3), np.float32)
    read_only.setflags(write=False)  # (a request body's view: kernels compiled for it would compile again)
    for other in (np.ones((3, 2), np.float32).T, np.ones((2, 3), ">f4"), read_only):  # (a transposed view, big-endian)
        bound = bind_inputs(model, (other,), {}, borrow=True)["x"].peek()[0]
        assert bound is not other and bound.flags.c_contiguous and bound.dtype == np.float32
        np.testing.assert_array_equal(bound, other)


def test_pending_tensor_can_feed_another_worker(gated_model, add_chain_model):
    model, gate = gated_model
    first = ai.Worker(model)
    second = ai.Worker(ai.load_model(make_model(
        [helper.make_node("Mul", ["x", "x"], ["y"])], [tensor_info("x", [2, 3])], [tensor_info("y", [2, 3])])))
    first.schedule(np.full((2, 3), 2, np.float32))
    second.schedule(first.peek_output())  # chained while still pending
    assert second.peek_output().is_pending
    gate.set()
    np.testing.assert_array_equal(second.peek_output().download_to_array(), np.full((2, 3), 9, np.float32))
    first.dispose()
    second.dispose()


def test_intermediate_values_are_released_after_their_last_reader(add_chain_model):
    model = ai.load_model(add_chain_model(6), optimize=False)
    with ai.Worker(model) as worker:
        execution = worker.schedule(np.zeros((1, 4), np.float32))
        worker.peek_output().readback_and_clone()
        from asyncinfer.runtime.execution import RELEASED

        intermediates = [execution.step_future(i).peek()[0] for i in range(len(model.layers) - 1)]
        assert all(v is RELEASED for v in intermediates)
        assert execution.step_future(len(model.layers) - 1).peek()[0] is not None  # the output is kept


def test_placement_reports_every_layer_on_cpu(digits_model):
    with ai.Worker(digits_model) as worker:
        placement = worker.placement
    assert set(placement.layers) == {l.name for l in digits_model.layers}
    assert set(placement.layers.values()) == {"cpu"}
    assert placement.transfers == 0 and placement.fallback == []


def test_outputs_that_are_constants_or_inputs():
    c = helper.make_tensor("c", TensorProto.FLOAT, [2], [1.0, 2.0])
    proto = make_model([helper.make_node("Identity", ["x"], ["y"])], [tensor_info("x", [2])],
                       [tensor_info("y", [2]), tensor_info("c", [2])], [c])
    with ai.Worker(ai.load_model(proto)) as worker:
        out = worker.run_blocking(np.array([5, 6], np.float32))
    np.testing.assert_array_equal(out["y"], [5, 6])
    np.testing.assert_array_equal(out["c"], [1, 2])


@pytest.mark.asyncio
async def test_cancelled_run_skips_unstarted_layers_and_worker_survives(gated_model):
    model, gate = gated_model
    async with ai.Worker(model) as worker:
        task = asyncio.ensure_future(worker.run(np.ones((2, 3), np.float32)))
        await asyncio.sleep(0.01)  # the run is stuck behind the closed gate
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()  # the gate layer finishes; the Add after it must be skipped, not run
        out = await worker.run(np.zeros((2, 3), np.float32))
        np.testing.assert_array_equal(out["y"], np.ones((2, 3), np.float32))


def test_execution_cancel_skips_layers_not_started(gated_model):
    model, gate = gated_model
    with ai.Worker(model) as worker:
        execution = worker.schedule(np.ones((2, 3), np.float32))
        execution.cancel()
        gate.set()
        # 'add' never runs; 'gate' too is skipped if the pool had not started it yet
        with pytest.raises(ai.ExecutionError, match="cancelled before layer '(add|gate)'"):
            worker.peek_output().readback_and_clone()
        assert execution.layer_future("add").failed()


def test_schedule_iterable_stopped_early_fails_the_rest_instead_of_hanging(add_chain_model):
    model = ai.load_model(add_chain_model(4), optimize=False)
    with ai.Worker(model) as worker:
        steps = worker.schedule_iterable(np.zeros((1, 4), np.float32))
        next(steps)
        steps.close()
        with pytest.raises(ai.ExecutionError, match="never scheduled"):
            worker.peek_output().readback_and_clone()


@pytest.mark.anyio
async def test_schedule_iterable_async_yields_to_the_loop_between_layers(add_chain_model):
    import anyio

    model = ai.load_model(add_chain_model(6), optimize=False)
    ticks_seen = []
    ticker = LoopTicker()
    async with ai.Worker(model) as worker:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            async for _ in worker.schedule_iterable_async(np.zeros((1, 4), np.float32)):
                ticks_seen.append(ticker.ticks)
            tg.cancel_scope.cancel()
        out = await worker.peek_output().readback_and_clone_async()
    np.testing.assert_array_equal(out.numpy(), np.full((1, 4), 6, np.float32))
    assert len(ticks_seen) == 6 and ticks_seen[-1] > ticks_seen[0]  # other tasks ran in between


@pytest.mark.anyio
async def test_cancelled_async_schedule_iterable_leaves_nothing_pending(add_chain_model):
    import anyio

    model = ai.load_model(add_chain_model(50), optimize=False)
    async with ai.Worker(model) as worker:
        with anyio.move_on_after(0):  # cancelled at its first checkpoint
            async for _ in worker.schedule_iterable_async(np.zeros((1, 4), np.float32)):
                pass
        with pytest.raises(ai.ExecutionError, match="never scheduled"):
            await worker.peek_output().readback_and_clone_async()
        out = await worker.run(np.zeros((1, 4), np.float32))  # the worker is fine
    np.testing.assert_array_equal(out["y"], np.full((1, 4), 50, np.float32))


@pytest.mark.anyio
async def test_timeout_on_a_run_skips_its_rest_and_leaks_nothing(gated_model):
    import gc

    import anyio

    from asyncinfer.runtime.execution import Execution

    model, gate = gated_model
    async with ai.Worker(model) as worker:
        with anyio.move_on_after(0.05) as scope:
            await worker.run(np.ones((2, 3), np.float32))
        assert scope.cancelled_caught
        gate.set()
        out = await worker.run(np.zeros((2, 3), np.float32))  # the worker is intact
        np.testing.assert_array_equal(out["y"], np.ones((2, 3), np.float32))
        for _ in range(100):  # the cancelled run's started layer finishes on the pool, then its graph is freed
            gc.collect()
            if not [o for o in gc.get_objects() if isinstance(o, Execution) and o.worker is worker]:
                break
            await anyio.sleep(0.01)
        assert not [o for o in gc.get_objects() if isinstance(o, Execution) and o.worker is worker]


def test_taken_outputs_of_a_pending_run_survive_dispose(gated_model):
    model, gate = gated_model
    worker = ai.Worker(model)
    worker.schedule(np.ones((2, 3), np.float32))
    kept = worker.take_output()
    threading.Timer(0.05, gate.set).start()
    worker.dispose()  # finishes the run the caller owns an output of, instead of cancelling it
    np.testing.assert_array_equal(kept.numpy(), np.full((2, 3), 2, np.float32))



def test_warmup_option_runs_the_model_at_construction(digits_model, digits_samples):
    images = digits_samples[0][:1]
    with ai.Worker(digits_model, warmup=True) as warmed, ai.Worker(digits_model) as cold:
        for name, value in cold.run_blocking(images).items():
            np.testing.assert_array_equal(warmed.run_blocking(images)[name], value)


@pytest.mark.anyio
async def test_warmup_builds_inputs_from_symbolic_shapes():
    async with ai.Worker(ai.load_model(shape_arithmetic_model())) as worker:
        await worker.warmup()  # x is (N, 2, 3): N counts as 1
        worker.warmup_blocking(np.ones((4, 2, 3), np.float32))  # or the caller's own example
        out = await worker.run(np.ones((2, 2, 3), np.float32))
        assert next(iter(out.values())).shape == (2, 6)


@pytest.mark.anyio
async def test_warmup_with_a_wrong_example_is_an_input_error():
    async with ai.Worker(ai.load_model(shape_arithmetic_model())) as worker:
        with pytest.raises(ai.InputError):
            await worker.warmup(np.ones((2, 5), np.float32))


def _done_within(tensor: ai.Tensor, seconds: float = 30.0) -> bool:
    """Poll a readback with a deadline, so a regression fails the test instead of hanging it."""
    deadline = time.monotonic() + seconds
    while not tensor.is_readback_request_done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _gated_chain(gate_name: str, length: int, fail: bool) -> ai.Model:
    """Gate → (Fail) → ``length`` Adds: every layer is wired before the first one completes."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("Gate", ["x"], ["t0"], domain=TEST_DOMAIN, gate=gate_name, name="gate")]
    if fail:
        nodes.append(helper.make_node("Fail", ["t0"], ["f"], domain=TEST_DOMAIN, name="broken"))
        nodes.append(helper.make_node("Add", ["f", "one"], ["t1"], name="add_f"))
    else:
        nodes.append(helper.make_node("Add", ["t0", "one"], ["t1"], name="add_f"))
    for i in range(1, length):
        nodes.append(helper.make_node("Add", [f"t{i}", "one"], ["y" if i == length - 1 else f"t{i + 1}"], name=f"add{i}"))
    return ai.load_model(make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])], [one]))


def test_a_failure_travels_down_a_long_chain_without_recursion(gate):
    name, event = gate
    with ai.Worker(_gated_chain(name, 5000, fail=True)) as worker:
        worker.schedule(np.ones(2, np.float32))
        y = worker.peek_output()  # (not taken: a regression must fail the test, not hang dispose)
        event.set()  # the failure now meets 5000 layers already waiting on it
        assert _done_within(y), "the failure never reached the end of the chain"
        with pytest.raises(ai.ExecutionError, match="broken"):
            y.readback_and_clone()


def test_cancelling_a_long_chain_fails_every_layer_promptly(gate):
    name, event = gate
    with ai.Worker(_gated_chain(name, 5000, fail=False)) as worker:
        execution = worker.schedule(np.ones(2, np.float32))
        y = worker.peek_output()  # (not taken: a regression must fail the test, not hang dispose)
        execution.cancel()
        event.set()
        assert _done_within(y), "the cancellation never reached the end of the chain"
        with pytest.raises(ai.ExecutionError, match="cancelled"):
            y.readback_and_clone()


def test_a_raising_readback_callback_is_isolated(add_chain_model, caplog):
    with ai.Worker(ai.load_model(add_chain_model(3))) as worker:
        worker.schedule(np.zeros((1, 4), np.float32))
        y = worker.peek_output()
        seen, called = [], threading.Event()

        def broken(ok: bool) -> None:
            raise RuntimeError("a user callback with a bug")

        def record(ok: bool) -> None:
            seen.append(ok)
            called.set()

        y.readback_request(broken)
        y.readback_request(record)  # registered after the broken one: still called
        y.readback_and_clone()
        assert called.wait(10) and seen == [True]
        out = worker.run_blocking(np.zeros((1, 4), np.float32))  # the worker stays usable
        np.testing.assert_array_equal(out["y"], np.full((1, 4), 3, np.float32))


def _endless_loop_model() -> ai.Model:
    """A Loop whose trip count (10^12) would keep a pool thread busy for days."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["s_in", "one"], ["s_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [1])])
    trips = helper.make_tensor("trips", TensorProto.INT64, [], [10 ** 12])
    nodes = [helper.make_node("Loop", ["trips", "", "x"], ["y"], body=body, name="endless")]
    return ai.load_model(make_model(nodes, [tensor_info("x", [1])], [tensor_info("y", [1])], [one, trips]))


def _long_scan_model() -> ai.Model:
    """A Scan of a running sum over a sequence of any length."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "x_t"], ["s_out"]),
         helper.make_node("Identity", ["s_out"], ["scan_out"])],
        "body",
        [helper.make_tensor_value_info("s_in", TensorProto.FLOAT, [1]),
         helper.make_tensor_value_info("x_t", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("s_out", TensorProto.FLOAT, [1]),
         helper.make_tensor_value_info("scan_out", TensorProto.FLOAT, [1])])
    nodes = [helper.make_node("Scan", ["s0", "xs"], ["y", "ys"], body=body, num_scan_inputs=1, name="long_scan")]
    return ai.load_model(make_model(nodes, [tensor_info("s0", [1]), tensor_info("xs", ["n", 1])],
                                    [tensor_info("y", [1]), tensor_info("ys", ["n", 1])]))


@pytest.mark.parametrize("which", ["loop", "scan"])
def test_cancel_stops_a_running_loop_or_scan_between_iterations(which):
    model = _endless_loop_model() if which == "loop" else _long_scan_model()
    inputs = ([np.zeros(1, np.float32)] if which == "loop"
              else [np.zeros(1, np.float32), np.ones((10 ** 6, 1), np.float32)])
    with ai.Worker(model, threads=2) as worker:
        execution = worker.schedule(*inputs)
        y = worker.peek_output()
        time.sleep(0.2)  # let the kernel start iterating (a cancel before it starts is the easy case)
        execution.cancel()
        assert _done_within(y), f"the cancelled {which} kept running"
        with pytest.raises(ai.ExecutionError, match="cancelled"):
            y.readback_and_clone()
        if which == "scan":  # the pool is free again: a short scan on the same worker completes
            out = worker.run_blocking(np.zeros(1, np.float32), np.ones((5, 1), np.float32))
            assert out["y"][0] == 5


def test_a_thread_that_cannot_start_fails_the_run_and_the_worker_recovers(add_chain_model, monkeypatch):
    def refuse(self):
        raise RuntimeError("can't start new thread")

    with ai.Worker(ai.load_model(add_chain_model(2)), threads=2) as worker:  # no pool thread yet
        monkeypatch.setattr(threading.Thread, "start", refuse)
        worker.schedule(np.zeros((1, 4), np.float32))  # handed to the pool, whose thread cannot start
        with pytest.raises(ai.ExecutionError, match="cannot start a thread"):
            worker.peek_output().readback_and_clone()
        # a blocking run needs no pool thread: its caller runs the work it waits for
        out = worker.run_blocking(np.zeros((1, 4), np.float32))
        np.testing.assert_array_equal(out["y"], np.full((1, 4), 2, np.float32))
        monkeypatch.undo()
        worker.schedule(np.zeros((1, 4), np.float32))
        np.testing.assert_array_equal(worker.peek_output().readback_and_clone().numpy(), np.full((1, 4), 2))


def test_a_blocking_run_runs_its_first_work_on_the_calling_thread(add_chain_model, monkeypatch):
    """run_blocking waits anyway: its thread runs the job it made ready (no hand-off to the pool
    and back); awaited and scheduled runs still run on the pool. With one lane, the caller works
    in the lane's place while it is idle, and hands the run over while it is busy (or not
    started yet)."""
    threads: list[str] = []
    _record_layer_threads(monkeypatch, lambda step: threads.append(threading.current_thread().name))
    x = np.zeros((1, 4), np.float32)
    with ai.Worker(ai.load_model(add_chain_model(3)), threads=2) as worker:
        np.testing.assert_array_equal(worker.run_blocking(x)["y"], np.full((1, 4), 3, np.float32))
        assert threads == [threading.current_thread().name] * 3
        threads.clear()
        worker.schedule(x)
        worker.peek_output().readback_and_clone()
        assert len(threads) == 3 and threading.current_thread().name not in threads
    monkeypatch.setenv("ASYNCINFER_CPU_LANES", "1")
    threads.clear()
    with ai.Worker(ai.load_model(add_chain_model(3)), threads=2) as worker:
        worker.run_blocking(x)
        assert len(threads) == 3 and threading.current_thread().name not in threads  # (no lane idle yet)
        pool = worker._backend._pool
        deadline = time.monotonic() + 10
        while pool.idle != 1:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        threads.clear()
        np.testing.assert_array_equal(worker.run_blocking(x)["y"], np.full((1, 4), 3, np.float32))
        assert threads == [threading.current_thread().name] * 3
        assert pool.idle == 1  # (given back)


def test_a_device_thread_that_cannot_start_is_backend_unavailable(monkeypatch):
    from asyncinfer.concurrency.device_thread import DeviceThread

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(ai.BackendUnavailableError, match="cannot start"):
        DeviceThread("test-device")


def test_a_path_of_light_layers_runs_as_one_segment_with_every_layer_future_observable(add_chain_model):
    with ai.Worker(ai.load_model(add_chain_model(50))) as worker:
        assert [len(s.nodes) for s in worker._plan.segments] == [50]  # one job, not 50 dispatches
        execution = worker.schedule(np.zeros((1, 4), np.float32))
        np.testing.assert_array_equal(worker.peek_output().readback_and_clone().numpy(), np.full((1, 4), 50))
        futures = [execution.layer_future(f"add{i}") for i in range(50)]
        assert all(f.done() and not f.failed() for f in futures)  # each layer completed its own future
        np.testing.assert_array_equal(futures[-1].peek()[0], np.full((1, 4), 50))


def _private_chain(gate_name: str) -> ai.Model:
    """x → add0 → add1 → Gate → add2 → add3 → y, one segment: every step but the last is read
    only by the next (segment-private), and the run waits in the gate."""
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [helper.make_node("Add", ["x", "one"], ["t0"], name="add0"),
             helper.make_node("Add", ["t0", "one"], ["t1"], name="add1"),
             helper.make_node("Gate", ["t1"], ["g"], domain=TEST_DOMAIN, gate=gate_name, name="gate"),
             helper.make_node("Add", ["g", "one"], ["t2"], name="add2"),
             helper.make_node("Add", ["t2", "one"], ["y"], name="add3")]
    return ai.load_model(make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2])], [one]), optimize=False)


def test_a_segment_private_layer_future_is_made_when_asked_and_completes_with_the_layer(gate):
    from asyncinfer.runtime.execution import LAZY, RELEASED

    name, event = gate
    with ai.Worker(_private_chain(name)) as worker:
        (segment,) = worker._plan.segments
        assert [worker._plan.nodes[i].layer.name for i in segment.private] == ["add0", "add1", "gate", "add2"]
        execution = worker.schedule(np.zeros(2, np.float32))
        assert segment.private_spans == ((segment.private[0], segment.private[-1] + 1),)
        assert all(execution.futures[i] is LAZY for i in segment.private)  # nobody asked yet: none made
        assert execution.futures[segment.nodes[-1].index] is not LAZY
        assert execution.layer_future("add1").wait(10)  # made pending; completes before the gate
        done_before = execution.layer_future("add0")  # computed already: made complete
        assert done_before.done() and not done_before.failed() and done_before.label == "add0"
        assert done_before.peek()[0] is RELEASED  # (add1 read it)
        after = execution.layer_future("add2")  # made pending while the job waits in the gate
        assert not after.done() and execution.layer_future("add2") is after
        seen = []
        after.add_done_callback(lambda f: seen.append(f.peek()[0].copy()))  # before the next layer frees it
        event.set()
        np.testing.assert_array_equal(execution.take_output().readback_and_clone().numpy(), [4, 4])
        assert after.wait(10) and len(seen) == 1
        np.testing.assert_array_equal(seen[0], [3, 3])
        assert execution.layer_future("add2").peek()[0] is RELEASED  # freed after its reader, as before


def test_private_spans_are_the_runs_of_consecutive_private_steps():
    from asyncinfer.runtime.plan import _spans

    assert _spans(()) == ()
    assert _spans((3,)) == ((3, 4),)
    assert _spans((1, 2, 3, 7, 8, 10)) == ((1, 4), (7, 9), (10, 11))


def test_a_segment_private_layer_future_made_after_a_failure_carries_it(gate):
    name, event = gate
    with ai.Worker(_gated_chain(name, 6, fail=True)) as worker:
        execution = worker.schedule(np.ones(2, np.float32))
        pending = execution.layer_future("add2")
        event.set()
        assert _done_within(worker.peek_output())
        for layer in ("add_f", "add1", "add2", "add3"):  # made now, or before the failure came
            future = execution.layer_future(layer)
            assert future.done() and future.failed(), layer
            assert "broken" in str(future.exception())
        assert pending.failed()


def test_layer_futures_asked_for_while_runs_go_on_all_complete_with_their_layer(add_chain_model):
    """Futures made on demand race with the job completing their layer: each must complete (none
    lost to the race, none completed twice with different values) and outputs stay right."""
    model = ai.load_model(add_chain_model(40), optimize=False)
    names = [layer.name for layer in model.layers]
    with ai.Worker(model, threads=2) as worker:
        for _ in range(30):
            execution = worker.schedule(np.zeros((1, 4), np.float32))
            futures = [execution.layer_future(n) for n in reversed(names)]  # while the job runs
            assert all(f.wait(10) and not f.failed() for f in futures)
            np.testing.assert_array_equal(execution.read_outputs_blocking()["y"], np.full((1, 4), 40))
            assert len({id(execution.layer_future(n)) for n in names}) == len(names)


def test_a_branch_leaving_a_segment_runs_while_the_segment_is_still_busy(gate):
    """x → Relu → Gate → Neg → y (a path: one segment); Relu → Abs → z branches off it. The branch
    must not wait for the blocked rest of the segment."""
    name, event = gate
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Gate", ["r"], ["g"], domain=TEST_DOMAIN, gate=name, name="gate"),
             helper.make_node("Neg", ["g"], ["y"], name="neg"),
             helper.make_node("Abs", ["r"], ["z"], name="branch")]
    model = ai.load_model(make_model(nodes, [tensor_info("x", [2])], [tensor_info("y", [2]), tensor_info("z", [2])]))
    with ai.Worker(model, threads=2) as worker:
        assert [[n.layer.name for n in s.nodes] for s in worker._plan.segments][0] == ["relu", "gate", "neg"]
        execution = worker.schedule(np.array([-1, 2], np.float32))
        branch = execution.layer_future("branch")
        assert branch.wait(10), "the branch waited for the gated segment"
        assert not execution.layer_future("neg").done()
        event.set()
        np.testing.assert_array_equal(execution.take_output("y").readback_and_clone().numpy(), [0, -2])


def test_gemm_layers_join_segments_unless_they_take_turns_in_the_lane(digits_model, digits_samples, monkeypatch):
    """BLAS single-threaded (the default): the digits CNN's path, convs and Gemms included, is one
    job. With BLAS kept multi-threaded the GEMM-based layers take turns in the backend's lane, so
    each stays a dispatch of its own; both plans compute the same."""
    x = digits_samples[0][:4]
    with ai.Worker(digits_model, threads=2) as worker:
        assert [len(s.nodes) for s in worker._plan.segments] == [len(worker._plan.nodes)]
        want = worker.run_blocking(x)
    from asyncinfer.backends.cpu import blas

    # as if ASYNCINFER_BLAS_THREADS kept BLAS multi-threaded (the env var alone only counts for the
    # first CPU backend of the process)
    monkeypatch.setattr(blas, "acquire", lambda: False)
    monkeypatch.setattr(blas, "release", lambda: None)
    with ai.Worker(digits_model, threads=2) as worker:
        alone = [s.nodes[0].layer.op_type for s in worker._plan.segments if len(s.nodes) == 1]
        assert {"Conv", "Gemm"} <= set(alone)
        assert all(n.layer.op_type not in ("Conv", "Gemm") for s in worker._plan.segments if len(s.nodes) > 1
                   for n in s.nodes)
        got = worker.run_blocking(x)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
