"""Scale-out on Ray Serve: the models and protocol of ``asyncinfer serve``, on many replicas.

``deployment(...)`` returns a Ray Serve application. Each replica holds an `InferenceService`
(any backend, with its dynamic batcher) behind the very HTTP app of ``asyncinfer serve``
(`..server.create_app`), so requests entering through Ray Serve's HTTP proxy speak the same
KServe v2 / Triton protocol and clients do not change::

    import ray
    from ray import serve
    from asyncinfer.serving.ray import deployment

    ray.init()
    serve.start(http_options={"host": "0.0.0.0", "port": 8000})
    serve.run(deployment(repository="/shared/models", model_control_mode="explicit",
                         load_models=["*"], replicas=4), name="asyncinfer", route_prefix="/")

Ray Serve routes, scales (``autoscale=(min, max)``) and restarts replicas. A model repository is
a path every node sees; in explicit model control, a load or unload sent to one replica is
applied by every replica, and by replicas started later (`.control`). Each replica's counters
go to Ray's metrics, tagged by replica; ``GET /metrics`` answers for the replica that takes it.
See docs/scale-out.md.

This is the only part of asyncinfer that imports Ray (install the ``ray`` extra).
"""
from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ray import serve

from ...errors import ModelLoadError
from ..service import InferenceService
from . import proxy
from .control import ModelControl
from .replica import METRICS_INTERVAL, ReplicaApp, ServiceSpec

__all__ = ["deployment", "app_builder", "serve_forever", "ModelControl", "ReplicaApp", "ServiceSpec",
           "CONTROL_DEPLOYMENT"]

DEPLOYMENT_NAME = "asyncinfer"
CONTROL_DEPLOYMENT = "asyncinfer-model-control"
DEFAULT_MAX_ONGOING_REQUESTS = 256
_SERVICE_OPTIONS = set(inspect.signature(InferenceService.__init__).parameters) - {"self", "models", "repository"}


class AsyncinferReplica:
    """The Serve deployment class: its HTTP traffic goes to `ReplicaApp` (the ingress)."""

    def __init__(self, control: Any = None):
        # ``control``: the handle of the model control deployment (bound so Serve deploys it with
        # the application); the replica's app finds it by name.
        self._control = control

    def replica_info(self) -> dict[str, Any]:
        """This replica, for operators and tests (a handle call reaches one replica): its process
        id and host, its repository index (``models``), its statistics in Triton's JSON form,
        and its requests in progress per model (``in_flight``). Empty before the replica started."""
        info: dict[str, Any] = {"pid": os.getpid(), "host": os.uname().nodename, "models": [],
                                "statistics": {"model_stats": []}, "in_flight": {}}
        service = getattr(getattr(self, "app", None), "service", None)  # the ReplicaApp's, once started
        if service is not None:
            if service.repository is not None:
                info["models"] = service.repository_index()
            info["statistics"] = service.statistics()
            info["in_flight"] = {name: served.in_flight for name, served in service.models.items()}
        return info


