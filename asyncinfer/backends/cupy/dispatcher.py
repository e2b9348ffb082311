"""The dispatcher thread: the one thread that owns the device, its stream, and every CUDA call.

Work arrives on a queue (layers to enqueue, downloads to start, constants to upload) from any
thread, without ever blocking the sender. Between work items the thread polls the events of the
copies in flight and runs their completions; when only polls remain, it waits on the queue with a
short, growing timeout, so a new work item is picked up at once and an idle device costs nothing.
Completions run on this thread with no lock held (future callbacks may dispatch more work: that
only appends to the queue).
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from ...errors import BackendUnavailableError
from .device import DeviceRuntime
from .kernels.base import KernelContext

log = logging.getLogger("asyncinfer.gpu_compute")

Job = Callable[[], None]
_STOP = object()
# Poll back-off while copies are in flight: start short (a readback usually lands within
# microseconds of its kernels), grow while nothing completes, never sleep past this ceiling.
POLL_MIN_S = 20e-6
POLL_MAX_S = 250e-6


class Dispatcher:
    """Runs jobs in order on one thread that owns ``runtime``; polls fences between them."""

    def __init__(self, runtime: DeviceRuntime, name: str = "asyncinfer-gpu_compute"):
        self.runtime = runtime
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._watched: list[tuple[Any, Callable[[], None]]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.context: KernelContext | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise BackendUnavailableError(
                f"gpu_compute could not start on {runtime.description}: "
                f"{type(self._start_error).__name__}: {self._start_error}") from self._start_error

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def on_thread(self) -> bool:
        """True when called from the dispatcher thread itself."""
        return threading.current_thread() is self._thread

    # -- from any thread ----------------------------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (and nothing queued) once the dispatcher is closing. Never blocks."""
        with self._lock:  # closing and queueing are ordered: nothing lands after the stop mark
            if self._closed:
                return False
            self._queue.put(job)
            return True

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the dispatcher thread and return its result (blocking: for worker creation)."""
        if self.on_thread():
            return fn()
        done = threading.Event()
        box: dict[str, Any] = {}

        def job() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
                box["error"] = exc
            done.set()

        if not self.submit(job):
            raise BackendUnavailableError("the gpu_compute backend is closed")
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        """Finish the queued work and the copies in flight, then stop the thread and join it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        if not self.on_thread():  # (closed from a completion callback: the loop ends by itself)
            self._thread.join()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- on the dispatcher thread ----------------------------------------------------------------
    def watch(self, fence: Any, on_done: Callable[[], None]) -> None:
        """Call ``on_done()`` (on this thread) once ``fence.done()`` is True."""
        self._watched.append((fence, on_done))

    def _main(self) -> None:
        try:
            self.context = self.runtime.start()
        except BaseException as exc:  # noqa: BLE001 - reported by the constructor
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        finally:
            try:
                self.runtime.stop()
            except Exception:  # noqa: BLE001 - nothing left to report it to
                log.exception("gpu_compute: stopping the device failed")

    def _loop(self) -> None:
        stopping = False
        wait = POLL_MIN_S
        while not (stopping and not self._watched):  # after the stop mark: until the last copy lands
            try:  # block only when no copy is in flight; else wake up to poll
                item = self._queue.get(timeout=wait) if self._watched else self._queue.get()
            except queue.Empty:
                item = None
            if item is _STOP:
                stopping = True
            elif item is not None:
                self._run(item)
            if self._poll() or item is not None:
                wait = POLL_MIN_S
            else:
                wait = min(wait * 2, POLL_MAX_S)

    def _run(self, job: Job) -> None:
        try:
            job()
        except Exception:  # noqa: BLE001 - jobs report their own failures; keep the device thread alive
            log.exception("gpu_compute: a dispatcher job raised")

    def _poll(self) -> bool:
        """Release finished staging buffers, run the completions of every finished fence; True if
        any fence finished."""
        self.runtime.poll()
        if not self._watched:
            return False
        finished = [(f, cb) for f, cb in self._watched if f.done()]
        if not finished:
            return False
        done_ids = {id(f) for f, _ in finished}
        self._watched = [(f, cb) for f, cb in self._watched if id(f) not in done_ids]
        for _, on_done in finished:
            self._run(on_done)
        return True
