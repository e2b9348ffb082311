"""The ``asyncinfer serve`` subcommand: serve ONNX models over the Open Inference Protocol with uvicorn.

    asyncinfer serve MODEL.onnx [NAME=OTHER.onnx ...] [--backend cpu] [--host 127.0.0.1] [--port 8000]
                     [--no-batching] [--max-batch-size 32] [--max-delay-ms 2]
                     [--max-request-bytes N] [--request-timeout 60] [--max-queue 64] [--drain-timeout 30]

Models are served under their file stems (``NAME=PATH`` picks another name); with no model, the
embedded digits CNN is served as ``digits``. Starlette and uvicorn are imported only when the
command runs, so the rest of the CLI works without the ``serve`` extra.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from ..backends import BackendType
from ..errors import AsyncInferError
from ..limits import DEFAULT_LIMITS

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_REQUEST_TIMEOUT = 60.0  # seconds; 0 on the command line: no deadline
DEFAULT_MAX_QUEUE = 64
DEFAULT_DRAIN_TIMEOUT = 30.0


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


def run_serve(args: argparse.Namespace) -> int:
    """Load the models, then serve them with uvicorn until interrupted; returns the exit status."""
    try:
        import uvicorn

        from .server import create_app
    except ImportError as exc:
        print(f"asyncinfer: error: serving needs the 'serve' extra (pip install 'asyncinfer[serve]'): {exc}",
              file=sys.stderr)
        return 2
    if args.max_batch_size < 1 or args.max_delay_ms < 0:
        print("asyncinfer: error: --max-batch-size must be >= 1 and --max-delay-ms >= 0", file=sys.stderr)
        return 2
    try:
        sources = model_sources(args.models)
        app = create_app(sources, backend=args.backend, batching=not args.no_batching,
                         max_batch_size=args.max_batch_size, max_delay=args.max_delay_ms / 1000,
                         threads=args.threads, limits=DEFAULT_LIMITS.replace(max_request_bytes=args.max_request_bytes),
                         request_timeout=args.request_timeout or None, max_queue=args.max_queue,
                         drain_timeout=args.drain_timeout)
    except AsyncInferError as exc:
        print(f"asyncinfer: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    for name, path in sources.items():
        print(f"serving {name!r} from {path} at http://{args.host}:{args.port}/v2/models/{name}", file=sys.stderr)
    # uvicorn waits for open connections before the app's own drain: bound that wait the same way.
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=math.ceil(args.drain_timeout))
    return 0
