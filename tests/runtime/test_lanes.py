"""The CPU backend's lane pool (asyncinfer/concurrency/lanes.py): the most recently idle thread
takes the next work, unless a thread said it is finishing (then that one), work queues first in,
first out while every thread is busy, threads start on demand up to the limit, a claimed idle
thread takes only the work queued while it was claimed, and shutdown lets queued work finish."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from asyncinfer.concurrency.lanes import LanePool


def _until(condition, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def _occupy(pool: LanePool, count: int) -> tuple[list[threading.Event], list[str]]:
    """``count`` threads each held by a piece of work until its event is set; their names."""
    gates = [threading.Event() for _ in range(count)]
    names: list[str] = []
    entered = threading.Semaphore(0)

    def hold(gate: threading.Event) -> None:
        names.append(threading.current_thread().name)
        entered.release()
        gate.wait(10)

    for gate in gates:
        pool.submit(hold, gate)
    for _ in gates:
        assert entered.acquire(timeout=10)
    return gates, names


def test_the_most_recently_idle_thread_takes_the_next_work():
    pool = LanePool(3, "lane-test")
    try:
        gates, names = _occupy(pool, 3)
        assert pool.started == 3 and len(set(names)) == 3
        for k, i in enumerate((2, 0, 1)):  # thread 1 goes idle last
            gates[i].set()
            _until(lambda k=k: pool.idle == k + 1)
        ran_on: list[str] = []
        done = threading.Event()
        pool.submit(lambda: (ran_on.append(threading.current_thread().name), done.set()))
        assert done.wait(10)
        assert ran_on == [names[1]]
        _until(lambda: pool.idle == 3)
        done.clear()
        pool.submit(lambda: (ran_on.append(threading.current_thread().name), done.set()))
        assert done.wait(10)
        assert ran_on == [names[1], names[1]]  # the same warm thread again, run after run
    finally:
        pool.shutdown()


def _all_idle(pool: LanePool, count: int) -> list[str]:
    """``count`` threads started, then idle again; their names."""
    gates, names = _occupy(pool, count)
    for gate in gates:
        gate.set()
    _until(lambda: pool.idle == count)
    return names


def _finishing_thread(pool: LanePool) -> tuple[threading.Event, list[str]]:
    """A pool thread that calls ``pool.finishing()`` and waits for its gate: (the gate, its name)."""
    gate, said = threading.Event(), threading.Event()
    name: list[str] = []

    def finish() -> None:
        name.append(threading.current_thread().name)
        pool.finishing()
        said.set()
        gate.wait(10)

    pool.submit(finish)
    assert said.wait(10)
    return gate, name


def _runs_on(pool: LanePool) -> tuple[threading.Event, list[str]]:
    ran_on: list[str] = []
    done = threading.Event()
    pool.submit(lambda: (ran_on.append(threading.current_thread().name), done.set()))
    return done, ran_on


def test_a_finishing_thread_takes_work_before_an_idle_one():
    """The next run goes to the lane that just ran one (warm), even while the other is idle and
    that lane has not yet come back to the pool (an awaited run's loop schedules the next first)."""
    pool = LanePool(2, "lane-test")
    try:
        gates, names = _occupy(pool, 2)
        gates[0].set()
        _until(lambda: pool.idle == 1)  # names[0] idle
        gate, finishing = _finishing_thread(pool)
        assert finishing == [names[0]]  # (the idle one took it, then said it is finishing)
        gates[1].set()
        _until(lambda: pool.idle == 1)  # names[1] idle now, the most recently
        done, ran_on = _runs_on(pool)
        assert not done.wait(0.1)  # it waits for the finishing thread, not for the idle one
        gate.set()
        assert done.wait(10)
        assert ran_on == finishing
        done, ran_on = _runs_on(pool)  # back to normal: nobody finishing
        assert done.wait(10)
    finally:
        pool.shutdown()


def test_a_finishing_thread_that_gets_more_work_of_its_own_passes_on_what_it_was_handed():
    pool = LanePool(2, "lane-test")
    try:
        names = _all_idle(pool, 2)
        handed = threading.Event()

        def finishing_then_busy() -> None:
            pool.finishing()
            done, ran_on = _runs_on(pool)  # from itself: to the idle thread, not to itself
            assert done.wait(10)
            handed_ran.extend(ran_on)
            handed.wait(10)
            pool.busy_again()

        handed_ran: list[str] = []
        outer_done = threading.Event()
        pool.submit(lambda: (finishing_then_busy(), outer_done.set()))
        _until(lambda: len(handed_ran) == 1)
        me = next(n for n in names if n != handed_ran[0])
        done, ran_on = _runs_on(pool)  # handed to the finishing thread ...
        assert not done.wait(0.1)
        handed.set()  # ... which has more to do: the idle thread runs it
        assert done.wait(10) and outer_done.wait(10)
        assert ran_on == handed_ran and ran_on != [me]
    finally:
        pool.shutdown()


def test_shutdown_runs_what_a_finishing_thread_was_handed():
    pool = LanePool(1, "lane-test")
    gate, _ = _finishing_thread(pool)
    done: list[int] = []
    pool.submit(done.append, 1)
    closer = threading.Thread(target=pool.shutdown)
    closer.start()
    gate.set()
    closer.join(10)
    assert not closer.is_alive() and done == [1]


@pytest.mark.parametrize("spin_rounds", [10**9, 0])
def test_an_idle_thread_spins_and_takes_work_by_a_post_then_sleeps(spin_rounds, monkeypatch):
    """A thread out of work spins a while (`SPIN_ROUNDS`), and work handed to it meanwhile raises
    a post to its row, no event (no system call to wake it); past that it sleeps on its event. Shutdown
    ends either."""
    from asyncinfer.concurrency import lanes

    monkeypatch.setattr(lanes, "SPIN_ROUNDS", spin_rounds)
    pool = LanePool(1, "lane-test")
    try:
        first = threading.Event()
        pool.submit(first.set)
        assert first.wait(10)
        _until(lambda: pool.idle == 1)
        record = pool._idle[-1]  # noqa: SLF001 - the idle thread's hand-off
        # (billions of rounds: it spins for the whole test; none: it sleeps on its event at once)
        sets, set_event = [], record.event.set
        record.event.set = lambda: (sets.append(1), set_event())  # (counting the wake-ups)
        for k in range(2):
            _until(lambda: record.spinning == bool(spin_rounds))
            ran = threading.Event()
            pool.submit(ran.set)
            assert ran.wait(10)
            assert len(sets) == (0 if spin_rounds else k + 1)
            _until(lambda: pool.idle == 1)
    finally:
        pool.shutdown()
    assert not any(t.name.startswith("lane-test_") and t.is_alive() for t in threading.enumerate())


def test_work_queues_in_order_while_every_thread_is_busy_and_no_thread_beyond_the_limit():
    pool = LanePool(1, "lane-test")
    try:
        gates, _ = _occupy(pool, 1)
        order: list[int] = []
        for i in range(5):
            pool.submit(order.append, i)
        assert pool.started == 1 and order == []
        gates[0].set()
        _until(lambda: len(order) == 5)
        assert order == [0, 1, 2, 3, 4]
    finally:
        pool.shutdown()


def test_each_thread_runs_the_initializer_once_before_its_work():
    started: list[str] = []
    pool = LanePool(2, "lane-test", initializer=lambda: started.append(threading.current_thread().name))
    try:
        names = _all_idle(pool, 2)
        ran = threading.Event()
        pool.submit(ran.set)
        assert ran.wait(10)
        assert sorted(started) == sorted(names) and all(n.startswith("lane-test_") for n in names)
    finally:
        pool.shutdown()


def test_work_that_raises_is_logged_and_the_thread_goes_on(caplog):
    pool = LanePool(1, "lane-test")
    try:
        pool.submit(lambda: 1 / 0)
        ran = threading.Event()
        pool.submit(ran.set)
        assert ran.wait(10)
        _until(lambda: any("raised" in r.getMessage() for r in caplog.records))
        assert pool.started == 1
    finally:
        pool.shutdown()


def test_shutdown_finishes_queued_work_joins_the_threads_and_refuses_more():
    pool = LanePool(1, "lane-test")
    gates, _ = _occupy(pool, 1)
    done: list[int] = []
    pool.submit(done.append, 1)
    closer = threading.Thread(target=pool.shutdown)
    closer.start()
    time.sleep(0.05)
    assert closer.is_alive()  # waiting for the held work
    gates[0].set()
    closer.join(10)
    assert not closer.is_alive() and done == [1]
    assert not any(t.name.startswith("lane-test_") and t.is_alive() for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(done.append, 2)


def test_a_pool_needs_a_thread():
    with pytest.raises(ValueError, match="at least 1"):
        LanePool(0, "lane-test")


@pytest.mark.asyncio
@pytest.mark.parametrize("profiled", [False, True])
async def test_awaited_runs_one_after_another_stay_on_one_lane(digits_model, digits_samples, monkeypatch, profiled):
    """The CPU backend's job says it is finishing before its last layer's future wakes the loop,
    so the loop's next run goes to that lane, not to the idle one (they alternated run after run).
    Profiled runs too (their steps complete through `_ProfiledStepDone`)."""
    monkeypatch.setenv("ASYNCINFER_QUICK_RUN_US", "0")  # (every run through the pool)
    monkeypatch.setenv("ASYNCINFER_RUN_MODE", "serial")  # (a run's layers on one lane)
    import asyncinfer as ai

    batch = np.concatenate([digits_samples[0]] * 8)  # (a run of a millisecond or so: the loop sleeps meanwhile)
    async with ai.Worker(digits_model, "cpu", threads=2) as worker:
        pool = worker._backend._pool  # noqa: SLF001 - the lanes themselves
        submit, lanes = pool.submit, []

        def recording(fn, *args):
            def run(*a):
                lanes.append(threading.current_thread().name)
                return fn(*a)
            submit(run, *args)

        await asyncio.gather(*(worker.run(batch) for _ in range(4)))  # (both lanes started)
        assert pool.started == 2
        pool.submit = recording
        expected = None
        for _ in range(12):
            out = await worker.run(batch, profile=ai.Profile() if profiled else None)
            expected = out if expected is None else expected
            np.testing.assert_array_equal(next(iter(out.values())), next(iter(expected.values())))
    assert len(lanes) >= 12 and len(set(lanes[1:])) == 1, lanes


def _one_idle_thread(pool: LanePool, check_busy=lambda: True) -> str:
    """Start the pool's one thread with a piece of work (``check_busy()`` must hold while it
    runs) and wait until it is idle; its name."""
    gates, names = _occupy(pool, 1)
    assert check_busy()
    gates[0].set()
    _until(lambda: pool.idle == 1)
    return names[0]


def test_a_claimed_idle_thread_takes_no_work_until_given_back_then_the_queued_work():
    """`claim_idle`: the caller works in place of an idle thread (a blocking run on a pool of one
    lane); work submitted meanwhile queues, in order, for that thread once it is given back."""
    pool = LanePool(1, "lane-test")
    try:
        assert pool.claim_idle() is None  # (no thread started yet)
        name = _one_idle_thread(pool, check_busy=lambda: pool.claim_idle() is None)
        claimed = pool.claim_idle()
        assert claimed is not None and pool.idle == 0
        ran: list[tuple[int, str]] = []
        for i in range(2):
            pool.submit(lambda i=i: ran.append((i, threading.current_thread().name)))
        time.sleep(0.05)
        assert ran == [] and pool.started == 1  # queued: no second thread beyond the limit
        pool.give_back(claimed)
        _until(lambda: len(ran) == 2)
        assert ran == [(0, name), (1, name)]
        _until(lambda: pool.idle == 1)
        claimed = pool.claim_idle()
        pool.give_back(claimed)  # nothing queued: idle again
        assert pool.idle == 1
    finally:
        pool.shutdown()


def test_shutdown_while_a_thread_is_claimed_ends_it():
    pool = LanePool(1, "lane-test")
    _one_idle_thread(pool)
    claimed = pool.claim_idle()
    assert claimed is not None
    pool.shutdown()  # (joins the claimed thread: it was woken to exit, not left waiting)
    assert not any(t.is_alive() for t in pool._threads)
    pool.give_back(claimed)  # (after shutdown: nothing to do)
    assert pool.claim_idle() is None
