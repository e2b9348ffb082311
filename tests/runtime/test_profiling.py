"""Profiling: per-step records of real models, their Chrome/Perfetto trace, the per-op summary,
and what profiling costs when it is off (nothing attached to the run)."""
from __future__ import annotations

import json
from collections import Counter
from numbers import Number

import anyio
import numpy as np
import pytest
from onnx import helper

import asyncinfer as ai
from asyncinfer.ops.base import Op
from asyncinfer.ops.registry import register
from asyncinfer.runtime.execution import _SegmentJob, _StepDone
from conftest import TEST_DOMAIN, make_model, tensor_info
from model_zoo import light_input, light_path

#: Which entry each `PathTagged` layer was computed through, in order.
PATHS_TAKEN: list[str] = []


@register("PathTagged", versions=(1,), domain=TEST_DOMAIN)
class PathTagged(Op):
    """x + 1, noting whether the op's general ``run`` or its `bound_run` computed it."""

    def run(self, x):
        PATHS_TAKEN.append("run")
        return x + 1

    def bound_run(self):
        def outputs(args):
            PATHS_TAKEN.append("bound")
            return [args[0] + 1]
        return outputs


def validate_trace(trace: dict) -> list[dict]:
    """Check ``trace`` against the Chrome Trace Event Format as Perfetto reads it (required keys and
    their types per phase, ts ordered and slices disjoint on every thread track, every async begin
    ended, every track named); returns the complete ("X") events."""
    assert set(trace) >= {"traceEvents"} and isinstance(trace["traceEvents"], list)
    json.loads(json.dumps(trace))  # plain JSON types only
    slices, named, opened = [], set(), {}
    last_on_track: dict[tuple[int, int], tuple[float, float]] = {}
    for event in trace["traceEvents"]:
        ph = event["ph"]
        assert isinstance(event["name"], str) and isinstance(event["pid"], int), event
        if ph == "M":
            assert event["name"] in {"process_name", "thread_name", "thread_sort_index"}, event
            assert isinstance(event["tid"], int) and isinstance(event["args"], dict), event
            if event["name"] == "thread_name":
                assert isinstance(event["args"]["name"], str) and event["args"]["name"]
                named.add((event["pid"], event["tid"]))
        elif ph == "X":
            for key, kind in (("ts", Number), ("dur", Number), ("tid", int), ("cat", str), ("args", dict)):
                assert isinstance(event[key], kind), (key, event)
            assert event["ts"] >= 0 and event["dur"] >= 0, event
            track = (event["pid"], event["tid"])
            if track in last_on_track:
                ts, end = last_on_track[track]
                assert event["ts"] >= ts, f"ts goes back on track {track}: {event}"
                assert event["ts"] >= end - 0.002, f"slices overlap on track {track}: {event}"  # 1 ns rounding each
            last_on_track[track] = (event["ts"], event["ts"] + event["dur"])
            slices.append(event)
        elif ph in ("b", "e"):
            assert isinstance(event["cat"], str) and isinstance(event["id"], int) and isinstance(event["ts"], Number)
            key = (event["cat"], event["id"])
            if ph == "b":
                assert key not in opened, f"async slice {key} begun twice"
                opened[key] = event["ts"]
            else:
                assert key in opened and event["ts"] >= opened.pop(key), f"async slice {key} ends before it begins"
        else:
            raise AssertionError(f"unexpected phase {ph!r}: {event}")
    assert not opened, f"async slices never ended: {opened}"
    unnamed = {(e["pid"], e["tid"]) for e in slices} - named
    assert not unnamed, f"tracks without a thread_name: {unnamed}"
    return slices


def step_names(worker: ai.Worker) -> list[str]:
    """The names of every step of the worker's plan: its layers and its transfers."""
    return [node.layer.name for node in worker._plan.nodes]


