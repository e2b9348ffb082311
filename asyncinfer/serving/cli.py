"""The ``asyncinfer serve`` subcommand: serve ONNX models over the Open Inference Protocol with uvicorn.

    asyncinfer serve MODEL.onnx [NAME=OTHER.onnx ...] [--backend cpu] [--host 127.0.0.1] [--port 8000]
                     [--no-batching] [--max-batch-size 32] [--max-delay-ms 2]
                     [--max-request-bytes N] [--request-timeout 60] [--max-queue 64] [--drain-timeout 30]
                     [--model-repository DIR [--model-control-mode none|poll|explicit]
                      [--repository-poll-secs 15] [--load-model NAME ...] [--no-strict-readiness]] [--no-warmup]
                     [--grpc-port PORT] [--trace-dir DIR] [--workers N|auto]
                     [--ray [--replicas N | --autoscale MIN:MAX] [--cpus-per-replica C] [--gpus-per-replica G]]

Models are served under their file stems (``NAME=PATH`` picks another name); with no model, the
embedded digits CNN is served as ``digits``. ``--model-repository`` serves a Triton-layout
repository instead (`.repository`). ``--grpc-port`` also serves the KServe v2 gRPC API: the
HTTP and gRPC servers then run in one event loop over one `InferenceService`. ``--ray`` serves
the same protocol from replicas on Ray Serve (`.ray`, the ``ray`` extra) behind its HTTP proxy.
``--workers N`` serves from N processes (`.supervisor`, `.multiprocess`).
Starlette and uvicorn are imported only when the command runs, so the rest of the CLI works
without the ``serve`` extra.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..backends import BackendType
from ..errors import AsyncInferError
from ..limits import DEFAULT_LIMITS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_REQUEST_TIMEOUT = 60.0  # seconds; 0 on the command line: no deadline
DEFAULT_MAX_QUEUE = 64
DEFAULT_DRAIN_TIMEOUT = 30.0
DEFAULT_POLL_SECS = 15.0

if TYPE_CHECKING:
    import socket

    from .multiprocess import WorkerGroup
    from .service import InferenceService


def bounded(kind: type, low: float | None = None, high: float | None = None) -> Any:
    """An argparse ``type`` reading a finite ``kind`` (int or float) within ``[low, high]``: anything else
    is a usage error (exit status 2, one line) rather than a traceback later on."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            limits = f"from {low} to {high}" if high is not None else f"of at least {low}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: give a value {limits}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def replica_range(text: str) -> tuple[int, int]:
    """``MIN:MAX`` replicas for ``--autoscale`` (0 <= MIN <= MAX, MAX >= 1)."""
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high)) if sep else None
    except ValueError:
        bounds = None
    if bounds is None or not 0 <= bounds[0] <= bounds[1] or bounds[1] < 1:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX replicas with 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return bounds


def worker_count(text: str) -> int:
    """``--workers``: a positive integer, or ``auto`` (one per core)."""
    if text == "auto":
        return max(1, os.cpu_count() or 1)
    return bounded(int, 1)(text)


worker_count.__name__ = "int"  # argparse names the type in its messages


