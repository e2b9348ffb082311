"""Serial or parallel runs (asyncinfer/runtime/tuning.py): the tuner alternates the two, times
only runs that ran alone, and keeps serial runs when they are clearly faster; a worker's runs
give the same results either way, every layer still completing its own future."""
from __future__ import annotations

import numpy as np
import pytest

import asyncinfer as ai
from asyncinfer.runtime import tuning
from asyncinfer.runtime.tuning import MARGIN, SAMPLES, SKIPPED, RunModeTuner
from pixel_testing import require_pixel


def _branching_model() -> ai.Model:
    """Two branches of one input joined again: a plan of several segments, whose runs are tuned
    (the digits CNN is one path)."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["x"], ["b"]),
             helper.make_node("Sigmoid", ["b"], ["c"]), helper.make_node("Add", ["a", "c"], ["y"])]
    graph = helper.make_graph(nodes, "branches", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])])
    return ai.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())


def _timed(tuner: RunModeTuner, seconds: dict[bool, float], ok: bool = True) -> bool:
    trial = tuner.begin()
    tuner.end(trial, seconds[trial.serial], ok)
    return trial.serial


@pytest.mark.parametrize("serial_s,chosen", [(0.5, "serial"), (MARGIN, "serial"), (MARGIN * 1.01, "parallel"),
                                             (2.0, "parallel")])
def test_the_tuner_alternates_then_keeps_serial_runs_unless_slower(serial_s, chosen):
    tuner = RunModeTuner()
    modes = [_timed(tuner, {True: serial_s, False: 1.0}) for _ in range(SKIPPED + 2 * SAMPLES)]
    assert modes[SKIPPED:] == [False, True] * SAMPLES  # parallel first, then in turn
    assert tuner.mode == chosen and not tuner.deciding
    assert tuner.timings() == {"serial": [serial_s] * SAMPLES, "parallel": [1.0] * SAMPLES}
    assert {_timed(tuner, {True: 9.0, False: 9.0}) for _ in range(4)} == {chosen == "serial"}  # chosen for good


def test_the_tuner_compares_each_modes_fastest_run_so_bursts_of_noise_do_not_decide():
    """Three of five serial runs slowed by a burst on a shared machine (SqueezeNet: 9-11 ms against
    5.5, parallel runs 8.5-9) do not make parallel runs the choice: noise only adds time."""
    tuner = RunModeTuner()
    times = {True: [0.55, 1.1, 0.55, 1.05, 1.0], False: [0.9, 0.85, 0.9, 0.88, 0.9]}  # (medians 1.0, 0.9)
    while tuner.deciding:
        trial = tuner.begin()
        timed = tuner._skipped >= SKIPPED
        tuner.end(trial, times[trial.serial].pop(0) if timed else 1.0, True)
    assert tuner.timings() == {"serial": [0.55, 1.1, 0.55, 1.05, 1.0], "parallel": [0.9, 0.85, 0.9, 0.88, 0.9]}
    assert tuner.mode == "serial"


def test_runs_that_overlap_or_fail_are_not_timed():
    tuner = RunModeTuner()
    for _ in range(SKIPPED):
        _timed(tuner, {True: 1.0, False: 1.0})
    first = tuner.begin()
    second = tuner.begin()  # begins while the first is in flight: not timed, parallel
    assert second == tuning.Trial(False)
    tuner.end(second, 1.0, True)
    tuner.end(first, 1.0, True)  # another run began meanwhile: its time is spoiled too
    lone = tuner.begin()
    tuner.begin(timed=False)  # an untimed run (schedule()) begins meanwhile
    tuner.end(lone, 1.0, True)
    _timed(tuner, {True: 1.0, False: 1.0}, ok=False)  # a failed run
    assert tuner.timings() == {"serial": [], "parallel": []} and tuner.deciding


def test_a_timed_block_reports_its_time_and_whether_it_raised():
    tuner = RunModeTuner()
    for _ in range(SKIPPED):
        with tuner.timed():
            pass
    with pytest.raises(RuntimeError), tuner.timed():
        raise RuntimeError("the run failed")
    with tuner.timed() as trial:
        assert trial.start is not None and not trial.serial
    assert tuner.timings()["serial"] == [] and len(tuner.timings()["parallel"]) == 1
    assert tuner.begin() == tuning.Trial(True, tuner._started)  # nothing left in flight: timed


def test_runs_after_the_choice_take_the_chosen_trial_and_count_nothing():
    """Once chosen, `begin` hands every run one shared trial and `end` ignores it (no lock on the
    hot path); a run begun while deciding and ending after the choice is still counted out."""
    tuner = RunModeTuner()
    for _ in range(SKIPPED):
        _timed(tuner, {True: 1.0, False: 1.0})
    straggler = tuner.begin()  # in flight across the choice (timed: it began alone)
    assert straggler.start is not None
    tuner.end(straggler, 1.0, True)
    while tuner.deciding:
        _timed(tuner, {True: 0.5, False: 1.0})
    late = tuner.begin()
    assert late is tuner.begin() and late == tuning.Trial(True)  # one shared, untimed trial
    in_flight = tuner._in_flight
    tuner.end(late, 9.0, True)
    assert tuner._in_flight == in_flight and tuner.timings()["serial"] == [0.5] * SAMPLES
    fixed = RunModeTuner("parallel")
    assert fixed.begin() is fixed.begin() == tuning.Trial(False)


def test_a_run_begun_while_deciding_is_counted_out_after_the_choice():
    tuner = RunModeTuner()
    for _ in range(SKIPPED):
        _timed(tuner, {True: 1.0, False: 1.0})
    early = tuner.begin()
    tuner._chosen = True  # (the choice made meanwhile by another thread)
    tuner._chosen_trial = tuning.Trial(True)
    assert tuner._in_flight == 1
    tuner.end(early, 1.0, True)
    assert tuner._in_flight == 0


def test_a_fixed_mode_is_never_tuned():
    serial, parallel = RunModeTuner("serial"), RunModeTuner("parallel")
    assert {_timed(serial, {True: 9.0, False: 1.0}) for _ in range(20)} == {True}
    assert {_timed(parallel, {True: 0.1, False: 1.0}) for _ in range(20)} == {False}
    assert serial.mode == "serial" and parallel.mode == "parallel"
    with pytest.raises(ValueError, match="run mode must be one of"):
        RunModeTuner("fastest")


@pytest.mark.parametrize("value,expected", [("serial", "serial"), (" Parallel ", "parallel"), ("", "auto"),
                                            ("bogus", "auto")])
def test_the_run_mode_comes_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("ASYNCINFER_RUN_MODE", value)
    assert tuning.mode_requested() == expected


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["serial", "parallel"])
async def test_serial_and_parallel_runs_give_the_same_results_and_layer_futures(monkeypatch, digits_model,
                                                                               digits_samples, mode):
    images = digits_samples[0][:3]
    monkeypatch.setenv("ASYNCINFER_RUN_MODE", "parallel")
    with ai.Worker(digits_model, "cpu") as reference:
        want = reference.run_blocking(images)
    monkeypatch.setenv("ASYNCINFER_RUN_MODE", mode)
    async with ai.Worker(digits_model, "cpu") as worker:
        execution = worker.schedule(images)
        assert execution.serial is (mode == "serial")
        await execution.read_outputs()
        for layer in digits_model.layers:  # every layer's own future, done
            assert execution.layer_future(layer.name).done()
        for got in (await worker.run(images), worker.run_blocking(images)):
            for name, value in want.items():
                np.testing.assert_array_equal(got[name], value)


def test_warmup_leaves_a_cpu_worker_decided():
    with ai.Worker(_branching_model(), "cpu") as worker:
        assert worker._run_mode.deciding
        worker.warmup_blocking()
        assert worker._run_mode.mode in ("serial", "parallel")


def test_a_model_of_one_path_runs_serial_untuned(monkeypatch, digits_model, digits_samples):
    """The digits CNN is one path (one segment): nothing to start side by side, so its runs are
    serial from the first and `warmup()` runs it once; a fixed mode is still obeyed."""
    monkeypatch.delenv("ASYNCINFER_RUN_MODE", raising=False)
    with ai.Worker(digits_model, "cpu") as worker:
        assert len(worker._plan.segments) == 1
        assert worker._run_mode.mode == "serial"
        assert worker.schedule(digits_samples[0][:2]).serial
        with worker.profile() as profile:
            worker.warmup_blocking()
        assert len(profile.runs) == 1
    monkeypatch.setenv("ASYNCINFER_RUN_MODE", "parallel")
    with ai.Worker(digits_model, "cpu") as worker:
        assert worker._run_mode.mode == "parallel"
    with ai.Worker(_branching_model(), "cpu") as worker:  # (and a model of branches is tuned)
        assert len(worker._plan.segments) > 1


def test_settle_chooses_from_the_timings_so_far_once_each_mode_has_one():
    tuner = RunModeTuner()
    for _ in range(SKIPPED):
        _timed(tuner, {True: 1.0, False: 1.0})
    assert not tuner.settle() and tuner.deciding  # no timing yet
    _timed(tuner, {True: 0.7, False: 1.0})  # parallel first
    assert not tuner.settle() and tuner.deciding  # serial runs not timed yet
    _timed(tuner, {True: 0.7, False: 1.0})
    assert tuner.settle() and tuner.mode == "serial"
    slower = RunModeTuner()
    for _ in range(SKIPPED + 2):
        _timed(slower, {True: MARGIN * 1.5, False: 1.0})
    assert slower.settle() and slower.mode == "parallel"
    assert RunModeTuner("parallel").settle()  # a fixed mode is settled from the start


def test_warmup_that_runs_out_of_time_still_leaves_the_worker_decided(monkeypatch):
    """A model whose runs are too slow for `SAMPLES` of each within `WARMUP_TUNING_S` (here: the
    samples wanted raised out of reach) gets its mode from the runs warmup timed, so the requests
    after it do not alternate."""
    from asyncinfer.runtime import worker as worker_module

    monkeypatch.setattr(tuning, "SAMPLES", 10**6)
    monkeypatch.setattr(worker_module, "WARMUP_TUNING_S", 0.05)
    with ai.Worker(_branching_model(), "cpu") as worker:
        worker.warmup_blocking()
        timings = worker._run_mode.timings()
        assert worker._run_mode.mode in ("serial", "parallel")
        assert timings["serial"] and timings["parallel"]


def test_a_device_worker_runs_in_parallel_untuned(digits_model):
    require_pixel()
    with ai.Worker(digits_model, "gpu_pixel") as worker:
        assert worker._run_mode.mode == "parallel"
        worker.warmup_blocking()
        assert not worker.schedule(np.zeros((1, 1, 8, 8), np.float32)).serial


# -- quick runs on the loop's thread ------------------------------------------------------------------
KEY = (None, (("x", (1, 4), np.dtype(np.float32)),))


def test_a_signature_tries_the_loop_thread_after_a_quick_enough_run_on_the_pool():
    quick = tuning.QuickRuns(limit=1e-3)
    assert not quick.here(KEY) and quick.settled()
    quick.ran(KEY, False, 0.003)  # hand-offs included, still too slow to try
    assert not quick.here(KEY) and quick.settled()
    quick.ran(KEY, False, 0.0015)  # within twice the limit: the next run tries
    assert quick.here(KEY) and not quick.settled()
    quick.ran(KEY, True, 0.0004)
    assert quick.here(KEY) and quick.settled()
    assert not quick.here(None) and not tuning.QuickRuns(limit=0).here(KEY)


def test_a_slow_run_on_the_loop_thread_backs_off_longer_each_miss_in_a_row():
    quick = tuning.QuickRuns(limit=1e-3)
    quick.ran(KEY, False, 0.0005)
    for miss in range(1, 4):
        assert quick.here(KEY)
        quick.ran(KEY, True, 0.0011)  # over the limit: back to the pool
        waits = 0
        while not quick.here(KEY):
            quick.ran(KEY, False, 0.0005)
            waits += 1
        assert waits == tuning.BACKOFF_RUNS << (miss - 1)
    quick.ran(KEY, True, 0.0009)  # a quick run there forgives the misses
    quick.ran(KEY, True, 0.0021)  # over twice the limit: back at once
    waits = 0
    while not quick.here(KEY):
        quick.ran(KEY, False, 0.0005)
        waits += 1
    assert waits == tuning.BACKOFF_RUNS


def test_a_confirmed_signature_stays_through_a_few_slow_runs():
    quick = tuning.QuickRuns(limit=1e-3)
    quick.ran(KEY, False, 0.0005)
    quick.ran(KEY, True, 0.0005)  # confirmed
    for _ in range(3):
        for _ in range(tuning.SLOW_RUNS - 1):
            quick.ran(KEY, True, 0.0015)  # over the limit, within twice it: stays
            assert quick.here(KEY)
        quick.ran(KEY, True, 0.0008)  # (a quick one in between starts the count again)
    for _ in range(tuning.SLOW_RUNS):
        quick.ran(KEY, True, 0.0015)
    assert not quick.here(KEY)


def test_quick_signatures_are_bounded():
    quick = tuning.QuickRuns(limit=1e-3)
    for i in range(tuning.MAX_QUICK_SIGNATURES + 5):
        quick.ran((None, i), False, 0.0005)
    assert len(quick._states) == tuning.MAX_QUICK_SIGNATURES and quick.here((None, 5 + tuning.MAX_QUICK_SIGNATURES - 1))
    assert not quick.here((None, 0))  # the oldest, forgotten


@pytest.mark.parametrize("value,limit", [("", tuning.QUICK_RUN_S), ("250", 250e-6), ("0", 0.0), ("x", tuning.QUICK_RUN_S)])
def test_the_quick_run_limit_comes_from_the_environment(monkeypatch, value, limit):
    monkeypatch.setenv("ASYNCINFER_QUICK_RUN_US", value)
    assert tuning.quick_run_limit() == pytest.approx(limit)


def _run_threads(profile: ai.Profile) -> set[str]:
    return {record.thread_name for record in profile.records}


@pytest.mark.anyio
@pytest.mark.parametrize("limit_us,on_loop", [("100000", True), ("0", False)])
async def test_a_quick_model_runs_on_the_loop_thread_after_warmup(monkeypatch, digits_model, digits_samples,
                                                                  limit_us, on_loop):
    import threading

    monkeypatch.setenv("ASYNCINFER_QUICK_RUN_US", limit_us)
    images = digits_samples[0][:2]
    with ai.Worker(digits_model, "cpu") as reference:
        want = reference.run_blocking(images)
    async with ai.Worker(digits_model, "cpu") as worker:
        await worker.warmup(images)
        assert worker._quick_runs.settled()
        profile = ai.Profile()
        got = await worker.run(images, profile=profile)
        loop_thread = threading.current_thread().name
        assert (_run_threads(profile) == {loop_thread}) is on_loop
        for name, value in want.items():
            np.testing.assert_array_equal(got[name], value)


@pytest.mark.anyio
async def test_quick_runs_let_the_loops_other_tasks_run_and_fail_like_any_run(monkeypatch, digits_model,
                                                                               digits_samples):
    import anyio

    monkeypatch.setenv("ASYNCINFER_QUICK_RUN_US", "100000")
    images = digits_samples[0][:1]
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with ai.Worker(digits_model, "cpu") as worker:
        await worker.warmup(images)
        async with anyio.create_task_group() as group:
            group.start_soon(ticker)
            for _ in range(20):  # each run yields to the loop once, though none waits for a thread
                await worker.run(images)
            group.cancel_scope.cancel()
        assert ticks >= 19
        with pytest.raises(ai.InputError):
            await worker.run(images[:, :, :4])  # a wrong shape: refused before anything runs
        np.testing.assert_array_equal((await worker.run(images))[worker.model.outputs[0].name],
                                      worker.run_blocking(images)[worker.model.outputs[0].name])
