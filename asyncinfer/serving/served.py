"""``ServedModel``: one model version behind an inference service, with its worker and batcher.

A served version is hosted by a task of the service's task group (`ServedModel.host`):
that task builds the worker, enters the `DynamicBatcher`, keeps them until
`ServedModel.stop`, and disposes them, all in one task (anyio's task groups and cancel
scopes must be left in the task that entered them, whoever asked for the load or the unload).
Every engine run is counted in the version's statistics and metrics.
"""
from __future__ import annotations

import enum
import logging
import math
import time
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from contextvars import ContextVar
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np

from ..errors import DisposedError, InputError
from ..model.ir import Model
from ..runtime.profiling import Profile
from ..runtime.worker import Worker
from .batching import DynamicBatcher, RunRecord, RunTiming, batch_symbol
from .metrics import ServerMetrics
from .protocol import HeaderPlans, tensor_metadata
from .repository import ModelSettings
from .statistics import ModelStatistics

DEFAULT_VERSION = "1"  # the version of a model given by name rather than read from a repository
WARMUP_TIMEOUT_S = 5.0  # the longest a model may warm up before it is READY (`ServedModel._warm_up`)
logger = logging.getLogger(__name__)

# The engine-run timing of the request being inferred in this task: set by Call.infer, read by
# ServedModel.infer, so ServedModel.infer keeps the one-argument signature callers rely on.
TIMING: ContextVar[RunTiming | None] = ContextVar("asyncinfer_serving_timing", default=None)


class ModelState(enum.Enum):
    """A model version's state, with Triton's names."""

    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    UNAVAILABLE = "UNAVAILABLE"