def test_trace_of_the_digits_cnn_has_one_slice_per_step_per_run(digits_model, digits_samples, any_backend, tmp_path):
    images = digits_samples[0][:4]
    with ai.Worker(digits_model, any_backend) as worker, worker.profile() as profile:
        expected = worker.run_blocking(images)
        worker.run_blocking(images)
    steps = step_names(worker)
    assert set(steps) >= {layer.name for layer in digits_model.layers}
    path = profile.write_trace(tmp_path / "trace.json")
    slices = validate_trace(json.loads(path.read_text()))
    assert Counter(e["name"] for e in slices) == Counter(steps * 2)
    assert {e["args"]["run"] for e in slices} == {1, 2}
    assert {e["args"]["backend"] for e in slices} == set(worker.placement.layers.values())
    layer_kinds = {layer.name: layer.kind for layer in digits_model.layers}
    for event in slices:
        if event["cat"] == "layer":
            assert event["args"]["op_type"] == layer_kinds[event["name"]]
    runs = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "b"]
    assert len(runs) == 2 and all("digits_cnn" in r["name"] for r in runs)
    # The records behind the trace: ordered times, a thread, and each run's own steps.
    for record in profile.records:
        assert record.queued_ns <= record.start_ns <= record.end_ns and record.thread_name
    assert sorted(r.run for r in profile.records) == [1] * len(steps) + [2] * len(steps)
    uploads = [r for r in profile.records if r.kind == "upload"]
    assert all(r.nbytes == images.nbytes for r in uploads) and (any_backend != "cpu") == bool(uploads)
    # The profile changed nothing: the same outputs as an unprofiled run.
    again = ai.Worker(digits_model, any_backend)
    try:
        for name, value in again.run_blocking(images).items():
            np.testing.assert_array_equal(value, expected[name])
    finally:
        again.dispose()


def test_trace_of_a_light_zoo_model_names_every_layer():
    model = ai.load_model(light_path("squeezenet"))
    name, x = light_input(__import__("onnx").load(light_path("squeezenet"), load_external_data=False))
    with ai.Worker(model) as worker:
        profile = ai.Profile()
        worker.run_blocking({name: x}, profile=profile)
    slices = validate_trace(profile.trace())
    assert sorted(e["name"] for e in slices) == sorted(l.name for l in model.layers)
    # Independent branches (squeezenet's expand 1x1 / 3x3) may run on two threads: either way,
    # every slice is on a named track and the summary covers every step.
    totals = profile.op_totals()
    assert sum(t.count for t in totals) == len(model.layers)
    assert {t.op_type for t in totals} == {l.kind for l in model.layers}
    summary = profile.summary()
    for total in totals:
        assert total.op_type in summary
    assert f"1 run(s), {len(model.layers)} steps" in summary


def test_summary_totals_add_up(digits_model, digits_samples):
    with ai.Worker(digits_model) as worker, worker.profile() as profile:
        for _ in range(3):
            worker.run_blocking(digits_samples[0][:2])
    records = profile.records
    totals = {(t.op_type, t.backend): t for t in profile.op_totals()}
    for (op_type, backend), total in totals.items():
        mine = [r for r in records if r.op_type == op_type and r.backend == backend]
        assert total.count == len(mine) and total.total_ns == sum(r.duration_ns for r in mine)
        assert total.queue_ns == sum(r.queue_ns for r in mine)
    assert [t.total_ns for t in profile.op_totals()] == sorted((t.total_ns for t in totals.values()), reverse=True)
    assert "3 run(s)" in profile.summary()


def test_profiling_off_attaches_nothing(digits_model, digits_samples):
    images = digits_samples[0][:1]
    with ai.Worker(digits_model) as worker:
        plain = worker.schedule(images)
        assert plain._recorder is None and plain._done_type is _StepDone and plain._job_type is _SegmentJob
        with worker.profile() as profile:
            profiled = worker.schedule(images)
            assert profiled._recorder is not None and profiled._done_type is not _StepDone
        after = worker.schedule(images)
        assert after._recorder is None and after._done_type is _StepDone and worker._profiles == ()
        for execution in (plain, profiled, after):
            execution.read_outputs_blocking()
    assert {r.run for r in profile.records} == {1}  # only the run scheduled inside the block


@pytest.mark.anyio
async def test_per_run_profile_records_only_that_run_among_concurrent_ones(digits_model, digits_samples):
    images = digits_samples[0][:2]
    profile, outer = ai.Profile(), ai.Profile()
    async with ai.Worker(digits_model) as worker:
        async with worker.profile(outer) as attached:
            assert attached is outer
            results: list[dict] = [{}, {}, {}]

            async def one(i: int) -> None:
                results[i] = await worker.run(images, profile=profile if i == 1 else None)

            async with anyio.create_task_group() as group:
                for i in range(3):
                    group.start_soon(one, i)
    for result in results[1:]:
        np.testing.assert_array_equal(result["probabilities"], results[0]["probabilities"])
    assert Counter(r.layer for r in profile.records) == Counter(step_names(worker))
    assert {r.run for r in profile.records} == {1} and len(profile.runs) == 1
    assert {r.run for r in outer.records} == {1, 2, 3}  # the block saw all three, the per-run one too


