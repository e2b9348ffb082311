"""``DynamicBatcher``: merges concurrent requests to one model into batched engine runs.

Concurrent ``infer`` calls whose inputs differ only along the batch axis (axis 0, declared with
one symbolic dimension on every input) are concatenated, run once, and the outputs are split
back per request. A batch is sent when it is full (``max_batch_size`` rows) or when its oldest
request has waited ``max_delay`` seconds, or at once when no batch is in flight (``eager``), and
at most ``max_concurrent_batches`` batches run at once: under load the queue grows while the
engine is busy, so batches grow with the load while a lone request waits for nothing.

Everything awaits (anyio primitives), so it runs under asyncio and trio and never blocks the
event loop. A background dispatcher task lives inside ``async with DynamicBatcher(...)``.
"""
from __future__ import annotations

import enum
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Hashable

import anyio
import numpy as np

from ..backends import BackendType
from ..errors import AsyncInferError, DisposedError, InputError
from ..model.ir import Model
from ..runtime.inputs import bind_inputs
from ..runtime.worker import Worker


@dataclass
class BatcherStats:
    """Counters of a batcher's work since it started (read them, do not write them)."""

    requests: int = 0  # infer calls that reached the engine (batched or alone)
    engine_runs: int = 0  # calls of the worker's ``run``
    batched_runs: int = 0  # engine runs that merged two requests or more
    max_rows: int = 0  # the largest batch sent, in rows along axis 0

    @property
    def mean_requests_per_run(self) -> float:
        return self.requests / self.engine_runs if self.engine_runs else math.nan


@dataclass
class RunTiming:
    """When the engine run that answered one ``infer`` call started and ended
    (``time.perf_counter_ns``), filled in by the batcher for a caller that passes one."""

    started: int = 0
    ended: int = 0


@dataclass(frozen=True)
class RunRecord:
    """One engine run, as reported to a batcher's ``on_run`` hook (durations in nanoseconds)."""

    rows: int  # along axis 0: the batch size of the run
    requests: int  # infer calls answered by it
    input_ns: int  # merging the requests' inputs (0 for a request run alone)
    infer_ns: int  # the engine run itself
    output_ns: int  # splitting the outputs back per request (0 for a request run alone)
    ok: bool


