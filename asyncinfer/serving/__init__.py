"""Serving: dynamic batching of concurrent requests and an Open Inference Protocol (KServe v2) server.

``DynamicBatcher`` needs nothing beyond asyncinfer's own dependencies; ``create_app`` needs the
``serve`` extra (Starlette, and uvicorn to run it) and is imported on first use.
"""
from __future__ import annotations

from typing import Any

from .batching import BatcherStats, DynamicBatcher

__all__ = ["BatcherStats", "DynamicBatcher", "create_app"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the batcher (or the CLI) must not require Starlette.
    if name == "create_app":
        from .server import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
