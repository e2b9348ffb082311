"""One Ray Serve replica: an `InferenceService` behind the same HTTP app as ``asyncinfer serve``.

`ReplicaApp` is the ASGI app a Serve ingress deployment wraps. Ray Serve runs its lifespan in
the replica, after the replica is constructed: the lifespan builds the service (loading the
models; the repository is a path every node sees), starts it, catches up with the model control
(explicit mode: the loads and unloads made through other replicas), then serves every request with
`.server.create_app` — the routes, errors and limits of a single-process server, unchanged.

Two things are added around that app:

- a load or unload answered 200 is fanned out (`.control`) before the answer leaves: the
  client learns when every live replica applied it, or which ones could not;
- the service's counters are copied into Ray's metrics every `METRICS_INTERVAL` seconds,
  tagged by Ray Serve with the application, deployment and replica.

This module imports Ray only inside the replica (``ray.serve`` calls are made at run time).
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread

from ..protocol import ProtocolError
from ..server import create_app
from ..service import InferenceService
from .control import HEARTBEAT, Action, Applied
from .proxy import send_json as _send_json

__all__ = ["ServiceSpec", "ReplicaApp"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

logger = logging.getLogger(__name__)

METRICS_INTERVAL = 5.0  # seconds between two copies of the counters into Ray's metrics
STARTUP_SYNC_TIMEOUT = 30.0  # seconds a starting replica waits for the model control
FANOUT_TIMEOUT = 60.0  # seconds a load/unload waits for the other replicas to apply it
_CONTROL_PATH = re.compile(r"^/v2/repository/models/([^/]+)/(load|unload)$")


@dataclass(frozen=True)
class ServiceSpec:
    """What each replica builds its `InferenceService` from (sent to every replica, so: paths
    and plain values, no loaded models).

    Attributes:
        models: served names mapped to ONNX paths (seen by every node) or ONNX bytes.
        repository: a Triton-layout model repository (a path every node sees), or None.
        options: keyword arguments of `InferenceService` (backend, batching, limits,
            model_control_mode, load_models, ...).
    """

    models: dict[str, str | bytes] | None = None
    repository: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def explicit(self) -> bool:
        """Whether models are loaded and unloaded through the API (then replicas follow each other)."""
        return self.repository is not None and self.options.get("model_control_mode") == "explicit"

    def build(self) -> InferenceService:
        """A new service (loads the models: call it off the event loop)."""
        if self.repository is not None:
            return InferenceService.from_repository(self.repository, **self.options)
        return InferenceService(self.models, **self.options)


class ReplicaApp:
    """The ASGI app of one replica (see the module's docstring).

    Args:
        spec: how to build the replica's service.
        control: the name of the `ModelControl` deployment in the same application (explicit
            model control), or None.
        metrics_interval: seconds between two copies of the service's counters into Ray's metrics.
    """

    def __init__(self, spec: ServiceSpec, control: str | None = None, metrics_interval: float = METRICS_INTERVAL):
        self.spec = spec
        self.control = control
        self.metrics_interval = metrics_interval
        self.service: InferenceService | None = None
        self._app: Any = None
        self._follower: _Follower | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self._app is None:  # Ray Serve sends requests only once the lifespan started; be safe
            await _send_json(send, 503, {"error": "the replica is starting"}, {"Retry-After": "1"})
        elif self._follower is not None and scope["type"] == "http" and scope["method"] == "POST" \
                and (match := _CONTROL_PATH.match(scope["path"])):
            await self._follower.fan_out(self._app, match.group(1), match.group(2), scope, receive, send)
        else:
            await self._app(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        started = False
        try:
            async with AsyncExitStack() as stack:
                service = await anyio.to_thread.run_sync(self.spec.build)
                await stack.enter_async_context(service)  # on exit: drained, then workers disposed
                tasks = await stack.enter_async_context(anyio.create_task_group())
                if self.control is not None and self.spec.explicit:
                    self._follower = await _Follower.start(service, self.control, tasks)
                tasks.start_soon(_export_metrics, service, self.metrics_interval)
                self.service = service
                self._app = create_app(service=service, manage_service=False)
                await send({"type": "lifespan.startup.complete"})
                started = True
                await receive()  # lifespan.shutdown
                tasks.cancel_scope.cancel()
        except BaseException as exc:
            if not started:
                logger.exception("the replica failed to start")
                await send({"type": "lifespan.startup.failed", "message": f"{type(exc).__name__}: {exc}"})
                return
            raise
        await send({"type": "lifespan.shutdown.complete"})


class _Follower:
    """Keeps one replica's loaded models in step with the application's `ModelControl`."""

    def __init__(self, service: InferenceService, handle: Any, replica: str):
        self.service, self.handle, self.replica = service, handle, replica
        self.epoch = ""
        self.applied: dict[str, Applied] = {}
        self.lock = anyio.Lock()  # one apply at a time: the sync loop's, or a request's

    @classmethod
    async def start(cls, service: InferenceService, control: str, tasks: anyio.abc.TaskGroup) -> _Follower:
        from ray import serve

        context = serve.get_replica_context()
        replica_id = getattr(context, "replica_id", None)
        replica = getattr(replica_id, "unique_id", None) or str(getattr(context, "replica_tag", os.getpid()))
        follower = cls(service, serve.get_deployment_handle(control, app_name=context.app_name), replica)
        with anyio.move_on_after(STARTUP_SYNC_TIMEOUT) as waited:  # catch up before taking traffic
            try:
                await follower.sync_once(wait=0)
            except Exception as exc:  # noqa: BLE001 - Ray's errors; the loop retries
                logger.warning("model control not reachable at startup (%s); following it later", exc)
        if waited.cancelled_caught:
            logger.warning("model control did not answer within %s s at startup; following it later",
                           STARTUP_SYNC_TIMEOUT)
        tasks.start_soon(follower.follow)
        return follower

    async def follow(self) -> None:
        """Forever: long-poll the control and apply what it says."""
        while True:
            try:
                await self.sync_once(wait=HEARTBEAT)
            except Exception as exc:  # noqa: BLE001 - the control restarting: Ray's errors, retried
                logger.warning("model control: %s; retrying", exc)
                await anyio.sleep(1.0)

    async def sync_once(self, wait: float) -> None:
        epoch, desired = await self.handle.sync.remote(self.replica, self.epoch, dict(self.applied), wait)
        async with self.lock:
            fresh = epoch != self.epoch  # the control (re)started: apply only what differs
            self.epoch = epoch
            for name, action in desired.items():
                mine = self.applied.get(name)
                if mine is not None and (mine["token"] == action["token"] or
                                         (fresh and (mine["action"], mine["config"]) ==
                                          (action["action"], action["config"]))):
                    if mine["token"] != action["token"]:
                        self.applied[name] = {**action, "error": mine["error"]}
                    continue
                self.applied[name] = {**action, "error": await self._apply(name, action)}

    async def _apply(self, name: str, action: Action) -> str:
        """Apply one action to this replica's service; "" or why it failed."""
        try:
            if action["action"] == "load":
                await self.service.load(name, json.loads(action["config"]) if action["config"] else None)
            else:
                await self.service.unload(name)
        except ProtocolError as exc:
            logger.error("applying %s of model %r: %s", action["action"], name, exc.message)
            return exc.message
        return ""

    async def fan_out(self, app: Any, name: str, action: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a load/unload with this replica's app; once it succeeded here, publish it and
        answer when every live replica applied it (or with the replicas that failed)."""
        body = bytearray()

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
            return message

        held: list[Message] = []

        async def holding_send(message: Message) -> None:
            held.append(message)

        async with self.lock:
            await app(scope, recording_receive, holding_send)
            status = next((m["status"] for m in held if m["type"] == "http.response.start"), 500)
            if status != 200:
                for message in held:
                    await send(message)
                return
            config = _config_of(bytes(body)) if action == "load" else None
            try:
                token = await self.handle.publish.remote(self.replica, name, action, config)
            except Exception as exc:  # noqa: BLE001 - Ray's errors: the control is restarting
                await _send_json(send, 503, {"error": f"model {name!r} was {action}ed on this replica only: the "
                                                      f"model control is unreachable ({type(exc).__name__}); "
                                                      "send the request again"}, {"Retry-After": "1"})
                return
            self.applied[name] = {"action": action, "config": config, "token": token, "error": ""}
        try:
            outcome = await self.handle.wait_applied.remote(name, token, FANOUT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the replicas follow the recorded action without it
            outcome = {"replicas": 0, "failed": {}, "missing": [f"unknown ({type(exc).__name__})"]}
        problem = _fan_out_problem(name, action, outcome)
        if problem is None:
            for message in held:
                await send(message)
        else:
            status, text = problem
            await _send_json(send, status, {"error": text})


def _config_of(body: bytes) -> str | None:
    """The ``config`` parameter of a load request the app accepted (so the JSON is valid)."""
    if not body.strip():
        return None
    config = json.loads(body).get("parameters", {}).get("config")
    if config is None:
        return None
    return config if isinstance(config, str) else json.dumps(config)


def _fan_out_problem(name: str, action: str, outcome: dict[str, Any]) -> tuple[int, str] | None:
    failed, missing = outcome["failed"], outcome["missing"]
    if not failed and not missing:
        return None
    parts = [f"replica {replica}: {error}" for replica, error in sorted(failed.items())]
    if missing:
        parts.append(f"{len(missing)} replica(s) did not apply it within {FANOUT_TIMEOUT:g} s "
                     f"({', '.join(missing)}); they will when they can")
    verb = "loaded" if action == "load" else "unloaded"
    return (500 if failed else 504,
            f"model {name!r} was {verb} on this replica but not on {len(failed) + len(missing)} of "
            f"{outcome['replicas']} replicas: " + "; ".join(parts))


# -- Ray metrics ----------------------------------------------------------------------------------
_COUNTERS = {  # Ray metric name -> (help, value read from a ModelStatistics)
    "asyncinfer_request_success": ("Successful inference requests", lambda s: s.success.count),
    "asyncinfer_inference_count": ("Inferences performed (rows of the batch dimension)", lambda s: s.inference_count),
    "asyncinfer_exec_count": ("Model executions (a merged batch is one)", lambda s: s.execution_count),
    "asyncinfer_request_duration_us": ("Cumulative duration of successful requests, us",
                                       lambda s: s.success.ns // 1000),
    "asyncinfer_queue_duration_us": ("Cumulative time requests waited for their run, us",
                                     lambda s: s.queue.ns // 1000),
    "asyncinfer_compute_infer_duration_us": ("Cumulative time of the runs, us", lambda s: s.compute_infer.ns // 1000),
}


async def _export_metrics(service: InferenceService, interval: float = METRICS_INTERVAL) -> None:
    """Forever: copy the service's counters into Ray's metrics (Ray Serve adds the application,
    deployment and replica tags), so one Prometheus scrape of Ray sees every replica."""
    from ray.serve import metrics

    counters = {name: metrics.Counter(name, description=text, tag_keys=("model", "version"))
                for name, (text, _) in _COUNTERS.items()}
    failures = metrics.Counter("asyncinfer_request_failure", description="Failed inference requests",
                               tag_keys=("model", "version", "reason"))
    pending = metrics.Gauge("asyncinfer_pending_request_count", description="Requests in progress",
                            tag_keys=("model", "version"))
    sent: dict[tuple[str, ...], float] = {}

    def add(counter: Any, key: tuple[str, ...], tags: dict[str, str], value: float) -> None:
        delta = value - sent.get(key, 0)
        if delta > 0:
            counter.inc(delta, tags=tags)
            sent[key] = value

    while True:
        try:
            for stats in service.stats_store.all():
                tags = {"model": stats.name, "version": stats.version}
                for name, (_, read) in _COUNTERS.items():
                    add(counters[name], (name, stats.name, stats.version), tags, read(stats))
                for reason, count in stats.failures.items():
                    add(failures, ("failure", stats.name, stats.version, reason), {**tags, "reason": reason}, count)
            for served in list(service.models.values()):  # the latest version of each model
                pending.set(served.in_flight, tags={"model": served.name, "version": served.version})
        except Exception:  # noqa: BLE001 - metrics must never take the replica down
            logger.exception("copying the counters into Ray's metrics failed")
        await anyio.sleep(interval)