def add_serve_command(subparsers: Any) -> None:
    """Add the ``serve`` subcommand to the ``asyncinfer`` parser's subparsers."""
    serve = subparsers.add_parser("serve", help="serve models over the Open Inference Protocol (KServe v2 REST)")
    serve.add_argument("models", nargs="*", metavar="MODEL",
                       help="ONNX files, served under their file stem, or NAME=PATH (default: the embedded digits CNN)")
    serve.add_argument("--backend", default="cpu", choices=[b.value for b in BackendType])
    serve.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    serve.add_argument("--port", type=bounded(int, 0, 65535), default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    serve.add_argument("--no-batching", action="store_true", help="run every request on its own")
    serve.add_argument("--max-batch-size", type=bounded(int, 1), default=32, help="most rows merged into one run (default 32)")
    serve.add_argument("--max-delay-ms", type=bounded(float, 0.0), default=2.0,
                       help="how long a request may wait for batch-mates, in ms (default 2)")
    serve.add_argument("--threads", type=bounded(int, 1), default=None, help="CPU thread-pool size per model")
    serve.add_argument("--max-request-bytes", type=bounded(int, 1), default=DEFAULT_LIMITS.max_request_bytes,
                       help=f"largest request body; larger ones get 413 (default {DEFAULT_LIMITS.max_request_bytes})")
    serve.add_argument("--request-timeout", type=bounded(float, 0.0), default=DEFAULT_REQUEST_TIMEOUT,
                       help="seconds a request may take; past it 504 and the run is cancelled; 0: no deadline "
                            f"(default {DEFAULT_REQUEST_TIMEOUT:g})")
    serve.add_argument("--max-queue", type=bounded(int, 1), default=DEFAULT_MAX_QUEUE,
                       help="most requests per model in progress; more get 503 with Retry-After "
                            f"(default {DEFAULT_MAX_QUEUE})")
    serve.add_argument("--drain-timeout", type=bounded(float, 0.0), default=DEFAULT_DRAIN_TIMEOUT,
                       help="seconds shutdown waits for requests in progress before cancelling them "
                            f"(default {DEFAULT_DRAIN_TIMEOUT:g})")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--access-log", action="store_true",
                       help="log every request (off by default: a log line per request costs more CPU than "
                            "a small model's inference)")
    serve.add_argument("--model-repository", type=Path, metavar="DIR",
                       help="serve a Triton-layout model repository: DIR/<model>/<version>/model.onnx, with an "
                            "optional DIR/<model>/config.pbtxt (instead of MODEL arguments)")
    serve.add_argument("--model-control-mode", default="none", choices=["none", "poll", "explicit"],
                       help="none: load every repository model at startup; poll: also load, reload and unload "
                            "as the repository changes; explicit: load with --load-model and the load/unload API "
                            "(default none)")
    serve.add_argument("--repository-poll-secs", type=bounded(float, 0.1), default=DEFAULT_POLL_SECS,
                       help=f"seconds between two scans of the repository in poll mode (default {DEFAULT_POLL_SECS:g})")
    serve.add_argument("--load-model", action="append", default=[], metavar="NAME",
                       help="in explicit mode, a model to load at startup (repeatable; '*': all of them)")
    serve.add_argument("--no-strict-readiness", action="store_true",
                       help="report the server ready even while a model is unavailable (default: ready only when "
                            "every model is)")
    serve.add_argument("--no-warmup", action="store_true",
                       help="report a model ready as soon as it is loaded (default: after a warm-up run on zeros "
                            "of its inputs, a few seconds at most, which also chooses how its runs take their steps)")
    serve.add_argument("--grpc-port", type=bounded(int, 0, 65535), default=0,
                       help="also serve the KServe v2 gRPC API on this port (default 0: no gRPC)")
    ray = serve.add_argument_group("scale-out on Ray Serve (the 'ray' extra; see docs/scale-out.md)")
    ray.add_argument("--ray", action="store_true",
                     help="serve from replicas on Ray Serve, behind its HTTP proxy at --host/--port (connects to "
                          "the cluster of RAY_ADDRESS or `ray start`, else starts a local one)")
    scale = ray.add_mutually_exclusive_group()
    scale.add_argument("--replicas", type=bounded(int, 1), default=None, metavar="N",
                       help="with --ray: the number of replicas (default 1)")
    scale.add_argument("--autoscale", type=replica_range, default=None, metavar="MIN:MAX",
                       help="with --ray: let Ray Serve scale between MIN and MAX replicas with the load")
    ray.add_argument("--cpus-per-replica", type=bounded(float, 0.0), default=None, metavar="C",
                     help="with --ray: CPUs Ray reserves per replica (default 1; match --threads)")
    ray.add_argument("--gpus-per-replica", type=bounded(float, 0.0), default=None, metavar="G",
                     help="with --ray: GPUs Ray reserves per replica (default 0; may be fractional)")
    serve.add_argument("--workers", type=worker_count, default=1, metavar="N",
                       help="server processes sharing the port(s), each with --threads (default: cores / N) CPU "
                            "threads; 'auto': one per core (default 1). A supervisor restarts a worker that dies; "
                            "statistics, metrics, model control and trace settings cover every process")
    serve.add_argument("--trace-dir", type=Path, default=None, metavar="DIR",
                       help="folder where Triton's trace_file setting writes request traces (default: traces "
                            "are only kept in memory, at GET /v2/trace)")


def model_sources(specs: list[str]) -> dict[str, Path]:
    """``{served name: path}`` from ``PATH`` or ``NAME=PATH`` arguments; duplicate names are an error."""
    if not specs:
        from .. import assets

        return {"digits": assets.default_model_path()}
    sources: dict[str, Path] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        path = Path(rest) if sep and not Path(spec).exists() else Path(spec)
        name = name if sep and not Path(spec).exists() else path.stem
        if not name or "/" in name:
            raise AsyncInferError(f"invalid model name {name!r} in {spec!r}")
        if name in sources:
            raise AsyncInferError(f"two models would be served as {name!r} ({sources[name]} and {path}): "
                                  f"name one with NAME=PATH")
        sources[name] = path
    return sources


