"""A small thread-safe future: the unit of the task graph.

Every scheduled layer gets one `TaskFuture`; its value is the list of the layer's output
arrays. It is lighter than ``concurrent.futures.Future`` (no condition variable unless somebody
blocks on it) because a model schedules hundreds of them per run, and its callbacks run on the
thread that completes it, which is what lets the CPU backend chain layers without a thread ever
blocking on another. Completions made inside callbacks are queued, not nested (constant stack
depth however long the chain), and a callback that raises is logged, never lost with the rest.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

_PENDING, _DONE, _FAILED = 0, 1, 2
_log = logging.getLogger("asyncinfer")
# Per thread: the completions whose callbacks wait to run, while an outer completion's run.
_running = threading.local()


class TaskFuture:
    """Result (or failure) of one task; callbacks fire exactly once, on the completing thread."""

    # A run creates and completes one future per layer, a quarter of a small layer's cost: 0.53
    # µs with an event slot and a callback list per future, 0.44 with neither. So no list until
    # a callback comes, and a thread blocked in `wait` is an Event among the callbacks (set at
    # the completion itself, never queued behind callbacks).
    __slots__ = ("_lock", "_state", "_value", "_error", "_callbacks", "label")

    def __init__(self, label: str = "", lock: threading.Lock | None = None) -> None:
        # Futures made together (a run's layers) may share one ``lock``: no method holds it while
        # it calls out (callbacks and waiters run after its release), so sharing never nests,
        # and a run of 1000 layers allocates one lock instead of 1000.
        self._lock = lock or threading.Lock()
        self._state = _PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["TaskFuture"], None] | threading.Event] | None = None
        self.label = label

    @classmethod
    def completed(cls, value: Any, label: str = "") -> "TaskFuture":
        fut = cls(label)
        fut._state = _DONE
        fut._value = value
        return fut

    # -- completion ------------------------------------------------------------------------
    def set_result(self, value: Any) -> None:
        # (`set_exception`'s body, not a shared helper: one call less on every layer of a run)
        with self._lock:
            if self._state != _PENDING:
                return  # first completion wins (a cancelled task may still be finished by its thread)
            self._state = _DONE
            self._value = value
            callbacks = self._callbacks
            self._callbacks = None
        if callbacks:
            _notify(self, callbacks)

    def set_exception(self, error: BaseException) -> None:
        with self._lock:
            if self._state != _PENDING:
                return
            self._state = _FAILED
            self._error = error
            callbacks = self._callbacks
            self._callbacks = None
        if callbacks:
            _notify(self, callbacks)

    # -- observation -----------------------------------------------------------------------
    def done(self) -> bool:
        return self._state != _PENDING

    def failed(self) -> bool:
        return self._state == _FAILED

    def add_done_callback(self, fn: Callable[["TaskFuture"], None]) -> None:
        """Call ``fn(self)`` once done: now, on this thread, if already done (isolated like every
        callback: if it raises, the error is logged)."""
        with self._lock:
            if self._state == _PENDING:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        _run_callbacks(self, [fn])

    def wait(self, timeout: float | None = None) -> bool:
        """Block the calling thread until done; True if done."""
        if self._state != _PENDING:
            return True
        event = threading.Event()
        with self._lock:
            if self._state != _PENDING:
                return True
            if self._callbacks is None:
                self._callbacks = [event]
            else:
                self._callbacks.append(event)
        return event.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """The value, blocking until done; raises the task's error if it failed."""
        if not self.wait(timeout):
            raise TimeoutError(f"{self.label or 'task'} not done after {timeout} s")
        if self._state == _FAILED:
            raise self._error  # type: ignore[misc]
        return self._value

    def exception(self) -> BaseException | None:
        """The error of a failed task (None while pending or on success)."""
        return self._error

    def peek(self) -> Any:
        """The value of a completed task, without any check."""
        return self._value

    def __repr__(self) -> str:
        state = {_PENDING: "pending", _DONE: "done", _FAILED: "failed"}[self._state]
        return f"<TaskFuture {self.label} {state}>"


def _notify(future: TaskFuture, callbacks: list) -> None:
    """Wake the threads blocked in ``future.wait`` now, then run its callbacks."""
    waiters = [c for c in callbacks if type(c) is threading.Event]
    for event in waiters:
        event.set()
    if len(waiters) < len(callbacks):
        _run_callbacks(future, [c for c in callbacks if type(c) is not threading.Event])


def _run_callbacks(future: TaskFuture, callbacks: list[Callable[[TaskFuture], None]]) -> None:
    """Run ``callbacks`` of a completed future, iteratively: a completion made by a callback
    queues its own callbacks on this thread instead of nesting them, so a failure travelling
    down a chain of 10,000 layers takes constant stack depth, not one frame per layer. A callback
    that raises is logged and the others still run: nothing downstream is left pending."""
    queue = getattr(_running, "queue", None)
    if queue is not None:  # inside another completion's callbacks: they run when it returns
        queue.append((future, callbacks))
        return
    _running.queue = queue = [(future, callbacks)]
    try:
        i = 0
        while i < len(queue):
            done, pending = queue[i]
            i += 1
            for callback in pending:
                try:
                    callback(done)
                except Exception:  # noqa: BLE001 - one broken callback must not strand the rest
                    _log.exception("a completion callback of %r raised", done)
    finally:
        _running.queue = None