def deployment(models: Mapping[str, str | os.PathLike[str] | bytes] | None = None, *,
               repository: str | os.PathLike[str] | None = None, replicas: int = 1,
               autoscale: tuple[int, int] | None = None, cpus_per_replica: float = 1.0,
               gpus_per_replica: float = 0.0, max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS,
               name: str = DEPLOYMENT_NAME, metrics_interval: float = METRICS_INTERVAL,
               **service_options: Any) -> serve.Application:
    """A Ray Serve application serving ``models`` (or ``repository``) from every replica.

    Args:
        models: served names mapped to ONNX files (paths every node can read) or ONNX bytes.
        repository: a Triton-layout model repository instead (a path every node can read).
        replicas: the number of replicas (ignored with ``autoscale``).
        autoscale: ``(min, max)`` replicas: Ray Serve adds and removes replicas with the load.
        cpus_per_replica: CPUs Ray reserves for each replica (give ``threads`` to match).
        gpus_per_replica: GPUs Ray reserves for each replica (a GPU backend needs one; may be
            fractional to share a GPU).
        max_ongoing_requests: requests Ray Serve sends one replica at once; the service's own
            ``max_queue`` (per model) then answers 503 beyond its bound, as a single server does.
        name: the deployment's name.
        metrics_interval: seconds between two copies of each replica's counters into Ray's
            metrics (Ray exports them on its own period, 10 s by default).
        **service_options: `InferenceService` options, the same on every replica: ``backend``,
            ``batching``, ``max_batch_size``, ``max_delay``, ``threads``, ``limits``,
            ``request_timeout``, ``max_queue``, ``drain_timeout``, ``model_control_mode``,
            ``load_models``, ``repository_poll_secs``, ``strict_readiness``, ``trace_dir``.

    Raises:
        ValueError: a bad option (unknown name, replica counts out of range, models and a
            repository both or neither).
        ModelLoadError: a model file or the repository does not exist here (the driver checks
            what it can before any replica starts).
    """
    unknown = set(service_options) - _SERVICE_OPTIONS
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)}; InferenceService takes {sorted(_SERVICE_OPTIONS)}")
    if (repository is None) == (not models):
        raise ValueError("give models or a repository (not both)")
    if autoscale is not None:
        low, high = autoscale
        if not 0 <= low <= high or high < 1:
            raise ValueError(f"autoscale is (min, max) with 0 <= min <= max and max >= 1, got {autoscale!r}")
    elif replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas!r}")
    if cpus_per_replica < 0 or gpus_per_replica < 0 or max_ongoing_requests < 1 or not metrics_interval > 0:
        raise ValueError("cpus_per_replica and gpus_per_replica must be >= 0, max_ongoing_requests >= 1, "
                         "metrics_interval > 0")
    sources: dict[str, str | bytes] | None = None
    if models:
        sources = {}
        for served, source in models.items():
            if isinstance(source, bytes):
                sources[served] = source
            elif isinstance(source, (str, os.PathLike)):
                path = Path(source).absolute()  # replicas do not share the driver's working directory
                if not path.is_file():
                    raise ModelLoadError(f"model {served!r}: no such file {os.fspath(source)!r}")
                sources[served] = os.fspath(path)
            else:
                raise ValueError(f"model {served!r}: give a path or ONNX bytes (each replica loads its own "
                                 f"copy), not a {type(source).__name__}")
    root = None
    if repository is not None:
        root = Path(repository).absolute()
        if not root.is_dir():
            raise ModelLoadError(f"the model repository {os.fspath(repository)!r} is not a directory")
    spec = ServiceSpec(models=sources, repository=os.fspath(root) if root else None, options=dict(service_options))
    control = CONTROL_DEPLOYMENT if spec.explicit else None
    ingress = serve.ingress(ReplicaApp(spec, control, metrics_interval))(AsyncinferReplica)
    actor_options: dict[str, Any] = {"num_cpus": cpus_per_replica}
    if gpus_per_replica:
        actor_options["num_gpus"] = gpus_per_replica
    options: dict[str, Any] = dict(name=name, ray_actor_options=actor_options,
                                   max_ongoing_requests=max_ongoing_requests,
                                   # the replica drains its requests before it stops
                                   graceful_shutdown_timeout_s=float(service_options.get("drain_timeout", 30.0)) + 5)
    if autoscale is not None:
        options["autoscaling_config"] = {"min_replicas": autoscale[0], "max_replicas": autoscale[1],
                                         "initial_replicas": max(autoscale[0], 1)}
    else:
        options["num_replicas"] = replicas
    replica_deployment = serve.deployment(ingress, **options)
    if control is None:
        return replica_deployment.bind()
    control_deployment = serve.deployment(ModelControl, name=control, num_replicas=1,
                                          max_ongoing_requests=100_000,  # every replica long-polls it
                                          ray_actor_options={"num_cpus": 0})
    return replica_deployment.bind(control_deployment.bind())


def app_builder(args: dict[str, Any]) -> serve.Application:
    """An application builder for Ray Serve's config files (``serve run``, ``serve deploy``, KubeRay's
    ``serveConfigV2``): ``import_path: asyncinfer.serving.ray:app_builder`` with ``args`` the
    keyword arguments of `deployment` (``autoscale`` as ``[min, max]``; ``models`` as
    ``{name: path}``)."""
    options = dict(args)
    if options.get("autoscale") is not None:
        options["autoscale"] = tuple(options["autoscale"])
    return deployment(**options)


def serve_forever(app: serve.Application, host: str, port: int, *, address: str | None = None,
                  app_name: str = DEPLOYMENT_NAME) -> int:
    """Connect to (or start) a Ray cluster, serve ``app`` on Ray Serve's HTTP proxy at
    ``host:port`` (route prefix ``/``), and block until interrupted; then delete the
    application. Returns the exit status.

    A cluster that is already running (``address``, ``RAY_ADDRESS``, ``ray start``) keeps its
    own proxy settings: set ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` there (`.proxy`)."""
    import ray

    if address is None and not os.environ.get("RAY_ADDRESS"):
        # a local cluster started here inherits this: its proxy retries requests of a lost replica
        os.environ.setdefault(proxy.ENV_VAR, proxy.IMPORT_PATH)
    ray.init(address=address, ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=app_name, route_prefix="/")
    # after ray.init, which installs a SIGTERM handler of its own that exits at once
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"serving on Ray Serve at http://{host}:{port}/v2 (application {app_name!r}); Ctrl-C stops",
          file=sys.stderr)
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    serve.delete(app_name)  # each replica drains its requests, then stops
    return 0
