"""The spinning helpers of compiled parts (`concurrency.spin_team`), as the few-row GEMM uses them:
parts run and are waited for, a busy or closed team declines, idle helpers sleep and wake."""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from asyncinfer.concurrency import parallel, placement, spin_team
from asyncinfer.concurrency.spin_team import SpinTeam
from asyncinfer.ops import linalg
from asyncinfer.ops.compiled.few_rows import PART_KIND, few_rows_matmul, post_arguments
from asyncinfer.ops.compiled.panels import no_panels, pack_panels
from asyncinfer.ops.compiled import team_parts
from asyncinfer.ops.compiled.team_parts import prepare_part, serve_parts


_NONE = no_panels(np.float32)


def _operands(m: int, k: int, n: int, dtype=np.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)


@pytest.fixture
def team():
    team = SpinTeam(2, serve_parts, prepare_part, name="test-team")
    yield team
    team.close()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_parts_posted_to_helpers_equal_the_kernel(team, dtype, packed):
    """A posted part runs the kernel the caller would, b packed in panels (passed by address and
    panel count) or not."""
    a, b = _operands(5, 90, 70, dtype)
    panels = pack_panels(b) if packed else no_panels(dtype)
    bounds = [0, 28, 60, 90]
    parts = [np.empty((5, 70), dtype) for _ in range(3)]
    ran_own = team.try_run([post_arguments(a, b, parts[i], bounds[i], bounds[i + 1], 32, panels) for i in (1, 2)],
                           lambda: few_rows_matmul(a, b, parts[0], bounds[0], bounds[1], 32, panels))
    assert ran_own
    for i in range(3):
        expected = np.empty((5, 70), dtype)
        few_rows_matmul(a, b, expected, bounds[i], bounds[i + 1], 32, no_panels(dtype))
        np.testing.assert_array_equal(parts[i], expected)


def test_a_kind_is_prepared_once_before_its_first_part_is_posted():
    """The helpers run a kind of part through a runner compiled for that kind alone
    (`team_parts.prepare_part`, so that a model compiles only the kinds it runs): the team asks for
    it before the first part of the kind is posted, and never again."""
    prepared = []

    def prepare(kind: int) -> None:
        prepared.append(kind)
        prepare_part(kind)

    team = SpinTeam(1, serve_parts, prepare, name="test-team")
    try:
        a, b = _operands(3, 40, 20)
        for _ in range(2):
            part, own = np.empty((3, 20), np.float32), np.empty((3, 20), np.float32)
            assert team.try_run([post_arguments(a, b, part, 20, 40, 32, no_panels(np.float32))],
                                lambda: few_rows_matmul(a, b, own, 0, 20, 32, no_panels(np.float32)))
            expected = np.empty((3, 20), np.float32)
            few_rows_matmul(a, b, expected, 20, 40, 32, no_panels(np.float32))
            np.testing.assert_array_equal(part, expected)
        assert prepared == [PART_KIND]
        assert team_parts.RUNNERS[PART_KIND] != 0
    finally:
        team.close()


def test_every_part_kind_has_a_runner():
    """Each kind a kernel posts (a module's `PART_KIND`, a pool loop's own) has a runner to
    compile: a kind without one would fail at its first `parallel.team(kind)`."""
    from asyncinfer.ops.compiled import (attention, blas_call, conv_blocks, depthwise_parts, direct, direct_panels,
                                         expand_depthwise, few_rows, gemm, normalization, one_pass, pointwise, pool,
                                         squeeze_excite, winograd_bands)

    kinds = {attention.PART_KIND, attention.PRODUCTS_PART_KIND, blas_call.PART_KIND, conv_blocks.PART_KIND,
             depthwise_parts.PART_KIND, direct.PART_KIND, direct_panels.PART_KIND, expand_depthwise.PART_KIND,
             few_rows.PART_KIND, gemm.PART_KIND, normalization.ROWS_PART_KIND, one_pass.ADD_PART_KIND,
             one_pass.AFFINE_PART_KIND, one_pass.ACTIVATE_PART_KIND, pointwise.PART_KIND,
             pointwise.SMALL_MAP_PART_KIND, squeeze_excite.PART_KIND, winograd_bands.PART_KIND}
    kinds |= {pool.FIRST_PART_KIND + loop for loop in range(len(pool.LOOP_RANGES))}
    assert len(kinds) == 18 + len(pool.LOOP_RANGES), "two kernels post the same kind"
    assert kinds == set(team_parts._RUNNER_SOURCES)
    assert len(team_parts.RUNNERS) == max(kinds) + 1


