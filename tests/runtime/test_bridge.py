"""The bridge from completing threads to the event loop (`concurrency/bridge.py`): wake-ups of
one asyncio loop are batched, none is lost, and a closed loop still gets what it is owed."""
from __future__ import annotations

import asyncio
import threading

import pytest

from asyncinfer.concurrency import bridge
from asyncinfer.concurrency.future import TaskFuture


def _count_wakeups(loop: asyncio.AbstractEventLoop, monkeypatch) -> list[int]:
    calls = [0]
    real = loop.call_soon_threadsafe

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    return calls


@pytest.mark.asyncio
async def test_completions_made_together_on_a_thread_wake_the_loop_once(monkeypatch):
    loop = asyncio.get_running_loop()
    wakeups = _count_wakeups(loop, monkeypatch)
    futures = [TaskFuture(label=f"f{i}") for i in range(8)]
    order: list[int] = []

    async def waiter(i: int) -> None:
        await bridge.wait_done(futures[i])
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(8)]
    await asyncio.sleep(0)  # every waiter is parked on its future

    def complete_all() -> None:
        with bridge.deferred_wakeups():
            for i, future in enumerate(futures):
                future.set_result([i])

    thread = threading.Thread(target=complete_all)
    thread.start()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    thread.join()
    assert wakeups[0] == 1
    assert sorted(order) == list(range(8))


@pytest.mark.asyncio
async def test_completions_posted_before_the_loop_drains_ride_along(monkeypatch):
    """Without deferring, a post that finds a drain already scheduled adds no wake-up of its own."""
    loop = asyncio.get_running_loop()
    wakeups = _count_wakeups(loop, monkeypatch)
    seen: list[int] = []
    dispatch = bridge.loop_dispatcher()
    assert dispatch is not None

    def post_many() -> None:  # the loop is blocked in `join` below, so it drains nothing meanwhile
        for i in range(5):
            dispatch(seen.append, i)

    thread = threading.Thread(target=post_many)
    thread.start()
    thread.join()
    await asyncio.sleep(0.01)
    assert seen == [0, 1, 2, 3, 4]  # in the order they came
    assert wakeups[0] == 1


@pytest.mark.asyncio
async def test_a_failing_callback_does_not_drop_the_ones_after_it():
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        dispatch = bridge.loop_dispatcher()
        seen: list[int] = []

        def explode(_: int) -> None:
            raise ValueError("boom")

        def post() -> None:
            with bridge.deferred_wakeups():
                dispatch(seen.append, 1)
                dispatch(explode, 2)
                dispatch(seen.append, 3)

        thread = threading.Thread(target=post)
        thread.start()
        thread.join()
        await asyncio.sleep(0.01)
        assert seen == [1, 3]
        assert len(errors) == 1 and isinstance(errors[0]["exception"], ValueError)
    finally:
        loop.set_exception_handler(None)


def test_a_closed_loop_gets_its_deliveries_on_the_posting_thread():
    """loop_dispatcher's promise: once the loop is closed, ``fn(arg)`` runs where it was posted,
    rather than being lost; an awaiter's wake-up is dropped (nobody is waiting any more)."""
    loop = asyncio.new_event_loop()

    async def make_dispatcher():
        return bridge.loop_dispatcher()

    dispatch = loop.run_until_complete(make_dispatcher())
    loop.close()
    seen: list[tuple[int, str]] = []
    dispatch(lambda value: seen.append((value, threading.current_thread().name)), 7)
    assert seen == [(7, threading.current_thread().name)]
    dispatch(lambda value: seen.append((value, "again")), 8)  # the inbox was not left half full
    assert seen[-1] == (8, "again")


@pytest.mark.anyio
async def test_the_library_is_named_as_sniffio_names_it(anyio_backend_name):
    """`bridge.async_library` finds asyncio without sniffio's sniffing, and leaves trio (which
    marks its tasks for sniffio) to sniffio: the same answer either way."""
    import sniffio

    assert bridge.async_library() == sniffio.current_async_library() == anyio_backend_name


def test_outside_any_loop_there_is_no_library():
    import sniffio

    with pytest.raises(sniffio.AsyncLibraryNotFoundError):
        bridge.async_library()
    assert bridge.loop_dispatcher() is None


@pytest.mark.anyio
async def test_a_checkpoint_yields_and_may_be_cancelled(anyio_backend_name):
    """`bridge.checkpoint` (a quick run's yield before its steps) is a cancellation point on
    asyncio (its own ``sleep(0)``) and on trio (anyio's checkpoint), and on asyncio lets a task
    started before it run first (trio orders the tasks of a batch as it likes)."""
    import anyio

    reached = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        await bridge.checkpoint()
        reached.append(True)
    assert scope.cancelled_caught and not reached
    ran: list[str] = []

    async def other() -> None:
        ran.append("other")

    async with anyio.create_task_group() as group:
        group.start_soon(other)
        await bridge.checkpoint()
        ran.append("after the checkpoint")
    assert sorted(ran) == ["after the checkpoint", "other"]
    if anyio_backend_name == "asyncio":
        assert ran == ["other", "after the checkpoint"]