class _Request:
    """One waiting ``infer`` call: its inputs, and where its result or failure goes."""

    __slots__ = ("inputs", "rows", "key", "enqueued_at", "done", "outputs", "error", "abandoned", "batch", "run_scope",
                 "timing")

    def __init__(self, inputs: dict[str, np.ndarray], rows: int, key: Hashable, now: float,
                 timing: RunTiming | None = None):
        self.inputs = inputs
        self.rows = rows
        self.key = key
        self.enqueued_at = now
        self.timing = timing
        self.done = anyio.Event()
        self.outputs: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None
        self.abandoned = False  # the caller was cancelled: nobody reads the result
        self.batch: list[_Request] = []  # once sent: the requests of its engine run
        self.run_scope: anyio.CancelScope | None = None  # ...and the scope that can cancel that run

    def resolve(self, outputs: dict[str, np.ndarray]) -> None:
        if not self.done.is_set():
            self.outputs = outputs
            self.done.set()

    def fail(self, error: BaseException) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class BatcherState(enum.Enum):
    """A batcher's lifecycle: new -> running (inside ``async with``) -> closing -> closed."""

    NEW = "new"
    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class DynamicBatcher:
    """Serve ``infer`` calls for one model, merging concurrent ones along the batch axis.

    Args:
        target: a `Worker` (shared, not disposed by the batcher) or a `Model`
            (the batcher builds a worker on ``backend`` and disposes it when closed).
        backend: the backend of the worker built for a model.
        max_batch_size: most rows (along axis 0) merged into one engine run. A request larger
            than this runs alone.
        max_delay: seconds the oldest waiting request may wait for batch-mates (default 2 ms).
        max_concurrent_batches: batches in flight at once; while they run, the queue fills up.
        eager: when no batch is in flight, run what is queued at once instead of waiting up to
            ``max_delay`` for batch-mates (a lone request then costs no delay, and under load
            batches still form while the engine is busy; under load, the requests already
            arriving, a few event-loop turns away, join too). False: always wait for a full
            batch or ``max_delay``, as Triton's dynamic batcher does.
        threads: CPU thread-pool size of the worker built for a model.
        on_run: called with a `RunRecord` after every engine run (merged or alone, failed
            or not), on the event loop; for statistics and metrics. It must not raise or block.

    Use it as an async context manager (it owns a background dispatcher task)::

        async with DynamicBatcher(model, "cpu", max_batch_size=32) as batcher:
            outputs = await batcher.infer({"image": x})   # {output name: ndarray}

    Requests are merged only when the model is batchable (every input's axis 0 is the same
    symbolic dimension, found on no other axis) and the requests agree on dtypes and non-batch
    dims; anything else runs alone. Each request is checked against the model signature before
    it is queued, so a bad one fails alone with `InputError`. If a merged run
    fails, its requests are retried one by one so a failure stays with the request causing it.
    The model must treat batch rows independently (true of inference graphs; not of a graph
    that reduces over axis 0).
    """

    def __init__(self, target: Worker | Model, backend: BackendType | str = BackendType.CPU, *,
                 max_batch_size: int = 32, max_delay: float = 0.002, max_concurrent_batches: int = 2,
                 eager: bool = True,
                 threads: int | None = None, on_run: Callable[[RunRecord], None] | None = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_delay < 0:
            raise ValueError(f"max_delay must be >= 0 seconds, got {max_delay}")
        if max_concurrent_batches < 1:
            raise ValueError(f"max_concurrent_batches must be at least 1, got {max_concurrent_batches}")
        if isinstance(target, Worker):
            self.worker, self._owns_worker = target, False
        elif isinstance(target, Model):
            self.worker, self._owns_worker = Worker(target, backend, threads=threads), True
        else:
            raise TypeError(f"DynamicBatcher wraps a Worker or a Model, got {type(target).__name__}")
        self.model = self.worker.model
        self.max_batch_size = max_batch_size
        self.max_delay = max_delay
        self.max_concurrent_batches = max_concurrent_batches
        self.eager = eager
        self._batches_in_flight = 0
        self._last_run_requests = 0  # requests merged into the latest engine run: is there load?
        self.stats = BatcherStats()
        self._on_run = on_run
        self._batch_symbol = batch_symbol(self.model)
        self._input_names = [info.name for info in self.model.inputs]
        # Request keys (names, dtypes, ranks and non-batch dims) already checked against the model
        # signature, with the most rows checked: a request with a known key and no more rows is
        # valid (more rows: only the size limits, which grow with the rows, are checked again).
        self._checked: dict[Hashable, int] = {}
        self._queues: dict[Hashable, deque[_Request]] = {}
        self._state = BatcherState.NEW
        # Events belong to an event loop: made in __aenter__, not here (built outside any loop).
        self._wakeup: anyio.Event | None = None
        self._stopped: anyio.Event | None = None
        self._solo_idle: anyio.Event | None = None
        self._solo_runs = 0
        self._stack: AsyncExitStack | None = None
        self._dispatcher_scope: anyio.CancelScope | None = None

    # -- public API ------------------------------------------------------------------------------
    @property
    def batchable(self) -> bool:
        """Whether the model's signature allows merging requests along axis 0."""
        return self._batch_symbol is not None

    @property
    def pending(self) -> int:
        """Requests queued and not yet sent to the engine."""
        return sum(len(q) for q in self._queues.values())

    async def infer(self, inputs: Mapping[str, Any], *, timing: RunTiming | None = None,
                    copy: bool = True) -> dict[str, np.ndarray]:
        """Run the model on ``inputs`` (``{name: array}``), merged with concurrent calls when possible.

        Returns ``{output name: ndarray}`` for this request's rows only. ``timing``, when given,
        receives the start and end of the engine run that answered this call. ``copy=False``
        hands the arrays over: the caller promises not to change them while the request waits
        (by default they are copied, so the caller may reuse its buffers at once).

        Raises:
            InputError: the inputs do not match the model signature (only this call fails).
            DisposedError: the batcher is closed, or closed before this request could run.
            ExecutionError: the engine failed on this request.
        """
        if self._state is not BatcherState.RUNNING:
            raise DisposedError(self._not_running_message())
        request = self._admit(inputs, timing, copy)
        self.stats.requests += 1
        if request is None:  # not mergeable: run alone, in the caller's task
            return await self._run_solo(inputs, timing)
        self._queues.setdefault(request.key, deque()).append(request)
        self._wake()
        try:
            await request.done.wait()
        except BaseException:
            # Cancelled while waiting: leave the queue, or, when already in a batch, let the
            # batch finish for the others and drop this result.
            request.abandoned = True
            self._discard(request)
            self._cancel_if_unwanted(request)
            raise
        if request.error is not None:
            raise request.error
        assert request.outputs is not None
        return request.outputs

    async def dispose_async(self) -> None:
        """Stop accepting requests, run those already queued, wait for batches in flight.

        If this call is cancelled, requests still pending fail with `DisposedError`. A
        worker the batcher built is disposed; a worker it was given is left open.
        """
        if self._state is BatcherState.CLOSED:
            return
        was_running = self._state is BatcherState.RUNNING
        self._state = BatcherState.CLOSING
        self._wake()
        try:
            if was_running:
                assert self._stopped is not None
                await self._stopped.wait()
                while self._solo_runs:  # runs of unmergeable requests, in their callers' tasks
                    self._solo_idle = anyio.Event()
                    await self._solo_idle.wait()
        finally:
            if self._stopped is not None and not self._stopped.is_set():  # cancelled while draining: fail the rest now
                self._fail_all(DisposedError("the batcher was closed before this request ran"))
                if self._dispatcher_scope is not None:
                    self._dispatcher_scope.cancel()
            self._state = BatcherState.CLOSED
            if self._owns_worker:
                with anyio.CancelScope(shield=True):
                    await self.worker.dispose_async()

    async def aclose(self) -> None:
        """Deprecated alias of `dispose_async` (removed in the next release)."""
        warnings.warn("DynamicBatcher.aclose() is deprecated: use `await batcher.dispose_async()`",
                      DeprecationWarning, stacklevel=2)
        await self.dispose_async()

    async def __aenter__(self) -> "DynamicBatcher":
        if self._state is not BatcherState.NEW:
            raise AsyncInferError("a DynamicBatcher can be entered only once")
        self._wakeup, self._stopped = anyio.Event(), anyio.Event()
        self._dispatcher_scope = anyio.CancelScope()
        self._stack = AsyncExitStack()
        task_group = await self._stack.enter_async_context(anyio.create_task_group())
        self._stack.push_async_callback(self.dispose_async)  # runs first on exit: drain, then join the tasks
        task_group.start_soon(self._dispatch)
        self._state = BatcherState.RUNNING
        return self

    async def __aexit__(self, *exc: Any) -> bool:
        assert self._stack is not None
        return await self._stack.__aexit__(*exc)

    def __repr__(self) -> str:
        return (f"<DynamicBatcher {self.model.name!r} max_batch_size={self.max_batch_size} "
                f"max_delay={self.max_delay} {self._state.value}, {self.pending} pending>")

    # -- admission --------------------------------------------------------------------------------
    def _admit(self, inputs: Mapping[str, Any], timing: RunTiming | None = None,
               copy: bool = True) -> _Request | None:
        """Check ``inputs`` against the model; return a queueable request, or None to run alone."""
        if not isinstance(inputs, Mapping):
            raise TypeError(f"infer() takes a mapping {{input name: array}}, got {type(inputs).__name__}")
        key = self._known_key(inputs)
        if key is None:  # the full check: raises InputError naming the input at fault
            bind_inputs(self.model, (inputs,), {})
            if self._batch_symbol is None or not all(isinstance(v, np.ndarray) for v in inputs.values()):
                return None
        arrays = {name: inputs[name] for name in self._input_names}
        rows = next(iter(arrays.values())).shape[0]
        if rows < 1 or rows > self.max_batch_size:
            return None
        if key is None:
            key = _key_of(arrays)
            if all(a.shape[0] == rows for a in arrays.values()):
                if len(self._checked) >= _MAX_CHECKED:  # bounded, whatever shapes clients send
                    self._checked.clear()
                self._checked[key] = max(rows, self._checked.get(key, 0))
        if copy:  # a private copy: the caller may reuse its buffers while the request waits
            arrays = {name: np.array(a, copy=True) for name, a in arrays.items()}
        return _Request(arrays, rows, key, anyio.current_time(), timing)

    def _known_key(self, inputs: Mapping[str, Any]) -> Hashable | None:
        """The request's key when its signature was checked before (then only the size limits,
        which depend on the rows, are checked now); None when `bind_inputs` must check it."""
        if self._batch_symbol is None or not self._checked or len(inputs) != len(self._input_names):
            return None
        arrays = []
        for name in self._input_names:
            array = inputs.get(name)
            if type(array) is not np.ndarray or not array.ndim:
                return None
            arrays.append((name, array))
        rows = arrays[0][1].shape[0]
        if any(a.shape[0] != rows for _, a in arrays):
            return None
        key = _key_of(dict(arrays))
        checked = self._checked.get(key)
        if checked is None:
            return None
        if rows > checked:
            limits = self.model.limits
            for name, array in arrays:  # what bind_inputs checks that depends on the rows
                limits.check_shape(array.shape, f"input {name!r} of shape {array.shape}")
            self._checked[key] = rows
        return key

    def _discard(self, request: _Request) -> None:
        queue = self._queues.get(request.key)
        if queue is not None and request in queue:
            queue.remove(request)
            if not queue:
                del self._queues[request.key]

    @staticmethod
    def _cancel_if_unwanted(request: _Request) -> None:
        """Cancel the engine run of ``request``'s batch once every caller in it has gone (a
        timeout, a disconnect): its layers not started are skipped instead of computed for nobody."""
        if request.run_scope is not None and all(r.abandoned for r in request.batch):
            request.run_scope.cancel()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            for request in queue:
                request.fail(error)
        self._queues.clear()

    def _not_running_message(self) -> str:
        if self._state is BatcherState.NEW:
            return "the DynamicBatcher is not started: use 'async with DynamicBatcher(...) as batcher'"
        return "the DynamicBatcher is closed"

    # -- dispatching ------------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        """The background task: form batches and start them, until closed and drained."""
        assert self._dispatcher_scope is not None and self._stopped is not None
        slots = anyio.Semaphore(self.max_concurrent_batches)
        try:
            with self._dispatcher_scope:
                async with anyio.create_task_group() as runners:  # its exit waits for batches in flight
                    while True:
                        if not self._queues:
                            if self._state is not BatcherState.RUNNING:
                                break
                            await self._wait_for_wakeup(math.inf)
                            continue
                        await slots.acquire()
                        batch = await self._collect()
                        if batch:
                            runners.start_soon(self._run_batch, batch, slots)
                        else:
                            slots.release()
        finally:
            self._fail_all(DisposedError("the batcher stopped before this request ran"))
            self._stopped.set()

    async def _collect(self) -> list[_Request]:
        """Wait until the oldest request's batch is full or its delay is over; take the batch."""
        gathered = False
        while self._queues:
            key = min(self._queues, key=lambda k: self._queues[k][0].enqueued_at)
            queue = self._queues[key]
            deadline = queue[0].enqueued_at + self.max_delay
            full = sum(r.rows for r in queue) >= self.max_batch_size
            remaining = deadline - anyio.current_time()
            # An idle engine runs what is queued now: waiting for batch-mates only pays while a
            # run is in flight (the queue fills meanwhile); alone, it would just add the delay.
            idle = self.eager and self._batches_in_flight == 0
            running = self._state is BatcherState.RUNNING
            if idle and not full and not gathered and running and self._last_run_requests > 1:
                # Under load (the last run merged requests), requests that arrived with this one
                # are still on their way through the event loop: a few turns of it let them join
                # this run rather than start the next (digits at concurrency 8: 6.5 -> 7.8
                # requests per run, +14% infer/s). A request alone still goes at once.
                gathered = True
                for _ in range(GATHER_TURNS):
                    await anyio.sleep(0)
                continue
            if full or idle or remaining <= 0 or not running:
                return self._take(key)
            await self._wait_for_wakeup(remaining)  # a new request, a cancellation, or closing
        return []

    async def _wait_for_wakeup(self, timeout: float) -> None:
        self._wakeup = anyio.Event()
        with anyio.move_on_after(timeout):
            await self._wakeup.wait()

    def _take(self, key: Hashable) -> list[_Request]:
        queue = self._queues[key]
        batch, rows = [], 0
        while queue and rows + queue[0].rows <= self.max_batch_size:
            request = queue.popleft()
            batch.append(request)
            rows += request.rows
        if not queue:
            del self._queues[key]
        return batch

    async def _run_batch(self, batch: list[_Request], slots: anyio.Semaphore) -> None:
        self._last_run_requests = len(batch)
        scope = anyio.CancelScope()
        self._batches_in_flight += 1
        for request in batch:
            request.batch, request.run_scope = batch, scope
        self._cancel_if_unwanted(batch[0])  # every caller may have gone since the batch was taken
        try:
            with scope:  # cancelled when every caller of the batch has gone
                await self._run_requests(batch)
        finally:
            self._batches_in_flight -= 1
            slots.release()
            for request in batch:  # cancelled (batcher shut down) before an answer
                request.fail(DisposedError("the batcher stopped before this request finished"))

    async def _run_requests(self, batch: list[_Request]) -> None:
        if len(batch) == 1:
            await self._run_alone(batch[0])
            return
        began = time.perf_counter_ns()
        merged = {name: np.concatenate([r.inputs[name] for r in batch]) for name in batch[0].inputs}
        input_ns = time.perf_counter_ns() - began
        self.stats.engine_runs += 1
        self.stats.batched_runs += 1
        try:
            parts = await self._timed_run(merged, batch, input_ns)
        except Exception:
            # Keep a failure with the request that causes it: retry each one alone.
            for request in batch:
                if not request.abandoned:
                    await self._run_alone(request)
            return
        for request, part in zip(batch, parts):
            request.resolve(part)

    async def _run_alone(self, request: _Request) -> None:
        self.stats.engine_runs += 1
        try:
            request.resolve(await self._timed_run(request.inputs, [request]))
        except Exception as exc:  # noqa: BLE001 - delivered to the request's caller
            request.fail(exc)

    async def _run_solo(self, inputs: Mapping[str, Any], timing: RunTiming | None) -> dict[str, np.ndarray]:
        """A request that cannot be merged, run in its caller's task."""
        self.stats.engine_runs += 1
        self._solo_runs += 1
        try:
            return await self._timed_run(dict(inputs), [_Request(dict(inputs), 0, None, 0.0, timing)])
        finally:
            self._solo_runs -= 1
            if self._solo_runs == 0 and self._solo_idle is not None:
                self._solo_idle.set()

    async def _timed_run(self, inputs: dict[str, np.ndarray], batch: list[_Request], input_ns: int = 0) -> Any:
        """``worker.run(inputs)`` for the requests of ``batch``: the outputs themselves for one
        request, cut back per request for several. The run's start and end go to each request's
        ``timing``, and a `RunRecord` to ``on_run``; an input the engine refuses before
        running (``InputError``) is no run."""
        first = next(iter(inputs.values()), None)
        rows = int(first.shape[0]) if isinstance(first, np.ndarray) and first.ndim else 1
        self.stats.max_rows = max(self.stats.max_rows, rows)
        began = time.perf_counter_ns()
        ended = split_at = 0
        ok = ran = False
        try:
            outputs = await self.worker.run(inputs)
            ran = True
            ended = split_at = time.perf_counter_ns()
            if len(batch) > 1:
                outputs = _split(outputs, [r.rows for r in batch])
                split_at = time.perf_counter_ns()
            ok = True
            return outputs
        except InputError:
            raise
        except BaseException:
            if not ran:  # failed or cancelled while running (else: the split failed)
                ran, ended, split_at = True, time.perf_counter_ns(), time.perf_counter_ns()
            raise
        finally:
            if ran:
                for request in batch:
                    if request.timing is not None:
                        request.timing.started, request.timing.ended = began, ended
                if self._on_run is not None:
                    self._on_run(RunRecord(rows, len(batch), input_ns, ended - began, split_at - ended, ok))


_MAX_CHECKED = 256  # request keys remembered as checked, per batcher
GATHER_TURNS = 3  # event-loop turns an idle engine waits, under load, for requests already arriving

#: The batch "symbol" of a one-input model whose axis 0 is declared as any size.
ANY_SIZE_BATCH = "?"


def batch_symbol(model: Model) -> str | None:
    """The symbolic dimension that is axis 0 of every input, or None if the model cannot batch.

    Batchable: at least one input, every input a tensor of known rank >= 1 whose axis 0 is the
    same symbolic dimension, appearing on no other axis; every output's axis 0 symbolic or unknown.
    A model with one input whose axis 0 is "any size" (exporters' ``-1``, ``?``, ``unk__N``, shown
    as None) batches along it too, under the name ``"?"``: that is how tf2onnx and Paddle2ONNX
    declare the batch. (With several inputs, unnamed axes say nothing about belonging together.)
    """
    if (len(model.inputs) == 1 and model.inputs[0].kind == "tensor" and model.inputs[0].shape
            and model.inputs[0].shape[0] is None):
        if any(info.kind != "tensor" or (info.shape is not None and (not info.shape or isinstance(info.shape[0], int)))
               for info in model.outputs):
            return None
        return ANY_SIZE_BATCH
    symbols = set()
    for info in model.inputs:
        if info.kind != "tensor" or not info.shape or not isinstance(info.shape[0], str) or not info.shape[0]:
            return None
        symbols.add(info.shape[0])
    if len(symbols) != 1:
        return None
    symbol = symbols.pop()
    if any(symbol in info.shape[1:] for info in model.inputs):  # type: ignore[operator]
        return None
    for info in model.outputs:
        if info.kind != "tensor" or (info.shape is not None and (not info.shape or isinstance(info.shape[0], int))):
            return None
    return symbol


def _key_of(arrays: Mapping[str, np.ndarray]) -> Hashable:
    """What requests must share to be merged: input names, dtypes, ranks and non-batch dims."""
    return tuple((name, a.dtype.str, a.shape[1:]) for name, a in arrays.items())


def _split(outputs: dict[str, np.ndarray], rows: list[int]) -> list[dict[str, np.ndarray]]:
    """Cut every output back into per-request parts along axis 0."""
    total = sum(rows)
    for name, value in outputs.items():
        if value.ndim == 0 or value.shape[0] != total:
            raise AsyncInferError(f"output {name!r} has shape {value.shape}: axis 0 is not the batch of {total}")
    parts: list[dict[str, np.ndarray]] = [{} for _ in rows]
    for name, value in outputs.items():
        start = 0
        for part, count in zip(parts, rows):
            # a copy, so one request's result does not keep the whole batch alive
            part[name] = value[start:start + count].copy()
            start += count
    return parts