class ServedModel:
    """One model version behind the service: its worker (and batcher) exist while it is hosted.

    Args:
        name: the served name.
        model: the loaded model (None for a version that failed to load: ``reason`` says why).
        settings: backend, batching and instance settings.
        version: the version string.
        stats: where its requests and engine runs are counted.
    """

    def __init__(self, name: str, model: Model | None, settings: ModelSettings, *, version: str = DEFAULT_VERSION,
                 stats: ModelStatistics | None = None, metrics: ServerMetrics | None = None, reason: str = ""):
        self.name, self.model, self.settings, self.version = name, model, settings, version
        self.stats = stats if stats is not None else ModelStatistics(name, version)
        self._metrics = metrics
        self.state = ModelState.LOADING if model is not None else ModelState.UNAVAILABLE
        self.reason = reason
        self.worker: Worker | None = None
        self.batcher: DynamicBatcher | None = None
        self.in_flight = 0  # requests holding this version (admitted and not finished)
        self.batch_dim = model is not None and settings.max_batch_size > 0 and batch_symbol(model) is not None
        self.output_names = frozenset(info.name for info in model.outputs) if model is not None else frozenset()
        self.header_plans = HeaderPlans()  # binary-request headers seen, decoded once (`.protocol`)
        self._stop: anyio.Event | None = None
        self._stopped: anyio.Event | None = None
        self._idle: anyio.Event | None = None

    # -- settings, as the old attributes --------------------------------------------------------
    @property
    def backend(self) -> str:
        return self.settings.backend

    @property
    def batching(self) -> bool:
        return self.settings.dynamic_batching and self.settings.max_batch_size > 0

    @property
    def max_batch_size(self) -> int:
        """Triton's ``max_batch_size``: 0 when the model has no batch dimension or batching is off."""
        return self.settings.max_batch_size if self.batch_dim else 0

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY and self.worker is not None and not self.worker.disposed

    def metadata(self, versions: Sequence[str]) -> dict[str, Any]:
        """KServe v2 model metadata (``versions``: those the service serves under this name)."""
        assert self.model is not None
        return {
            "name": self.name,
            "versions": list(versions),
            "platform": "onnx",
            "inputs": [tensor_metadata(i) for i in self.model.inputs],
            "outputs": [tensor_metadata(o) for o in self.model.outputs],
        }

    # -- inference ------------------------------------------------------------------------------
    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every output of the model on ``inputs`` (through the batcher when batching). The arrays
        are handed over (a request's own, decoded from its body): the batcher does not copy them."""
        if self.batcher is not None:
            return await self.batcher.infer(inputs, timing=TIMING.get(), copy=False)
        return await self.infer_values(inputs, None)

    async def infer_values(self, inputs: dict[str, np.ndarray], names: Sequence[str] | None,
                           profile: Profile | None = None) -> dict[str, np.ndarray]:
        """The values ``names`` of the graph (None: the model's outputs), on the worker directly:
        a run asking for intermediate values (or traced into ``profile``) is never merged with others."""
        if self.worker is None:
            raise DisposedError(f"model {self.name!r} is not loaded (server starting or stopping)")
        timing = TIMING.get()
        began = time.perf_counter_ns()
        ok = False
        try:
            outputs = await self.worker.run(inputs, outputs=names, profile=profile)
            ok = True
            return outputs
        except InputError:  # refused before running: no engine run
            began = -1
            raise
        finally:
            if began >= 0:
                ended = time.perf_counter_ns()
                if timing is not None:
                    timing.started, timing.ended = began, ended
                self._record_run(RunRecord(rows_of(inputs), 1, 0, ended - began, 0, ok))

    def _record_run(self, record: RunRecord) -> None:
        size = record.rows if self.batch_dim else 1
        self.stats.record_execution(size, record.input_ns, record.infer_ns, record.output_ns)
        if self._metrics is not None:
            self._metrics.observe_execution(self.name, self.version, size)

    # -- lifecycle ------------------------------------------------------------------------------
    async def host(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Build the worker (and enter the batcher), report started, keep them until `stop`,
        then dispose them; all in this one task. A failure to build leaves the version
        UNAVAILABLE with the reason; it never escapes (the service's other models go on)."""
        self._stop, self._stopped = anyio.Event(), anyio.Event()
        started = False
        try:
            if self.model is None:
                return
            model, settings = self.model, self.settings
            try:
                # Placement and plan compilation on a helper thread: other models keep serving
                # meanwhile; shielded, so a worker being built is never lost (with its threads).
                with anyio.CancelScope(shield=True):
                    worker = await anyio.to_thread.run_sync(
                        lambda: Worker(model, settings.backend, threads=settings.threads))
            except Exception as exc:  # noqa: BLE001 - reported as the version's state
                self._fail(f"the worker could not be built: {type(exc).__name__}: {exc}")
                return
            async with AsyncExitStack() as stack:
                stack.push_async_callback(_dispose_shielded, worker)
                if settings.warmup:
                    await self._warm_up(worker)
                if self.batching:
                    batcher = DynamicBatcher(worker, max_batch_size=self.settings.max_batch_size,
                                             max_delay=self.settings.max_delay,
                                             max_concurrent_batches=self.settings.instances, on_run=self._record_run)
                    self.batcher = await stack.enter_async_context(batcher)
                self.worker = worker
                self.state, self.reason = ModelState.READY, ""
                task_status.started()
                started = True
                await self._stop.wait()
        except Exception as exc:  # noqa: BLE001 - a batcher or disposal failure: log, keep serving the rest
            logger.exception("model %r version %s stopped with an error", self.name, self.version)
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            if self.state is not ModelState.UNAVAILABLE:
                self.state, self.reason = ModelState.UNAVAILABLE, "unloaded"
            self._stopped.set()
            if not started:
                task_status.started()

    async def _warm_up(self, worker: Worker) -> None:
        """Run the model on zeros of its declared inputs (`Worker.warmup`) before it is READY, so
        the first requests find its threads started, its memory paged in and its run mode chosen
        (on the CPU backend, serial or parallel by measurement: a model warmed up by traffic
        alone decides under load, or never). Best effort, at most `WARMUP_TIMEOUT_S`: a model
        that zeros cannot run (values that drive shapes) is served all the same, and says why in
        the log."""
        try:
            with anyio.move_on_after(WARMUP_TIMEOUT_S):
                await worker.warmup()
        except Exception as exc:  # noqa: BLE001 - warm-up is an optimisation, never a reason to refuse
            logger.info("model %r version %s: warm-up on zeros skipped (%s: %s)", self.name, self.version,
                        type(exc).__name__, exc)

    async def stop(self, drain_timeout: float = math.inf) -> None:
        """Refuse new requests (503), let those in flight finish (up to ``drain_timeout``
        seconds), then end the host task: the batcher drains and the worker is disposed."""
        if self._stop is None:  # never hosted
            if self.state is not ModelState.UNAVAILABLE:
                self.state, self.reason = ModelState.UNAVAILABLE, "unloaded"
            return
        if self.state is ModelState.READY or self.state is ModelState.LOADING:
            self.state = ModelState.UNLOADING
        with anyio.move_on_after(drain_timeout):
            while self.in_flight:
                self._idle = anyio.Event()
                await self._idle.wait()
        self._stop.set()
        assert self._stopped is not None
        await self._stopped.wait()

    def hold(self) -> None:
        """A request starts using this version (`stop` waits for it)."""
        self.in_flight += 1

    def release(self) -> None:
        """That request is over."""
        self.in_flight -= 1
        if not self.in_flight and self._idle is not None:
            self._idle.set()

    def request_stop(self) -> None:
        """End the host task without waiting for requests (the service's drain already did)."""
        if self._stop is not None:
            self._stop.set()

    def _fail(self, reason: str) -> None:
        self.state, self.reason = ModelState.UNAVAILABLE, reason
        logger.error("model %r version %s is unavailable: %s", self.name, self.version, reason)

    def __repr__(self) -> str:
        return f"<ServedModel {self.name!r} version {self.version} {self.state.value}>"


async def _dispose_shielded(worker: Worker) -> None:
    with anyio.CancelScope(shield=True):  # a cancelled shutdown still releases threads and devices
        await worker.dispose_async()


def rows_of(inputs: Mapping[str, Any]) -> int:
    first = next(iter(inputs.values()), None)
    return int(first.shape[0]) if isinstance(first, np.ndarray) and first.ndim else 1