def run_serve(args: argparse.Namespace, *, channel: socket.socket | None = None,
              group: WorkerGroup | None = None) -> int:
    """Load the models, then serve them with uvicorn (and gRPC) until interrupted; returns the exit status.

    ``--workers N`` (N > 1) hands over to the supervisor (`.supervisor`), which runs this
    again in each worker process with the ``channel`` its HTTP connections arrive on
    (`.handoff`) and the worker's ``group``."""
    try:
        import uvicorn

        from .server import create_app
        from .service import InferenceService
    except ImportError as exc:
        print(f"asyncinfer: error: serving needs the 'serve' extra (pip install 'asyncinfer[serve]'): {exc}",
              file=sys.stderr)
        return 2
    if args.max_batch_size < 1 or args.max_delay_ms < 0:
        print("asyncinfer: error: --max-batch-size must be >= 1 and --max-delay-ms >= 0", file=sys.stderr)
        return 2
    problem = _repository_problem(args) or _ray_problem(args)
    if problem:
        print(f"asyncinfer: error: {problem}", file=sys.stderr)
        return 2
    options: dict[str, Any] = dict(
        backend=args.backend, batching=not args.no_batching, max_batch_size=args.max_batch_size,
        max_delay=args.max_delay_ms / 1000, threads=args.threads,
        limits=DEFAULT_LIMITS.replace(max_request_bytes=args.max_request_bytes),
        request_timeout=args.request_timeout or None, max_queue=args.max_queue, drain_timeout=args.drain_timeout,
        trace_dir=getattr(args, "trace_dir", None), freeze_heap=True, warmup=not getattr(args, "no_warmup", False))
    repository = getattr(args, "model_repository", None)
    if getattr(args, "ray", False):
        if getattr(args, "workers", 1) > 1:
            print("asyncinfer: error: --workers is for one machine; with --ray, Ray Serve runs the replicas "
                  "(--replicas)", file=sys.stderr)
            return 2
        return run_serve_ray(args, options)
    if getattr(args, "workers", 1) > 1 and group is None:
        from .supervisor import run_supervisor

        return run_supervisor(args, args.workers)
    try:
        if repository is not None:
            service = InferenceService.from_repository(
                repository, model_control_mode=args.model_control_mode, repository_poll_secs=args.repository_poll_secs,
                load_models=args.load_model, strict_readiness=not args.no_strict_readiness, **options)
        else:
            sources = model_sources(args.models)
            service = InferenceService(sources, strict_readiness=not getattr(args, "no_strict_readiness", False),
                                       **options)
    except AsyncInferError as exc:
        print(f"asyncinfer: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"asyncinfer: error: {exc}", file=sys.stderr)
        return 2
    base = f"http://{args.host}:{args.port}"
    if group is not None:
        service.siblings = group  # one worker of --workers N (the supervisor printed where they serve)
    elif repository is not None:
        print(f"serving the model repository {repository} (model control mode {args.model_control_mode}) "
              f"at {base}/v2", file=sys.stderr)
    else:
        for name, path in sources.items():
            print(f"serving {name!r} from {path} at {base}/v2/models/{name}", file=sys.stderr)
    grpc_port = getattr(args, "grpc_port", 0)
    # uvicorn waits for open connections before the app's own drain: bound that wait the same way.
    graceful = math.ceil(args.drain_timeout)
    if not grpc_port:
        app = create_app(service=service)
        if channel is None:
            uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                        access_log=args.access_log, timeout_graceful_shutdown=graceful)
            return 0
        from .handoff import dealt_server

        server = dealt_server(uvicorn.Config(app, log_level=args.log_level, access_log=args.access_log,
                                             timeout_graceful_shutdown=graceful), channel)
        server.run()
        return 0 if server.started else 3  # 3: uvicorn's "startup failed"
    import asyncio

    app = create_app(service=service, manage_service=False)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.access_log, timeout_graceful_shutdown=graceful)
    if channel is None:
        return asyncio.run(serve_http_and_grpc(service, uvicorn.Server(config), args.host, grpc_port,
                                               args.drain_timeout))
    from .handoff import dealt_server  # a worker of --workers N: on the group's gRPC port too

    return asyncio.run(serve_http_and_grpc(service, dealt_server(config, channel), args.host, grpc_port,
                                           args.drain_timeout, reuse_port=True))


