"""The CPU backend's lane pool (asyncinfer/concurrency/lanes.py): the most recently idle thread
takes the next work, work queues first in, first out while every thread is busy, threads start
on demand up to the limit, and shutdown lets queued work finish."""
from __future__ import annotations

import threading
import time

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
        gates, names = _occupy(pool, 2)
        for gate in gates:
            gate.set()
        _until(lambda: pool.idle == 2)
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
