"""The one thread that owns a device: the GL context of ``gpu_pixel``, the CUDA stream of
``gpu_compute``. Both have the same shape, so they share this class.

Work arrives as closures on a queue, from any thread, without ever blocking the sender, and runs
in order on this thread, the only one allowed to touch the device. Between closures the thread
polls the completion checks it was asked to *watch* (a GL fence, a CUDA event) with no waiting,
and runs their completions. While checks are pending it waits on the queue with a short timeout
that grows while nothing completes; with none pending it sleeps until work arrives, so an idle
device costs nothing. Completions run with no lock held: future callbacks may dispatch more
work, which only appends to the queue.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError, DisposedError

_log = logging.getLogger("asyncinfer.device")
_STOP = object()

Job = Callable[[], None]


class DeviceThread:
    """Runs jobs in order on one thread that owns a device; polls watched completions between them.

    Subclasses acquire the device in `start_device` and release it in `stop_device`,
    both on the thread. A failure to start is re-raised by the constructor, through
    `start_failed`.
    """

    #: Poll back-off while completions are pending: start short (a copy usually lands within
    #: microseconds of its work), grow while nothing completes, never sleep past the ceiling.
    POLL_MIN_S = 20e-6
    POLL_MAX_S = 250e-6

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._watched: list[tuple[Callable[[], bool], Job]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:  # the OS refused a thread (limits, memory)
            raise BackendUnavailableError(f"cannot start the {name} device thread: {exc}") from exc
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self.start_failed(self._start_error)

    # -- to override ----------------------------------------------------------------------------
    def start_device(self) -> None:
        """(device thread) Acquire the device."""

    def stop_device(self) -> None:
        """(device thread) Release the device; every job and watched completion has run."""

    def poll_device(self) -> None:
        """(device thread) Housekeeping before each round of completion checks."""

    def start_failed(self, error: BaseException) -> BaseException:
        """The error the constructor raises when `start_device` failed."""
        return error

    # -- from any thread -----------------------------------------------------------------------
    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def closed(self) -> bool:
        return self._closed

    def on_thread(self) -> bool:
        """True when called from the device thread itself."""
        return threading.current_thread() is self._thread

    def submit(self, job: Job) -> bool:
        """Queue ``job``; False (and nothing queued) once closing. Never blocks."""
        with self._lock:  # closing and queueing are ordered: nothing lands after the stop mark
            if self._closed:
                return False
            self._queue.put(job)
            return True

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the device thread and wait for its result (for worker creation: it blocks)."""
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
            raise self.closed_error()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def closed_error(self) -> BaseException:
        """What calls on a closed device raise."""
        return DisposedError(f"the {self._thread.name} device thread was closed")

    def close(self) -> None:
        """Finish the queued jobs and the pending completions, release the device, join the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        if not self.on_thread():  # (closed from a completion: the loop ends by itself)
            self._thread.join()

    # -- on the device thread ----------------------------------------------------------------------
    def watch(self, is_done: Callable[[], bool], on_done: Job) -> None:
        """Run ``on_done()`` on this thread once ``is_done()`` (checked without waiting) is True."""
        self._watched.append((is_done, on_done))

    def _main(self) -> None:
        np.seterr(all="ignore")  # kernels run here: inf and NaN are values in ONNX, not warnings
        try:
            self.start_device()
        except BaseException as exc:  # noqa: BLE001 - reported by the constructor
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        finally:
            try:
                self.stop_device()
            except Exception:  # noqa: BLE001 - nothing left to report it to
                _log.exception("%s: releasing the device failed", self._thread.name)

    def _loop(self) -> None:
        stopping = False
        wait = self.POLL_MIN_S
        while not (stopping and not self._watched):  # after the stop mark: until the last completion
            try:  # block only when nothing is watched; else wake up to poll
                item = self._queue.get(timeout=wait) if self._watched else self._queue.get()
            except queue.Empty:
                item = None
            if item is _STOP:
                stopping = True
            elif item is not None:
                self._run(item)
            if self._poll() or item is not None:
                wait = self.POLL_MIN_S
            else:
                wait = min(wait * 2, self.POLL_MAX_S)

    def _run(self, job: Job) -> None:
        try:
            job()
        except Exception:  # noqa: BLE001 - jobs report their own failures; keep the thread alive
            _log.exception("%s: a job raised", self._thread.name)

    def _poll(self) -> bool:
        """Run the completions of every finished check; True if any finished."""
        self.poll_device()
        if not self._watched:
            return False
        still, finished = [], []
        for entry in self._watched:
            try:
                (finished if entry[0]() else still).append(entry)
            except Exception:  # noqa: BLE001 - a failing check completes (its on_done reports)
                finished.append(entry)
        if not finished:
            return False
        self._watched = still
        for _, on_done in finished:
            self._run(on_done)
        return True