def serve_worker(folder: str, index: str, workers: str, fd: str, supervisor: str) -> int:
    """One worker process of ``serve --workers N``: started by `.supervisor` with the group's
    folder, this worker's number, the group's size, the file descriptor of its channel (where
    the supervisor sends it connections) and the supervisor's pid; serves the options the
    supervisor saved until SIGTERM."""
    import pickle
    import socket

    from .multiprocess import WorkerGroup, die_with_parent

    die_with_parent()
    if os.getppid() != int(supervisor):
        return 1  # the supervisor died before this worker could follow it
    with open(Path(folder) / "args.pickle", "rb") as f:
        args = pickle.load(f)  # written by the supervisor, in a folder only its user can write
    group = WorkerGroup(folder, int(index), int(workers), int(supervisor))
    return run_serve(args, channel=socket.socket(fileno=int(fd)), group=group)


def run_serve_ray(args: argparse.Namespace, options: dict[str, Any]) -> int:
    """``asyncinfer serve --ray``: the same service options, on Ray Serve replicas."""
    if getattr(args, "grpc_port", 0):
        print("asyncinfer: error: --grpc-port is not available with --ray: Ray Serve's gRPC proxy cannot serve "
              "the KServe gRPC service unchanged (see docs/scale-out.md); use HTTP", file=sys.stderr)
        return 2
    try:
        from .ray import deployment, serve_forever
    except ImportError as exc:
        print(f"asyncinfer: error: --ray needs the 'ray' extra (pip install 'asyncinfer[ray]'): {exc}", file=sys.stderr)
        return 2
    scale: dict[str, Any] = {"replicas": args.replicas or 1, "autoscale": args.autoscale}
    if args.cpus_per_replica is not None:
        scale["cpus_per_replica"] = args.cpus_per_replica
    if args.gpus_per_replica is not None:
        scale["gpus_per_replica"] = args.gpus_per_replica
    repository = getattr(args, "model_repository", None)
    try:
        if repository is not None:
            app = deployment(repository=repository, model_control_mode=args.model_control_mode,
                             repository_poll_secs=args.repository_poll_secs, load_models=args.load_model,
                             strict_readiness=not args.no_strict_readiness, **scale, **options)
        else:
            app = deployment(model_sources(args.models), strict_readiness=not args.no_strict_readiness,
                             **scale, **options)
    except (AsyncInferError, ValueError) as exc:
        print(f"asyncinfer: error: {exc}", file=sys.stderr)
        return 2
    return serve_forever(app, args.host, args.port)


def _ray_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the Ray options, or None."""
    if getattr(args, "ray", False):
        return None
    given = [flag for flag, value in (("--replicas", getattr(args, "replicas", None)),
                                      ("--autoscale", getattr(args, "autoscale", None)),
                                      ("--cpus-per-replica", getattr(args, "cpus_per_replica", None)),
                                      ("--gpus-per-replica", getattr(args, "gpus_per_replica", None)))
             if value is not None]
    return f"{', '.join(given)} need(s) --ray" if given else None


def _repository_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the repository options together, or None."""
    repository = getattr(args, "model_repository", None)
    mode = getattr(args, "model_control_mode", "none")
    if repository is None:
        if mode != "none" or getattr(args, "load_model", []):
            return "--model-control-mode and --load-model need --model-repository"
        return None
    if args.models:
        return "give MODEL arguments or --model-repository, not both"
    if not Path(repository).is_dir():
        return f"--model-repository {repository}: not a directory"
    if args.load_model and mode != "explicit":
        return "--load-model is for --model-control-mode explicit (the other modes load every model)"
    return None


async def serve_http_and_grpc(service: InferenceService, http: Any, host: str, grpc_port: int,
                              drain_timeout: float, on_started: Callable[[Any], None] | None = None, *,
                              reuse_port: bool = False) -> int:
    """Serve ``service`` with the uvicorn ``http`` server and a gRPC server on ``grpc_port``, in
    this event loop, until uvicorn is told to stop (a signal); returns the exit status.
    ``on_started`` is called with the started gRPC server (its port is ``server.port``).
    ``reuse_port``: join the other worker processes of ``--workers N`` on the gRPC port."""
    from .grpc import start_grpc_server

    async with service:  # one service for both: drained, then disposed, after both servers stop
        try:
            grpc_server = await start_grpc_server(service, host, grpc_port, reuse_port=reuse_port)
        except OSError as exc:
            print(f"asyncinfer: error: {exc}", file=sys.stderr)
            return 1
        if not reuse_port:
            print(f"serving gRPC at {host}:{getattr(grpc_server, 'port', grpc_port)}", file=sys.stderr)
        if on_started is not None:
            on_started(grpc_server)
        try:
            await http.serve()
        finally:
            await grpc_server.stop(drain_timeout)
    return 0 if getattr(http, "started", True) else 1