def test_one_profile_collects_two_workers_and_nested_blocks(digits_model, digits_samples, add_chain_model):
    chain = ai.load_model(add_chain_model(3), optimize=False)
    profile = ai.Profile()
    with ai.Worker(digits_model) as digits, ai.Worker(chain) as adds:
        with digits.profile(profile), adds.profile(profile), adds.profile() as inner:
            digits.run_blocking(digits_samples[0][:1])
            adds.run_blocking(np.zeros((1, 4), np.float32))
    assert [r.model for r in profile.runs] == ["digits_cnn", "test_graph"]
    assert len(inner.runs) == 1 and len(inner.records) == 3
    slices = validate_trace(profile.trace())
    assert Counter(e["args"]["run"] for e in slices) == {1: len(digits_model.layers), 2: 3}


def test_a_profiled_run_times_the_same_kernels_as_an_unprofiled_one():
    """A job's layers run through their op's `bound_run`, profiled or not: profiling the general
    path instead made small layers look several times slower than they run (a reflect Pad 14-17
    µs against 1.6)."""
    nodes = [helper.make_node("PathTagged", [x], [y], name=f"l_{y}", domain=TEST_DOMAIN)
             for x, y in (("x", "a"), ("a", "b"), ("b", "y"))]
    model = make_model(nodes, [tensor_info("x", [4])], [tensor_info("y", [4])])
    with ai.Worker(ai.load_model(model), "cpu") as worker:
        worker.warmup_blocking(np.zeros(4, np.float32))
        PATHS_TAKEN.clear()
        plain = worker.run_blocking(np.zeros(4, np.float32))["y"]
        unprofiled = list(PATHS_TAKEN)
        PATHS_TAKEN.clear()
        profile = ai.Profile()
        profiled = worker.run_blocking(np.zeros(4, np.float32), profile=profile)["y"]
    assert unprofiled == ["bound"] * 3, unprofiled  # (the premise: the three run as one job)
    assert PATHS_TAKEN == unprofiled
    np.testing.assert_array_equal(profiled, plain)
    np.testing.assert_array_equal(plain, np.full(4, 3, np.float32))
    assert sorted(r.layer for r in profile.records) == ["l_a", "l_b", "l_y"]
    assert all(r.duration_ns >= 0 and not r.failed for r in profile.records)


def test_a_failed_layer_is_a_failed_slice(failing_model):
    with ai.Worker(failing_model) as worker, worker.profile() as profile:
        with pytest.raises(ai.ExecutionError):
            worker.run_blocking(np.zeros(2, np.float32))
        worker.schedule(np.zeros(2, np.float32)).wait_blocking(30)
    by_layer = {}
    for record in profile.records:
        by_layer.setdefault(record.layer, []).append(record)
    assert all(r.failed for r in by_layer["broken_layer"]) and len(by_layer["broken_layer"]) == 2
    assert "after_failure" not in by_layer  # never ran: no slice
    assert not any(r.failed for r in by_layer["independent"])
    failed = [e for e in validate_trace(profile.trace()) if e["args"].get("failed")]
    assert [e["name"] for e in failed] == ["broken_layer", "broken_layer"]


def test_profile_type_is_checked_and_clear_restarts(digits_model, digits_samples):
    with ai.Worker(digits_model) as worker:
        with pytest.raises(TypeError, match="Profile"):
            worker.schedule(digits_samples[0][:1], profile="trace.json")
        profile = ai.Profile()
        worker.run_blocking(digits_samples[0][:1], profile=profile)
        profile.clear()
        assert profile.records == [] and profile.runs == [] and "0 run(s)" in profile.summary()
        worker.run_blocking(digits_samples[0][:1], profile=profile)
        assert [r.run for r in profile.runs] == [2]  # numbers are never reused
    with pytest.raises(ai.DisposedError):
        worker.profile()
