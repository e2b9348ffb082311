"""Bridge from task-graph completion (any thread) to the caller's event loop.

Awaiting never blocks the loop: the completing thread wakes the loop with a thread-safe call.
Under asyncio the wake-ups of one loop are batched (`_LoopInbox`): completions that arrive before
the loop has run the first one's callback ride along with it, so a thread finishing many things
at once (a decode step's 8 streams' tokens) writes to the loop's self-pipe once, not 8 times.
Works under asyncio (incl. notebooks with top-level ``await``) and under trio, which anyio also
runs on. Cancelling the awaiting task never cancels the underlying computation, which may be
shared by other awaiters.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio.lowlevel
import sniffio

from .future import TaskFuture


def _asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The asyncio loop the calling task runs on; None under another library (trio marks its
    tasks for sniffio; anyio names asyncio the same way) or outside any loop. sniffio finds asyncio through `asyncio.current_task`
    and anyio's checkpoint imports its backend module by name, on every call: about 10 µs of a
    streaming model's 130 µs awaited run, Python's caches cold after the kernels. (Each asyncio
    lookup of the running loop is a ``getpid`` system call too: one a call here.)"""
    if sniffio.thread_local.name is None and sniffio.current_async_library_cvar.get() in (None, "asyncio"):
        return asyncio._get_running_loop()
    return None


def async_library() -> str:
    """`sniffio.current_async_library`, asyncio's case found first (`_asyncio_loop`). Raises
    `sniffio.AsyncLibraryNotFoundError` outside any loop."""
    return "asyncio" if _asyncio_loop() is not None else sniffio.current_async_library()


async def checkpoint() -> None:
    """`anyio.lowlevel.checkpoint` (a yield to the loop's other tasks, and a point where the
    awaiting task may be cancelled), asyncio's own ``sleep(0)`` under asyncio."""
    if _asyncio_loop() is not None:
        await asyncio.sleep(0)
    else:
        await anyio.lowlevel.checkpoint()


async def wait_done(fut: TaskFuture) -> None:
    """Suspend the current task until ``fut`` is done (success or failure)."""
    if fut.done():
        return
    loop = _asyncio_loop()
    library = "asyncio" if loop is not None else sniffio.current_async_library()
    if loop is not None:
        waiter = loop.create_future()

        inbox = _inbox(loop)
        fut.add_done_callback(lambda _: inbox.post(_resolve, waiter, None))  # loop closed: nobody waits
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


class _LoopInbox:
    """Calls from other threads to run on one asyncio loop, delivered in batches: the call that
    finds the inbox empty wakes the loop (``call_soon_threadsafe``, a write to its self-pipe, and
    on a small VM a GIL hand-off to the loop's thread: 30-40 µs); calls arriving before the loop
    drains the inbox are run by that same drain, in the order they came."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], Any], Any, Callable[[Any], Any] | None]] = []

    def post(self, fn: Callable[[Any], Any], arg: Any, closed: Callable[[Any], Any] | None) -> None:
        """Run ``fn(arg)`` on the loop; if the loop is closed, ``closed(arg)`` here (None: drop it)."""
        with self._lock:
            self._pending.append((fn, arg, closed))
            if len(self._pending) > 1:
                return  # a drain is scheduled already and has not taken the list yet
        deferred = getattr(_local, "deferred", None)
        if deferred is not None:  # inside `deferred_wakeups`: wake the loop at the block's end
            deferred.append(self)
            return
        self.wake()

    def wake(self) -> None:
        """Have the loop drain the inbox."""
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nothing will drain the inbox
            with self._lock:
                pending, self._pending = self._pending, []
            for _, value, fallback in pending:
                if fallback is not None:
                    fallback(value)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for fn, arg, _ in pending:
            try:
                fn(arg)
            except Exception as exc:  # noqa: BLE001 - one failing callback must not drop the rest
                self._loop.call_exception_handler({"message": "asyncinfer: a completion callback failed",
                                                   "exception": exc})


_local = threading.local()


@contextmanager
def deferred_wakeups() -> Iterator[None]:
    """Inside this block, completions posted from this thread to event loops wake each loop once,
    when the block ends: a thread that completes several things in a row (a decode step's tokens,
    one per stream) then costs each loop one wake-up, and does not hand the GIL to the loop's
    thread between them."""
    if getattr(_local, "deferred", None) is not None:  # nested: the outer block wakes them
        yield
        return
    _local.deferred = deferred = []
    try:
        yield
    finally:
        _local.deferred = None
        for inbox in dict.fromkeys(deferred):
            inbox.wake()


_inboxes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopInbox]" = weakref.WeakKeyDictionary()
_inboxes_lock = threading.Lock()


def _inbox(loop: asyncio.AbstractEventLoop) -> _LoopInbox:
    """The inbox of ``loop`` (made on first use; it goes with the loop)."""
    inbox = _inboxes.get(loop)
    if inbox is None:
        with _inboxes_lock:
            inbox = _inboxes.get(loop)
            if inbox is None:
                inbox = _inboxes[loop] = _LoopInbox(loop)
    return inbox


def loop_dispatcher() -> Callable[[Callable[..., Any], Any], None] | None:
    """A function that runs ``fn(arg)`` on the event loop running now, or None outside any loop."""
    try:
        library = async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None
    if library == "asyncio":
        inbox = _inbox(asyncio.get_running_loop())

        def on_asyncio(fn: Callable[..., Any], arg: Any) -> None:
            inbox.post(fn, arg, fn)  # loop closed since the request: deliver here rather than lose it

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
