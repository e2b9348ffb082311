"""Serving: dynamic batching of concurrent requests, and an inference server speaking the Open
Inference Protocol (KServe v2) with Triton's extensions, over HTTP (and gRPC).

``DynamicBatcher`` needs nothing beyond asyncinfer's own dependencies. ``InferenceService`` (the
models, admission, statistics, metrics, a model repository) needs the ``serve`` extra's
prometheus-client; ``create_app`` (the HTTP adapter) needs Starlette, and uvicorn to run it. Both
are imported on first use.
"""
from __future__ import annotations

from typing import Any

from .batching import BatcherStats, DynamicBatcher

__all__ = ["BatcherStats", "DynamicBatcher", "InferenceService", "create_app"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the batcher (or the CLI) must not require the serve extra.
    if name == "create_app":
        from .server import create_app

        return create_app
    if name == "InferenceService":
        from .service import InferenceService

        return InferenceService
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
