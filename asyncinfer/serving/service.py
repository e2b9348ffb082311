"""``InferenceService``: the models one process serves, independent of any transport.

The HTTP app (`.server`) and the gRPC server are thin adapters over one service: they decode
a request, then ::

    async with service.request(name, version) as call:   # 404 unknown, 503 full/not ready/draining
        with call.phase("input"):
            inputs = decode(body, call.model)             # times compute_input
        outputs = await call.infer(inputs)                # 400 / 500 / 503 / 504
        with call.phase("output"):
            answer = encode(outputs)                      # times compute_output
    # leaving the block records success or failure in statistics and metrics

Every error is a `ProtocolError` with an HTTP status (the gRPC side maps it to
a status code). The service owns:

- the models: given at construction (``{name: Model or path}``, served as version ``"1"``), or
  read from a Triton-layout model repository (`.repository`), with Triton's model control
  modes ``none`` (load everything at startup), ``poll`` (also follow changes on disk) and
  ``explicit`` (load and unload through the API);
- one worker (and `DynamicBatcher`) per model version, each hosted by a task of
  the service's task group, so it is entered and left in one task whoever asks for a load;
- admission (`.admission`): a bound per model, a deadline per request, a drain at shutdown;
- statistics (`.statistics`) and Prometheus metrics (`.metrics`), with a sampler of
  the event loop's lag running beside the models.

A service may be one of several worker processes serving the same models
(``asyncinfer serve --workers N``): then `InferenceService.siblings` (`.multiprocess`)
links it to the others, and the calls that concern the whole server (`gather_statistics`,
`render_metrics`, `gather_traces`, `load`, `unload`, `update_trace`) answer for, or
apply to, every process.
"""
from __future__ import annotations

import gc
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol, Union

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np

from .. import __version__
from ..backends import BackendType
from ..errors import AsyncInferError, DisposedError, InputError, ModelLoadError
from ..limits import DEFAULT_LIMITS, Limits
from ..loader import load_model
from ..model.ir import Model
from .admission import Admission, drained, unavailable
from .batching import RunTiming
from .metrics import ServerMetrics
from .protocol import ProtocolError
from .repository import ModelSettings, Repository, RepositoryModel, check_config_against_model, triton_config
from .served import DEFAULT_VERSION, TIMING, ModelState, ServedModel, rows_of
from .tracing import Tracer, TraceSettings
from .statistics import (BACKEND, CANCELED, OTHER, REJECTED, ModelStatistics, ProcessSnapshot, RequestTimes,
                         Statistics, summed)

__all__ = ["InferenceService", "Call", "ServedModel", "ModelState", "DEFAULT_VERSION"]

ModelSource = Union[Model, str, "os.PathLike[str]", bytes]
SERVER_NAME = "asyncinfer"
EXTENSIONS = ["binary_tensor_data", "model_configuration", "model_repository", "statistics"]
CONTROL_MODES = ("none", "poll", "explicit")
logger = logging.getLogger(__name__)


class Siblings(Protocol):
    """The other worker processes of a multi-process server, as a service sees them
    (`.multiprocess.WorkerGroup` implements it)."""

    multiprocess_dir: str  # prometheus-client's multiprocess files

    async def catch_up(self, service: InferenceService) -> None:
        """Apply the loads, unloads and trace settings made before this process started."""

    async def serve(self, service: InferenceService) -> None:
        """Answer the siblings' questions until cancelled (after the service's drain)."""

    async def snapshots(self) -> list[ProcessSnapshot]:
        """Every other process's counters: live ones asked now, exited ones as last written."""

    async def publish(self, action: dict[str, Any]) -> None:
        """Record a load, unload or trace setting for the processes that start later."""

    async def fan_out(self, action: dict[str, Any]) -> list[tuple[int, str]]:
        """Apply ``action`` in every other live process; the failures, ``(status, message)``."""

    async def traces(self, own: dict[str, Any]) -> dict[str, Any]:
        """``own`` traces merged with every other live process's."""