def test_a_busy_team_declines_and_runs_nothing(team):
    a, b = _operands(2, 16, 16)
    y = np.zeros((2, 16), np.float32)
    declined = []

    def own():  # while this caller holds the team, another one is turned away
        other = threading.Thread(target=lambda: declined.append(
            team.try_run([post_arguments(a, b, y, 0, 16, 16, _NONE)], lambda: None)))
        other.start()
        other.join()

    assert team.try_run([], own)
    assert declined == [False] and not y.any()
    assert not team.try_run([[0] * 10] * 3, lambda: None)  # more parts than helpers


def test_idle_helpers_sleep_and_a_post_wakes_them(team, monkeypatch):
    monkeypatch.setattr(spin_team, "SPIN_ROUNDS", 50)
    a, b = _operands(3, 40, 48)
    for round_ in range(3):
        y = np.empty((3, 48), np.float32)
        assert team.try_run([post_arguments(a, b, y, 0, 40, 16, _NONE)], lambda: None)
        expected = np.empty((3, 48), np.float32)
        few_rows_matmul(a, b, expected, 0, 40, 16, _NONE)
        np.testing.assert_array_equal(y, expected)
        deadline = time.monotonic() + 5
        while not team._sleeping[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert team._sleeping[0], "an idle helper should have gone to sleep"


def test_an_error_in_the_callers_part_still_waits_for_the_helpers(team):
    a, b = _operands(2, 64, 64)
    y = np.empty((2, 64), np.float32)

    def own():
        raise ValueError("own part failed")

    with pytest.raises(ValueError, match="own part failed"):
        team.try_run([post_arguments(a, b, y, 0, 64, 64, _NONE)], own)
    expected = np.empty((2, 64), np.float32)
    few_rows_matmul(a, b, expected, 0, 64, 64, _NONE)
    np.testing.assert_array_equal(y, expected)  # the helper's part had ended before the error left
    assert team.try_run([], lambda: None)  # and the team is free again


def test_a_closed_team_declines_and_its_threads_end():
    team = SpinTeam(1, serve_parts, prepare_part, name="test-team")
    assert team.try_run([[PART_KIND, 1, 0, 0, 0, 0, 16, 0, 0, 0, 0]], lambda: None)  # an empty part: k0 = k1 = 0
    threads = list(team._threads)
    team.close()
    assert all(not t.is_alive() for t in threads)
    assert not team.try_run([], lambda: None)


def _matmul_with_and_without(team: SpinTeam, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``linalg.matmul(a, b)`` on a thread bound to a 2-wide pool with ``team``, then without it."""
    with ThreadPoolExecutor(1) as pool:
        with parallel.pool_bound(pool.submit, 2, team):
            with_team = linalg.matmul(a, b)
        with parallel.pool_bound(pool.submit, 2):
            without = linalg.matmul(a, b)
    return with_team, without


@pytest.mark.parametrize("m", [1, 8])
def test_linalg_hands_split_gemvs_to_the_team_with_the_bits_of_run_parts(m, monkeypatch):
    monkeypatch.setattr(linalg, "SPLIT_MIN_B_BYTES", 0)
    monkeypatch.setattr(linalg, "FEW_ROWS_MIN_B_BYTES", 0)
    a, b = _operands(m, 200, 300, seed=m)
    team = SpinTeam(1, serve_parts, prepare_part, name="test-team")
    claims = []
    real = team.claim
    monkeypatch.setattr(team, "claim", lambda: (claims.append(1), real())[1])
    try:
        by_team, by_pool = _matmul_with_and_without(team, a, b)
    finally:
        team.close()
    assert claims == [1]
    np.testing.assert_array_equal(by_team, by_pool)
    np.testing.assert_allclose(by_team, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def test_with_the_team_busy_the_same_parts_run_in_turn_with_the_same_bits(monkeypatch):
    """Another lane holding the team means every core is busy: the GEMM runs its parts on this
    thread, one after another, and its result has the bits of the split one."""
    monkeypatch.setattr(linalg, "SPLIT_MIN_B_BYTES", 0)
    monkeypatch.setattr(linalg, "FEW_ROWS_MIN_B_BYTES", 0)
    a, b = _operands(3, 200, 300, seed=5)
    team = SpinTeam(1, serve_parts, prepare_part, name="test-team")
    holding, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=lambda: team.try_run([], lambda: (holding.set(), release.wait(10))))
    holder.start()
    try:
        assert holding.wait(10)
        while_busy, by_pool = _matmul_with_and_without(team, a, b)
    finally:
        release.set()
        holder.join()
        team.close()
    np.testing.assert_array_equal(while_busy, by_pool)


def test_a_part_posted_before_a_new_helper_first_looks_is_still_run(monkeypatch):
    """The first post races the helper thread's start: the helper must count from the sequence
    number before the post, never from one it reads after it (that would strand the caller)."""
    started = threading.Event()
    real_loop = SpinTeam._loop

    def slow_start(self, index, seen):  # the helper reaches its loop only after the post
        started.wait(5)
        return real_loop(self, index, seen)

    monkeypatch.setattr(SpinTeam, "_loop", slow_start)
    team = SpinTeam(1, serve_parts, prepare_part, name="test-team")
    a, b = _operands(2, 32, 32)
    y = np.empty((2, 32), np.float32)
    try:
        assert team.try_run([post_arguments(a, b, y, 0, 32, 32, _NONE)], started.set)
    finally:
        team.close()
    expected = np.empty((2, 32), np.float32)
    few_rows_matmul(a, b, expected, 0, 32, 32, _NONE)
    np.testing.assert_array_equal(y, expected)


def test_linalg_wakes_helpers_that_fell_asleep_and_adds_the_bias_last(monkeypatch):
    """The compiled caller sees a sleeping helper after its post and wakes it (b's panels posted
    too); the bias is added after the parts, as ``y += bias`` after the product would."""
    monkeypatch.setattr(spin_team, "SPIN_ROUNDS", 50)
    monkeypatch.setattr(linalg, "SPLIT_MIN_B_BYTES", 0)
    monkeypatch.setattr(linalg, "FEW_ROWS_MIN_B_BYTES", 0)
    a, b = _operands(2, 200, 300, seed=9)
    bias = np.random.default_rng(1).standard_normal(300).astype(np.float32)
    team = SpinTeam(1, serve_parts, prepare_part, name="test-team")
    try:
        with ThreadPoolExecutor(1) as pool, parallel.pool_bound(pool.submit, 2, team):
            first = linalg._few_rows(a, b, None, pack_panels(b))
            deadline = time.monotonic() + 5
            while not team._sleeping[0] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert team._sleeping[0], "an idle helper should have gone to sleep"
            woken = linalg._few_rows(a, b, bias, pack_panels(b))
    finally:
        team.close()
    expected = first.copy()
    expected += bias
    np.testing.assert_array_equal(woken, expected)
    np.testing.assert_allclose(first, a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def test_a_crowded_pool_offers_no_team():
    """`parallel.team(PART_KIND)` is the bound team only while ``crowded()`` is false."""
    team = SpinTeam(1, serve_parts, prepare_part, name="test-team")
    crowded = [False]
    try:
        with parallel.pool_bound(None, 2, team, lambda: crowded[0]):
            assert parallel.team(PART_KIND) is team
            crowded[0] = True
            assert parallel.team(PART_KIND) is None
        assert parallel.team(PART_KIND) is None  # unbound again
    finally:
        team.close()


@pytest.fixture
def backend_with_team():
    """A 2-thread CPU backend keeping a spin team (closed after the test)."""
    from asyncinfer.backends.cpu.backend import CPUBackend

    backend = CPUBackend(threads=2)
    try:
        if backend._team is None:
            pytest.skip("BLAS is not pinned to one thread here (ASYNCINFER_BLAS_THREADS or no threadpoolctl): "
                        "the backend keeps no team")
        yield backend
    finally:
        backend.close()


def test_kernels_leave_the_team_alone_while_another_pool_thread_works(backend_with_team):
    """On a CPU backend's pool, work running alone sees the team; two pieces of work at the same
    time (concurrent requests) see none: each has a core, which a helper would only share."""
    backend = backend_with_team
    seen: list[bool] = []
    done = threading.Semaphore(0)

    class Job:
        serial = False

        def __init__(self, barrier: threading.Barrier | None):
            self.barrier = barrier

        def run(self) -> None:
            if self.barrier is not None:
                self.barrier.wait(timeout=10)
            seen.append(parallel.team(PART_KIND) is not None)
            if self.barrier is not None:
                self.barrier.wait(timeout=10)  # both looked before either leaves
            done.release()

    backend._submit(Job(None))
    assert done.acquire(timeout=10)
    together = threading.Barrier(2)
    backend._submit(Job(together))
    backend._submit(Job(together))
    assert done.acquire(timeout=10) and done.acquire(timeout=10)
    assert seen == [True, False, False]
    assert backend._working == 0


def test_work_queued_for_a_lane_keeps_kernels_off_the_team(monkeypatch):
    """Work waiting in the pool's queue is a request waiting for a core, which a helper would only
    take from it: a kernel running meanwhile sees no team, and one running alone again does."""
    from asyncinfer.backends.cpu.backend import CPUBackend

    monkeypatch.setenv("ASYNCINFER_CPU_LANES", "1")  # one lane: the second job queues behind the first
    backend = CPUBackend(threads=2)
    try:
        if backend._team is None:
            pytest.skip("BLAS is not pinned to one thread here (ASYNCINFER_BLAS_THREADS or no threadpoolctl): "
                        "the backend keeps no team")
        seen: list[bool] = []
        done = threading.Semaphore(0)

        class Job:
            serial = False

            def __init__(self, until_queued: bool):
                self.until_queued = until_queued

            def run(self) -> None:
                deadline = time.monotonic() + 10
                while self.until_queued and not backend._pool.queued and time.monotonic() < deadline:
                    time.sleep(0.001)
                seen.append(parallel.team(PART_KIND) is not None)
                done.release()

        backend._submit(Job(False))
        assert done.acquire(timeout=10)
        backend._submit(Job(True))
        backend._submit(Job(False))
        assert done.acquire(timeout=10) and done.acquire(timeout=10)
        assert seen == [True, False, True]
    finally:
        backend.close()


@pytest.mark.parametrize("run_over, hold_s, team_after", [
    (True, 60.0, False),   # a run ended beside another: the next moments stay crowded
    (True, 0.0, True),     # ... until the hold is over
    (False, 60.0, True),   # a parallel run's branch ended: no hold
])
def test_a_run_ending_beside_another_keeps_the_pool_crowded_a_while(backend_with_team, monkeypatch,
                                                                      run_over, hold_s, team_after):
    """Concurrent requests leave a moment between one lane's run and its next, when the other
    lane works alone: a kernel there that took the team would share a core with that next run.
    A serial run ending while another thread works keeps `crowded` true for `CROWDED_HOLD_S`."""
    from asyncinfer.backends.cpu import backend as cpu_backend

    monkeypatch.setattr(cpu_backend, "CROWDED_HOLD_S", hold_s)
    backend = backend_with_team
    seen: list[bool] = []
    together = threading.Barrier(2)
    first_left = threading.Event()
    done = threading.Semaphore(0)

    class Ending:
        serial = True

        def run(self) -> None:
            together.wait(timeout=10)
            backend.job_finishing(run_over)
            done.release()

    class Staying:
        serial = True

        def run(self) -> None:
            together.wait(timeout=10)
            assert first_left.wait(timeout=10)
            seen.append(parallel.team(PART_KIND) is not None)
            done.release()

    backend._submit(Ending())
    backend._submit(Staying())
    assert done.acquire(timeout=10)  # the ending one counted out ...
    deadline = time.monotonic() + 10
    while backend._working > 1 and time.monotonic() < deadline:  # ... and left its job
        time.sleep(0.001)
    first_left.set()
    assert done.acquire(timeout=10)
    assert seen == [team_after]


def test_a_job_that_is_finishing_no_longer_crowds_the_next(backend_with_team):
    """A job's thread stops counting as working once the job says it is finishing (before its last
    layer's future wakes a waiter): the next run, started meanwhile on the other lane, still gets
    the team, though the first thread has not left its job yet. (The job starts it itself: work
    that another thread submits would wait for the finishing lane, `LanePool.finishing`.)"""
    backend = backend_with_team
    seen: list[bool] = []
    finished = threading.Event()
    next_looked = threading.Event()

    class Next:
        serial = False

        def run(self) -> None:
            seen.append(parallel.team(PART_KIND) is not None)
            next_looked.set()

    class Finishing:
        serial = False

        def run(self) -> None:
            backend.job_finishing()
            backend.job_finishing()  # (twice: counted out once)
            backend._submit(Next())  # (from this thread: to the other lane)
            finished.set()
            next_looked.wait(timeout=10)  # still inside its job

    backend._submit(Finishing())
    assert finished.wait(timeout=10)
    assert next_looked.wait(timeout=10)
    backend.close()  # (waits for both jobs)
    assert seen == [True]
    assert backend._working == 0


_CORES = placement.allowed_cores()
_needs_two_cores = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(_CORES) < 2,
                                      reason="binding threads to cores needs Linux and two cores to run on")


def test_off_core_masks_leave_out_one_core_each():
    """Row ``c`` of `placement.off_core_masks` holds every allowed core but ``c``, the last row
    all of them; fewer than two cores make no masks (no moves)."""
    masks = placement.off_core_masks([0, 2, 65, 70])
    assert masks.shape == (72, placement.MASK_CORES // 64)
    assert placement.cores_of(masks[2]) == {0, 65, 70}
    assert placement.cores_of(masks[65]) == {0, 2, 70}
    assert placement.cores_of(masks[1]) == {0, 2, 65, 70}  # (a core not allowed: nothing to leave)
    assert placement.cores_of(masks[-1]) == {0, 2, 65, 70}
    assert placement.off_core_masks([3]).shape[0] == 0
    assert placement.off_core_masks([]).shape[0] == 0


def _helper_beside_the_caller(team: SpinTeam) -> tuple[set[int], np.ndarray]:
    """Bind this thread and the team's helper to one core, post a part, return the helper's cores
    after it ran and the part's result. The caller's own part sleeps, so that the helper gets the
    core and takes its part (a caller done at once would take it over: `SpinTeam.wait`)."""
    a, b = _operands(3, 64, 40)
    y = np.zeros((3, 40), np.float32)
    assert team.try_run([post_arguments(a, b, y, 0, 64, 32, _NONE)], lambda: None)  # (the helper starts)
    helper = team._threads[0].native_id
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {_CORES[0]})
        os.sched_setaffinity(helper, {_CORES[0]})
        y[:] = 0
        assert team.try_run([post_arguments(a, b, y, 0, 64, 32, _NONE)], lambda: time.sleep(0.2))
        return os.sched_getaffinity(helper), y
    finally:
        os.sched_setaffinity(0, before)


@_needs_two_cores
def test_a_helper_on_its_posters_core_moves_off_it_and_runs_the_part(monkeypatch):
    """A post from the helper's own core makes it bind itself to the other cores (the two would
    take turns on one core: `placement.py`), then run the part all the same; gone idle, it asks
    to be unbound again."""
    unbound = []
    monkeypatch.setattr(placement, "bind_all", lambda cores: unbound.append(set(cores)))
    team = SpinTeam(1, serve_parts, prepare_part, name="test-team")
    try:
        cores, y = _helper_beside_the_caller(team)
        deadline = time.monotonic() + 30
        while not unbound and time.monotonic() < deadline:  # (its spin after the part: about 1 ms)
            time.sleep(0.01)
    finally:
        team.close()
    assert cores == set(_CORES[1:])
    assert unbound == [set(_CORES)]
    a, b = _operands(3, 64, 40)
    expected = np.empty((3, 40), np.float32)
    few_rows_matmul(a, b, expected, 0, 64, 32, _NONE)
    np.testing.assert_array_equal(y, expected)


@_needs_two_cores
def test_with_pinning_off_a_helper_stays_where_it_is(monkeypatch):
    monkeypatch.setenv("ASYNCINFER_PIN_THREADS", "0")
    team = SpinTeam(1, serve_parts, prepare_part, name="test-team")
    try:
        cores, _ = _helper_beside_the_caller(team)
    finally:
        team.close()
    assert cores == {_CORES[0]}


def _stalled_team(monkeypatch, release: threading.Event, busy_here=None) -> SpinTeam:
    """A one-helper team whose helper, awake (not flagged asleep), takes no part until ``release``
    is set: what a helper the OS keeps off the cores (another process's threads) looks like."""
    real_loop = SpinTeam._loop

    def stalled(self, index, seen):
        self._serving[index] = True
        release.wait(30)
        return real_loop(self, index, seen)

    monkeypatch.setattr(SpinTeam, "_loop", stalled)
    return SpinTeam(1, serve_parts, prepare_part, name="test-team", busy_here=busy_here)


def _keep_helper_off_the_caller_s_core(team: SpinTeam) -> list[int]:
    """Start ``team``'s helper and, where there are two cores, keep the calling thread on the
    first and the helper on the others: the helper, absent, is then kept off by something else
    (here: its stall), which is what counts (`SpinTeam._take_over` first moves a helper that
    may be waiting on the caller's core). Returns the caller's cores: undo with `_free_the_caller`."""
    assert team.try_run([], lambda: None)
    cores = placement.allowed_cores()
    if len(cores) >= 2:
        os.sched_setaffinity(0, cores[:1])
        os.sched_setaffinity(team._threads[0].native_id, cores[1:])
    return cores


def _free_the_caller(cores: list[int]) -> None:
    if len(cores) >= 2:
        os.sched_setaffinity(0, cores)


def test_a_part_its_helper_does_not_start_is_run_by_the_caller(monkeypatch):
    """The caller, its own part done, takes over a part its helper has not started: the result is
    the kernel's, and the helper, arriving later, finds the part taken and leaves it alone."""
    release = threading.Event()
    team = _stalled_team(monkeypatch, release)
    a, b = _operands(3, 48, 40, seed=3)
    y = np.zeros((3, 40), np.float32)
    try:
        assert team.try_run([post_arguments(a, b, y, 0, 48, 32, _NONE)], lambda: None)
        row = team._control[0]
        seq = int(row[spin_team._POSTED])
        assert row[spin_team._DONE] == seq
        assert not spin_team.take_part(row, seq)  # what the late helper's serve loop sees
    finally:
        release.set()
        team.close()
    expected = np.empty((3, 40), np.float32)
    few_rows_matmul(a, b, expected, 0, 48, 32, _NONE)
    np.testing.assert_array_equal(y, expected)


def test_a_helper_missing_parts_again_and_again_has_the_team_decline_callers_for_a_while(monkeypatch):
    """`ABSENT_COUNT` parts taken over from an awake helper within the window: callers are
    declined (their kernels run whole) for `ABSENT_HOLD_S`, then served again."""
    monkeypatch.setattr(spin_team, "ABSENT_HOLD_S", 0.2)
    monkeypatch.setattr(spin_team, "ABSENT_WINDOW_S", 600.0)  # (a cold kernel cache compiles in between)
    release = threading.Event()
    team = _stalled_team(monkeypatch, release)
    a, b = _operands(1, 16, 16)
    y = np.zeros((1, 16), np.float32)
    cores = _keep_helper_off_the_caller_s_core(team)
    try:
        for _ in range(spin_team.ABSENT_COUNT - 1):
            assert team.try_run([post_arguments(a, b, y, 0, 16, 16, _NONE)], lambda: None)
        assert team.try_run([], lambda: None), "fewer absences than ABSENT_COUNT: still served"
        assert team.try_run([post_arguments(a, b, y, 0, 16, 16, _NONE)], lambda: None)
        assert not team.try_run([], lambda: None), "held: the caller runs its kernel whole"
        time.sleep(0.25)
        assert team.try_run([], lambda: None), "the hold is over"
    finally:
        _free_the_caller(cores)
        release.set()
        team.close()


def test_absences_while_the_process_s_own_threads_work_bring_no_hold(monkeypatch):
    """A helper kept off the cores while the backend's other lanes work (``busy_here``: a parallel
    run's branches, as in a worker's tuning runs) is no sign of a neighbour: however many parts
    the caller takes over then, callers are still served; once the lanes are idle, absences
    count again."""
    monkeypatch.setattr(spin_team, "ABSENT_WINDOW_S", 600.0)
    release = threading.Event()
    busy = [True]
    team = _stalled_team(monkeypatch, release, busy_here=lambda: busy[0])
    a, b = _operands(1, 16, 16)
    y = np.zeros((1, 16), np.float32)
    cores = _keep_helper_off_the_caller_s_core(team)
    try:
        for _ in range(2 * spin_team.ABSENT_COUNT):
            assert team.try_run([post_arguments(a, b, y, 0, 16, 16, _NONE)], lambda: None)
        assert team.try_run([], lambda: None), "absences among our own busy threads: no hold"
        busy[0] = False
        for _ in range(spin_team.ABSENT_COUNT):
            assert team.try_run([post_arguments(a, b, y, 0, 16, 16, _NONE)], lambda: None)
        assert not team.try_run([], lambda: None), "absences with nothing else of ours running: held"
    finally:
        _free_the_caller(cores)
        release.set()
        team.close()


def test_a_helper_not_bound_off_its_poster_s_core_is_moved_off_it(monkeypatch):
    """An absent helper free to run on its poster's core (woken there, or left only that core by
    an earlier poster) may be waiting there at its low priority: the poster binds it off its own
    core (and counts the absence, as every one)."""
    cores = placement.allowed_cores()
    if len(cores) < 2 or not placement.enabled() or placement.current_core() is None:
        pytest.skip("needs two cores, thread affinities and sched_getcpu (and ASYNCINFER_PIN_THREADS not 0)")
    monkeypatch.setattr(spin_team, "ABSENT_WINDOW_S", 600.0)
    release = threading.Event()
    team = _stalled_team(monkeypatch, release)
    a, b = _operands(1, 16, 16)
    y = np.zeros((1, 16), np.float32)
    os.sched_setaffinity(0, cores[:1])  # the caller on one core, for the test's length
    try:
        assert team.try_run([], lambda: None)  # starts the helper
        helper = team._threads[0].native_id
        os.sched_setaffinity(helper, cores[:1])  # left only the caller's core by an earlier poster
        assert team.try_run([post_arguments(a, b, y, 0, 16, 16, _NONE)], lambda: None)
        assert sorted(os.sched_getaffinity(helper)) == cores[1:] and team._control[0, spin_team._MOVED]
        assert team.try_run([post_arguments(a, b, y, 0, 16, 16, _NONE)], lambda: None)
        assert sorted(os.sched_getaffinity(helper)) == cores[1:] and team._absences == 2
    finally:
        os.sched_setaffinity(0, cores)
        release.set()
        team.close()


def test_a_helper_s_own_serve_loop_flags_it_asleep_as_it_returns():
    """The helper's way to its sleep is Python, waiting for the GIL: the serve loop itself raises
    the asleep flag as it runs out of parts, so a caller posting meanwhile wakes it rather than
    counting it absent. A caller taking a part over (not the helper's own loop) leaves the flag
    alone."""
    row = spin_team.signal_row()
    masks = placement.off_core_masks([])
    assert serve_parts(row, 0, 1, masks, True) == 0 and spin_team.asleep(row)
    row[spin_team._ASLEEP] = 0
    assert serve_parts(row, 0, 1, masks, False) == 0 and not spin_team.asleep(row)
