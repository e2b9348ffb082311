"""Bridge from task-graph completion (any thread) to the caller's event loop.

Awaiting never blocks the loop: the completing thread wakes the loop with a thread-safe call.
Works under asyncio (incl. notebooks with top-level ``await``) and under trio, which anyio also
runs on. Cancelling the awaiting task never cancels the underlying computation, which may be
shared by other awaiters.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import sniffio

from .future import TaskFuture


async def wait_done(fut: TaskFuture) -> None:
    """Suspend the current task until ``fut`` is done (success or failure)."""
    if fut.done():
        return
    library = sniffio.current_async_library()
    if library == "asyncio":
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def wake(_: TaskFuture) -> None:
            try:
                loop.call_soon_threadsafe(_resolve, waiter)
            except RuntimeError:  # loop closed: nobody is waiting any more
                pass

        fut.add_done_callback(wake)
        await waiter
    elif library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()
        event = trio.Event()

        def wake_trio(_: TaskFuture) -> None:
            try:
                token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                pass

        fut.add_done_callback(wake_trio)
        await event.wait()
    else:  # pragma: no cover - other loops are not supported by anyio either
        raise RuntimeError(f"unsupported async library {library!r}")


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():  # the awaiting task may have been cancelled meanwhile
        waiter.set_result(None)


def loop_dispatcher() -> Callable[[Callable[..., Any], Any], None] | None:
    """A function that runs ``fn(arg)`` on the event loop running now, or None outside any loop."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None
    if library == "asyncio":
        loop = asyncio.get_running_loop()

        def on_asyncio(fn: Callable[..., Any], arg: Any) -> None:
            try:
                loop.call_soon_threadsafe(fn, arg)
            except RuntimeError:  # loop closed since the request: deliver here rather than lose it
                fn(arg)

        return on_asyncio
    if library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def on_trio(fn: Callable[..., Any], arg: Any) -> None:
            try:
                token.run_sync_soon(fn, arg)
            except trio.RunFinishedError:
                fn(arg)

        return on_trio
    return None