class Call:
    """One inference request in flight: ``async with service.request(name) as call: ...``.

    Attributes:
        model: the loaded model (decode the request against ``model.inputs``).
        name, version: the model version serving this request.
        deadline: absolute ``anyio.current_time()`` deadline (``math.inf``: none).
        guarded: the caller enforces ``deadline`` with a cancel scope of its own around `infer`
            (the HTTP handler's one scope for the body and the run), so `infer` adds none and a
            timeout reaches the caller as a cancellation.
    """

    def __init__(self, served: ServedModel, admission: Admission, tracer: Tracer):
        assert served.model is not None
        self.model: Model = served.model
        self.name, self.version = served.name, served.version
        self.deadline = math.inf
        self.guarded = False
        self._served, self._admission, self._tracer = served, admission, tracer
        self._times = RequestTimes(total=0)
        self._rows = 0

    @property
    def served(self) -> ServedModel:
        """The model version serving this request (its worker generates: `.generation`)."""
        return self._served

    def record_run(self, rows: int, infer_ns: int) -> None:
        """Count work done outside `infer` (a generation stream): ``rows`` inferences that ran
        ``infer_ns`` nanoseconds."""
        self._rows += rows
        self._times.compute_infer += infer_ns

    @contextmanager
    def phase(self, which: str) -> Iterator[None]:
        """Time the block as ``compute_input`` (``"input"``: decoding) or ``compute_output``
        (``"output"``: encoding)."""
        if which not in ("input", "output"):
            raise ValueError(f"phase is 'input' or 'output', got {which!r}")
        began = time.perf_counter_ns()
        try:
            yield
        finally:
            spent = time.perf_counter_ns() - began
            if which == "input":
                self._times.compute_input += spent
            else:
                self._times.compute_output += spent

    async def infer(self, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """Run the model; ``{name: array}`` for ``outputs`` (default: every model output). A name
        that is not a model output asks for that (intermediate) value of the graph: such a run
        goes to the worker alone, not merged with other requests. The arrays of ``inputs`` are
        handed over (decoded for this request): the caller must not change them afterwards.

        Raises:
            ProtocolError: 400 the inputs do not fit the model, or the graph has no value of a
                name asked for; 500 the model failed on them; 503 the model was unloaded or the
                server is stopping; 504 the deadline passed (the run is cancelled; unless
                ``guarded``: then the caller's scope catches the timeout).
        """
        served = self._served
        values = outputs is not None and not served.output_names.issuperset(outputs)
        timing = RunTiming()
        token = TIMING.set(timing)
        asked = time.perf_counter_ns()
        # cancelling the run skips its layers not started; no scope when the caller has one, or no deadline
        deadline = nullcontext() if self.guarded or self.deadline == math.inf else anyio.move_on_at(self.deadline)
        try:
            with deadline as running:
                profile = self._tracer.sample(self.name)  # Triton's trace settings: this one traced?
                if values or profile is not None:  # alone on the worker, not merged into a batch
                    names = list(dict.fromkeys(outputs or ())) if values else None
                    result = await served.infer_values(inputs, names, profile=profile)
                    if profile is not None:
                        await anyio.to_thread.run_sync(self._tracer.record, self.name, self.version, profile)
                else:
                    result = await served.infer(inputs)
        except ProtocolError:
            raise
        except InputError as exc:  # shapes against the declared signature (and Limits), checked by the engine
            raise ProtocolError(400, str(exc)) from None
        except DisposedError as exc:
            raise unavailable(str(exc)) from None
        except AsyncInferError as exc:  # the model failed on this input; the server stays up
            raise ProtocolError(500, f"{type(exc).__name__}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a bug: logged, answered without its traceback
            logger.exception("inference on model %r raised %s", self.name, type(exc).__name__)
            raise ProtocolError(500, f"internal server error ({type(exc).__name__})") from None
        finally:
            TIMING.reset(token)
        if running is not None and running.cancelled_caught:
            raise self.timed_out()
        if timing.started:
            self._times.queue += max(timing.started - asked, 0)
            self._times.compute_infer += timing.ended - timing.started
        self._rows += rows_of(inputs) if served.batch_dim else 1
        if outputs is None:
            return result
        return {name: result[name] for name in outputs}

    def timed_out(self) -> ProtocolError:
        """The 504 of a request whose deadline passed while its model ran."""
        return ProtocolError(504, f"model {self.name!r} did not answer within the request timeout "
                                  f"({self._admission.request_timeout} s); the run was cancelled")


class _Slot:
    """Everything served under one model name: its versions, and its state when it has none."""

    def __init__(self, name: str):
        self.name = name
        self.versions: dict[str, ServedModel] = {}
        self.reason = ""  # why the latest load failed, or "unloaded"
        self.wanted = True  # counted by readiness (False once unloaded on purpose)
        self.lock: anyio.Lock | None = None
        self.fingerprint: object = None  # the repository files as of the latest load (poll mode)

    def ready_versions(self) -> list[ServedModel]:
        return sorted((s for s in self.versions.values() if s.state is ModelState.READY), key=_version_key)

    def latest(self) -> ServedModel | None:
        """The highest ready version, else the highest of any state."""
        if len(self.versions) == 1:  # the usual case, asked by every request
            return next(iter(self.versions.values()))
        ready = self.ready_versions()
        if ready:
            return ready[-1]
        return max(self.versions.values(), key=_version_key, default=None)


def _version_key(served: ServedModel) -> tuple[int, str]:
    return (int(served.version) if served.version.isdigit() else -1, served.version)


class _LiveModels(Mapping[str, ServedModel]):
    """``{name: latest version}`` of a service, read when looked at."""

    def __init__(self, slots: dict[str, _Slot]):
        self._slots = slots

    def _current(self) -> dict[str, ServedModel]:
        return {name: served for name, slot in self._slots.items() if (served := slot.latest()) is not None}

    def __getitem__(self, name: str) -> ServedModel:
        return self._current()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())


class InferenceService:
    """Models served by one process: lifecycle, repository, admission, statistics, metrics.

    Args:
        models: served names mapped to loaded models or anything `asyncinfer.load_model`
            takes (paths are loaded now, under ``limits``, so a bad file fails here). Each is
            served as version ``"1"``. Give ``models`` or ``repository``, not both.
        backend: the backend of every model's worker (a repository model's config may choose).
        batching: merge concurrent requests to one model with a `DynamicBatcher`.
        max_batch_size: most rows per merged run.
        max_delay: seconds a request may wait for batch-mates.
        threads: CPU thread-pool size of each worker (default: the core count).
        limits: bounds on models and requests (body bytes, JSON depth, tensor rank and elements).
        request_timeout: seconds a request may take from admission (None: no deadline).
        max_queue: most requests per model in progress at once; one more gets 503 (None: no bound).
        drain_timeout: seconds shutdown (and an unload) waits for requests in progress.
        repository: a Triton-layout model repository, ``DIR/<model>/<version>/model.onnx``.
        model_control_mode: ``"none"`` (load every repository model at startup), ``"poll"``
            (and follow the repository's changes every ``repository_poll_secs``), or
            ``"explicit"`` (load ``load_models`` at startup, the rest through `load`).
        repository_poll_secs: seconds between two scans of the repository in poll mode.
        load_models: models to load at startup in explicit mode (``"*"``: all of them).
        strict_readiness: `ready` only when every model asked for is ready (Triton's
            default); False: ready as soon as the service runs.
        freeze_heap: once started, and after each model loaded later, collect and freeze the
            Python heap (`gc.freeze`), so that the garbage collector's full passes skip what
            is loaded and no longer stall requests for tens of milliseconds; it affects the
            whole process (`asyncinfer serve`, whose process it is, sets it).
        warmup: run each model version on zeros of its declared inputs (`Worker.warmup`) before
            it is ready, for at most a few seconds: the first requests then find its threads
            started and, on the CPU backend, its run mode chosen by measurement. A model that
            zeros cannot run is served all the same (`asyncinfer serve` sets it; ``--no-warmup``).
    """

    def __init__(self, models: Mapping[str, ModelSource] | None = None, *, backend: BackendType | str = "cpu",
                 batching: bool = True, max_batch_size: int = 32, max_delay: float = 0.002,
                 threads: int | None = None, limits: Limits = DEFAULT_LIMITS, request_timeout: float | None = 60.0,
                 max_queue: int | None = 64, drain_timeout: float = 30.0,
                 repository: str | os.PathLike[str] | None = None, model_control_mode: str = "none",
                 repository_poll_secs: float = 15.0, load_models: Sequence[str] = (),
                 strict_readiness: bool = True, trace_dir: str | os.PathLike[str] | None = None,
                 freeze_heap: bool = False, warmup: bool = False):
        if not isinstance(limits, Limits):
            raise TypeError(f"limits must be an asyncinfer.Limits, got {type(limits).__name__}")
        if model_control_mode not in CONTROL_MODES:
            raise ValueError(f"model_control_mode must be one of {CONTROL_MODES}, got {model_control_mode!r}")
        if (repository is None) == (not models):
            raise ValueError("an InferenceService needs at least one model, or a model repository (not both)")
        if repository is None and model_control_mode != "none":
            raise ValueError(f"model_control_mode {model_control_mode!r} needs a model repository")
        if load_models and model_control_mode != "explicit":
            raise ValueError("load_models is for model_control_mode 'explicit' (the other modes load every model)")
        if not repository_poll_secs > 0:
            raise ValueError(f"repository_poll_secs must be a positive number, got {repository_poll_secs!r}")
        if max_batch_size < 1 or not max_delay >= 0:
            raise ValueError("max_batch_size must be >= 1 and max_delay >= 0 seconds")
        backend = BackendType(backend).value if isinstance(backend, (str, BackendType)) else backend
        self.limits = limits
        self.defaults = ModelSettings(backend=backend, dynamic_batching=batching,
                                      max_batch_size=max_batch_size if batching else 0, max_delay=max_delay,
                                      # a second run in flight needs a second thread to run at once; with
                                      # one (serve --workers 2 on 2 cores), it only splits the batches
                                      threads=threads, instances=min(2, threads or os.cpu_count() or 1),
                                      warmup=warmup)
        self.admission = Admission((), max_queue=max_queue, request_timeout=request_timeout,
                                   drain_timeout=drain_timeout)
        self.stats_store = Statistics()  # counters of every model version, kept across reloads
        self.metrics = ServerMetrics(self.stats_store, self._models_loaded, self._pending)
        self.repository = Repository(repository) if repository is not None else None
        self.model_control_mode = model_control_mode
        self.repository_poll_secs = repository_poll_secs
        self.load_models = list(load_models)
        self.strict_readiness = strict_readiness
        self.freeze_heap = freeze_heap
        self.tracer = Tracer(trace_dir)  # Triton's trace settings; traced requests' profiles
        self.siblings: Siblings | None = None  # the other worker processes, when there are (set before start)
        self._slots: dict[str, _Slot] = {}
        self.models: Mapping[str, ServedModel] = _LiveModels(self._slots)
        for name, source in (models or {}).items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ValueError(f"invalid model name {name!r}: must be non-empty without '/'")
            model = source if isinstance(source, Model) else load_model(source, limits=limits)
            slot = self._slots[name] = _Slot(name)
            slot.versions[DEFAULT_VERSION] = self._served(name, DEFAULT_VERSION, model, self.defaults)
        self._started = self._draining = self._stopped = False
        self._stack: AsyncExitStack | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._background: anyio.CancelScope | None = None  # made in __aenter__: scopes belong to a loop

    @classmethod
    def from_repository(cls, path: str | os.PathLike[str], **options: Any) -> InferenceService:
        """A service over the Triton-layout model repository at ``path`` (options as the constructor's)."""
        if not Path(path).is_dir():
            raise ModelLoadError(f"the model repository {os.fspath(path)!r} is not a directory")
        return cls(repository=path, **options)

    def _served(self, name: str, version: str, model: Model | None, settings: ModelSettings,
                reason: str = "") -> ServedModel:
        return ServedModel(name, model, settings, version=version, stats=self.stats_store.of(name, version),
                           metrics=self.metrics, reason=reason)

    # -- lifecycle ------------------------------------------------------------------------------
    async def __aenter__(self) -> InferenceService:
        if self._started:
            raise AsyncInferError("an InferenceService can be started only once")
        self._started = True
        self._stack = AsyncExitStack()
        self._background = anyio.CancelScope()
        try:
            self._tg = await self._stack.enter_async_context(anyio.create_task_group())
            self._tg.start_soon(self._background_tasks)
            for slot in self._slots.values():
                for served in slot.versions.values():
                    await self._tg.start(served.host)
            if self.repository is not None:
                for name in await self._initial_models():
                    try:
                        await self._load(name, None)
                    except ProtocolError as exc:  # reported in the index; the server still starts
                        logger.error("%s", exc.message)
            if self.siblings is not None:  # what the API changed before this process started
                await self.siblings.catch_up(self)
            self._settle_heap()
        except BaseException:
            await self._shutdown()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._shutdown()

    def _settle_heap(self, collect: bool = True) -> None:
        """With ``freeze_heap``: collect (once started), then freeze what is left (`gc.freeze`),
        so that the collector's full passes, which scan every object alive (a GPT-2 worker and
        the imported libraries: 165,000 objects, 54 ms with the GIL held), skip the models and
        workers: a request is not stalled behind one (8 generation streams: loop lag max 59 ->
        5 ms)."""
        if self.freeze_heap:
            if collect:
                gc.collect()
            gc.freeze()

    async def _shutdown(self) -> None:
        if self._stopped:
            return
        self._draining = True
        try:
            if not await self.admission.drain():
                logger.warning("shutdown: requests still in progress after drain_timeout=%s s were cancelled",
                               self.admission.drain_timeout)
        finally:
            if self._background is not None:
                self._background.cancel()
            for slot in self._slots.values():
                for served in slot.versions.values():
                    served.request_stop()
            self._stopped = True
            if self._stack is not None:
                await self._stack.aclose()  # waits for every host task: workers and batchers disposed

    async def _background_tasks(self) -> None:
        assert self._background is not None
        with self._background:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.metrics.sample_event_loop_lag)
                if self.siblings is not None:
                    tg.start_soon(self.siblings.serve, self)
                if self.model_control_mode == "poll":
                    tg.start_soon(self._poll)

    async def _initial_models(self) -> list[str]:
        assert self.repository is not None
        names = await anyio.to_thread.run_sync(self.repository.names)
        if self.model_control_mode != "explicit":
            return names
        wanted = names if "*" in self.load_models else self.load_models
        for name in wanted:
            if name not in names:
                self._slot(name).reason = "not found in the model repository"
                logger.error("--load-model %r: the model repository has no such model", name)
        return [n for n in wanted if n in names]

    # -- health and metadata --------------------------------------------------------------------
    def live(self) -> bool:
        """True while the process serves (started and not stopped)."""
        return not self._stopped

    def ready(self) -> bool:
        """Whether inference requests are taken: False before start and while draining; with
        ``strict_readiness``, also while a model asked for is not ready."""
        if not self._started or self._draining or self._stopped or self._tg is None:
            return False
        if not self.strict_readiness:
            return True
        for slot in self._slots.values():
            if slot.wanted and (not slot.versions or not all(s.ready for s in slot.versions.values())):
                return False
        return True

    def server_metadata(self) -> dict[str, Any]:
        return {"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)}

    def model_metadata(self, name: str, version: str | None = None) -> dict[str, Any]:
        """KServe v2 model metadata; ProtocolError 404 for an unknown or unloaded model."""
        served = self._loaded(name, version)
        versions = [s.version for s in sorted(self._slots[name].versions.values(), key=_version_key)
                    if s.model is not None and s.state is not ModelState.UNAVAILABLE] or [served.version]
        return served.metadata(versions)

    def model_ready(self, name: str, version: str | None = None) -> bool:
        """Whether ``name`` (``version``) takes requests; ProtocolError 404 when unknown."""
        served = self._find(name, version)
        return served is not None and served.ready and not self._draining and self._tg is not None

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """The model's configuration in Triton's JSON form (what ``GET .../config`` answers)."""
        served = self._loaded(name, version)
        assert served.model is not None
        return triton_config(name, served.model, served.settings, served.max_batch_size)

    def _find(self, name: str, version: str | None) -> ServedModel | None:
        """The version asked for (the latest when None): 404 for an unknown name or version;
        None when the model has no version at all (never loaded, or failed)."""
        slot = self._slots.get(name)
        if slot is None:
            known = sorted(self._slots)
            raise ProtocolError(404, f"unknown model {name!r}; this server has {known}")
        if version is None:
            return slot.latest()
        served = slot.versions.get(version)
        if served is None:
            available = [s.version for s in sorted(slot.versions.values(), key=_version_key)]
            raise ProtocolError(404, f"model {name!r} has no version {version!r}; available: {available}")
        return served

    def _loaded(self, name: str, version: str | None) -> ServedModel:
        served = self._find(name, version)
        if served is None or served.model is None:
            reason = (served.reason if served is not None else self._slots[name].reason) or "not loaded"
            raise ProtocolError(404, f"model {name!r} has no loaded version ({reason})")
        return served

    # -- repository -----------------------------------------------------------------------------
    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """``[{"name", "version", "state", "reason"}]`` for every model version the service knows
        (and every model of the repository, loaded or not); ``ready_only``: READY ones only."""
        index: list[dict[str, str]] = []
        for name, slot in self._slots.items():
            if not slot.versions:
                index.append({"name": name, "version": "", "state": ModelState.UNAVAILABLE.value,
                              "reason": slot.reason or "not loaded"})
            for served in sorted(slot.versions.values(), key=_version_key):
                index.append({"name": name, "version": served.version, "state": served.state.value,
                              "reason": served.reason})
        if self.repository is not None:
            for name in self.repository.names():  # a directory listing: cheap
                if name not in self._slots:
                    index.append({"name": name, "version": "", "state": ModelState.UNAVAILABLE.value,
                                  "reason": "not loaded"})
        index.sort(key=lambda e: (e["name"], int(e["version"]) if e["version"].isdigit() else -1))
        if ready_only:
            index = [e for e in index if e["state"] == ModelState.READY.value]
        return index

    async def load(self, name: str, config: dict[str, Any] | None = None, *, fan_out: bool = True) -> None:
        """Load (or reload) ``name`` from the repository (explicit model control). ``config``, in
        Triton's JSON form, replaces the model's ``config.pbtxt`` for this load. With
        `siblings`, every worker process loads it (``fan_out=False``: this one only).

        Raises:
            ProtocolError: 400 when the model control mode is not explicit or the model fails to
                load (the reason is in the message and the index; with several processes, which
                ones failed); 404 when the repository has no such model; 503 while the server stops.
        """
        self._check_explicit("load")
        assert self.repository is not None
        if not self.repository.has(name):
            raise ProtocolError(404, f"the model repository has no model {name!r}")
        if self._draining or self._tg is None:
            raise unavailable("the server is not running (starting or shutting down)")
        await self._everywhere(self._load(name, config), {"op": "load", "name": name, "config": config},
                               f"load model {name!r}", fan_out)

    async def unload(self, name: str, *, fan_out: bool = True) -> None:
        """Unload every version of ``name`` (explicit model control): new requests get 503, those
        in flight finish (up to ``drain_timeout``), then the workers are disposed. With
        `siblings`, in every worker process (``fan_out=False``: this one only)."""
        self._check_explicit("unload")
        assert self.repository is not None
        if name not in self._slots and not self.repository.has(name):
            raise ProtocolError(404, f"unknown model {name!r}")
        await self._everywhere(self._unload(name), {"op": "unload", "name": name}, f"unload model {name!r}", fan_out)

    async def update_trace(self, changes: Mapping[str, Any], model: str | None = None, *,
                           fan_out: bool = True) -> TraceSettings:
        """Apply posted trace settings (`.tracing`), in every worker process with `siblings`
        (``fan_out=False``: this one only); the settings now in force here. ProtocolError(400)
        names a bad setting (then nothing changes anywhere)."""
        settings = self.tracer.update(changes, model)
        if fan_out and self.siblings is not None:
            action = {"op": "trace", "changes": dict(changes), "model": model}
            await self.siblings.publish(action)
            failures = await self.siblings.fan_out(action)
            if failures:
                raise ProtocolError(failures[0][0], "the trace settings changed in this worker process but not in "
                                                    "every other: " + "; ".join(m for _, m in failures))
        return settings

    async def gather_traces(self) -> dict[str, Any]:
        """The latest traced requests as one Chrome/Perfetto trace (every worker process's)."""
        own = self.tracer.traces()
        return own if self.siblings is None else await self.siblings.traces(own)

    async def _everywhere(self, here: Any, action: dict[str, Any], what: str, fan_out: bool) -> None:
        """Await ``here`` (this process's part of ``action``) and, with `siblings` and
        ``fan_out``, apply ``action`` in the other processes at the same time; one error
        naming every process that failed."""
        if not fan_out or self.siblings is None:
            await here
            return
        await self.siblings.publish(action)  # first: a process starting now catches up with it
        siblings = self.siblings
        local: list[ProtocolError] = []
        failures: list[tuple[int, str]] = []

        async def run_here() -> None:
            try:
                await here
            except ProtocolError as exc:
                local.append(exc)

        async def run_there() -> None:
            failures.extend(await siblings.fan_out(action))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_here)
            tg.start_soon(run_there)
        if local:
            if not failures:
                raise local[0]
            raise ProtocolError(local[0].status, f"{local[0].message} (and in other worker processes: "
                                                 + "; ".join(m for _, m in failures) + ")", local[0].headers)
        if failures:
            raise ProtocolError(failures[0][0], f"cannot {what} in every worker process: "
                                                + "; ".join(m for _, m in failures))

    def _check_explicit(self, action: str) -> None:
        if self.repository is None:
            raise ProtocolError(400, f"cannot {action} models: this server serves a fixed set of models, "
                                     "not a model repository")
        if self.model_control_mode != "explicit":
            raise ProtocolError(400, f"cannot {action} models through the API in model control mode "
                                     f"{self.model_control_mode!r}; start the server with "
                                     "--model-control-mode explicit")

    def _slot(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = _Slot(name)
        if slot.lock is None:
            slot.lock = anyio.Lock()
        return slot

    async def _load(self, name: str, config: dict[str, Any] | None) -> None:
        """Read ``name`` from the repository, start its versions, then retire the old ones. When
        nothing new could be loaded, versions already serving stay; the reason is recorded."""
        assert self.repository is not None and self._tg is not None
        slot = self._slot(name)
        assert slot.lock is not None
        async with slot.lock:
            slot.wanted = True
            # what the files were when read: poll mode retries a failed load only once they change
            slot.fingerprint = await anyio.to_thread.run_sync(self.repository.fingerprint, name)
            try:
                entry: RepositoryModel = await anyio.to_thread.run_sync(self.repository.read, name, config,
                                                                        self.defaults)
            except ModelLoadError as exc:
                slot.reason = self._relative(str(exc))
                raise ProtocolError(400, f"failed to load model {name!r}: {slot.reason}") from None
            fresh: dict[str, ServedModel] = {}
            for version, path in entry.versions.items():
                fresh[version] = await self._load_version(name, version, path, entry)
            for served in fresh.values():
                if served.model is not None:
                    await self._tg.start(served.host)
            failures = {v: s.reason for v, s in fresh.items() if s.state is not ModelState.READY}
            if failures and len(failures) == len(fresh) and slot.ready_versions():
                slot.reason = "; ".join(f"version {v}: {r}" for v, r in failures.items())
                raise ProtocolError(400, f"failed to load model {name!r} ({slot.reason}); "
                                         "the versions loaded before keep serving")
            old, slot.versions = slot.versions, fresh
            slot.reason = ""
            for served in old.values():  # in the background: their requests in flight may finish
                self._tg.start_soon(served.stop, self.admission.drain_timeout)
            if self._tg is not None and not self._draining:
                self._settle_heap(collect=False)  # (a collection would stall the other models' requests)
            if failures:
                slot.reason = "; ".join(f"version {v}: {r}" for v, r in failures.items())
                raise ProtocolError(400, f"failed to load model {name!r}: {slot.reason}")

    async def _load_version(self, name: str, version: str, path: Path, entry: RepositoryModel) -> ServedModel:
        try:
            model = await anyio.to_thread.run_sync(lambda: load_model(path, limits=self.limits))
            check_config_against_model(entry.config, model, entry.settings, f"model {name!r} version {version}")
        except (AsyncInferError, OSError, ValueError) as exc:
            reason = self._relative(f"{type(exc).__name__}: {exc}")
            return self._served(name, version, None, entry.settings, reason=reason)
        return self._served(name, version, model, entry.settings)

    def _relative(self, message: str) -> str:
        """``message`` with the repository's location cut from its paths: clients see the index."""
        if self.repository is None:
            return message
        return message.replace(str(self.repository.root.resolve()) + os.sep, "").replace(
            str(self.repository.root) + os.sep, "")

    async def _unload(self, name: str) -> None:
        slot = self._slot(name)
        assert slot.lock is not None
        async with slot.lock:
            slot.wanted = False
            slot.reason = "unloaded"
            slot.fingerprint = None  # the same files put back are loaded again
            async with anyio.create_task_group() as tg:
                for served in slot.versions.values():
                    tg.start_soon(served.stop, self.admission.drain_timeout)

    async def _poll(self) -> None:
        """Poll mode: every ``repository_poll_secs``, load new and changed models, unload removed ones."""
        assert self.repository is not None
        while True:
            await anyio.sleep(self.repository_poll_secs)
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - a broken scan must not stop the server
                logger.exception("polling the model repository failed")

    async def poll_once(self) -> None:
        """One scan of the repository (what poll mode does periodically)."""
        assert self.repository is not None
        repository = self.repository
        names = await anyio.to_thread.run_sync(repository.names)
        for name in names:
            fingerprint = await anyio.to_thread.run_sync(repository.fingerprint, name)
            slot = self._slots.get(name)
            if slot is None or slot.fingerprint != fingerprint:
                logger.info("model repository: %s %r", "loading" if slot is None else "reloading", name)
                try:
                    await self._load(name, None)
                except ProtocolError as exc:  # retried when its files change again
                    logger.error("%s", exc.message)
        for name in [n for n, slot in self._slots.items() if n not in names and slot.wanted]:
            logger.info("model repository: %r was removed; unloading it", name)
            await self._unload(name)

    # -- statistics -----------------------------------------------------------------------------
    def statistics_for(self, name: str | None = None, version: str | None = None) -> list[ModelStatistics]:
        """The statistics objects `statistics` reports: every version the service holds
        (of ``name``; or ``version`` alone). ProtocolError 404 for an unknown model or version."""
        if name is None:
            names = sorted(self._slots)
        elif name not in self._slots:
            raise ProtocolError(404, f"unknown model {name!r}; this server has {sorted(self._slots)}")
        elif version is not None:
            self._find(name, version)  # 404 for an unknown version
            return [self.stats_store.of(name, version)]
        else:
            names = [name]
        return [self.stats_store.of(n, s.version) for n in names
                for s in sorted(self._slots[n].versions.values(), key=_version_key)]

    def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """Triton's inference statistics JSON: ``{"model_stats": [...]}`` for every served
        version (of ``name``, of ``version``) in this process; ProtocolError 404 for an unknown
        model or version. `gather_statistics` counts every worker process."""
        return {"model_stats": [s.to_json() for s in self.statistics_for(name, version)]}

    async def gather_statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        """`statistics` summed over every worker process (those that exited included): what
        ``GET /v2/models/stats`` and gRPC ``ModelStatistics`` answer."""
        local = self.statistics_for(name, version)
        if self.siblings is None:
            return {"model_stats": [s.to_json() for s in local]}
        others = await self.siblings.snapshots()
        totals = summed([local, *(other.statistics for other in others)])
        return {"model_stats": [totals[(s.name, s.version)].to_json() for s in local]}

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition of ``GET /metrics`` (every worker process's, with `siblings`)."""
        if self.siblings is None:
            return self.metrics.render()
        others = await self.siblings.snapshots()
        totals = summed([self.stats_store.all(), *(other.statistics for other in others)])
        live = [other for other in others if other.live]
        pending = dict(self._pending())
        for other in live:
            for key, count in other.pending.items():
                pending[key] = pending.get(key, 0) + count
        loaded = max([self._models_loaded(), *(other.models_loaded for other in live)])
        return self.metrics.render_processes(totals.values(), pending, loaded, self.siblings.multiprocess_dir)

    def snapshot(self) -> ProcessSnapshot:
        """This process's counters and gauges, for the other worker processes."""
        return ProcessSnapshot(os.getpid(), True, self.stats_store.all(), self._pending(), self._models_loaded())

    def _models_loaded(self) -> int:
        return sum(len(slot.ready_versions()) for slot in self._slots.values())

    def _pending(self) -> dict[tuple[str, str], int]:
        return {(s.name, s.version): s.in_flight for slot in self._slots.values() for s in slot.versions.values()}

    # -- requests -------------------------------------------------------------------------------
    @asynccontextmanager
    async def request(self, name: str, version: str | None = None) -> AsyncIterator[Call]:
        """Admit one inference request to ``name`` (``version``; default: the latest ready).

        Raises (on entry):
            ProtocolError: 404 unknown model or version; 503 with ``Retry-After`` when the model
                is not ready, its queue is full, or the server is draining.
        """
        began = time.perf_counter_ns()
        served = self._find(name, version)
        if served is None:
            reason = self._slots[name].reason or "not loaded"
            raise unavailable(f"model {name!r} is not ready ({reason})")
        if not served.ready or self._tg is None:
            if self._draining:
                raise unavailable("the server is shutting down and takes no new requests")
            served.stats.record_failure(time.perf_counter_ns() - began, REJECTED)
            raise unavailable(f"model {name!r} version {served.version} is not ready "
                              f"({served.state.value}{': ' + served.reason if served.reason else ''})")
        call = Call(served, self.admission, self.tracer)
        admission = self.admission
        try:
            scope = admission.enter(name)  # the admission inline: one context manager less per request
        except ProtocolError:
            served.stats.record_failure(time.perf_counter_ns() - began, REJECTED)
            raise
        served.hold()
        try:
            try:
                with scope:  # cancelled by the drain at shutdown
                    call.deadline = admission.deadline()
                    yield call
            finally:
                admission.leave(name, scope)
            if scope.cancelled_caught:
                raise drained()
        except BaseException as exc:
            served.stats.record_failure(time.perf_counter_ns() - began, _failure_reason(exc, True))
            raise
        else:
            call._times.total = time.perf_counter_ns() - began
            served.stats.record_success(call._rows, call._times)
        finally:
            served.release()


def _failure_reason(exc: BaseException, admitted: bool) -> str:
    """Triton's ``reason`` label of a failed request."""
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        return CANCELED
    if isinstance(exc, ProtocolError):
        if exc.status == 503:  # refused at the door; once admitted, stopped by the drain or an unload
            return CANCELED if admitted else REJECTED
        if exc.status in (408, 499, 504):  # 499: the client went away (a generation stream)
            return CANCELED
        if exc.status >= 500:
            return BACKEND
    return OTHER
