"""An Open Inference Protocol (KServe v2 REST) server for asyncinfer models, as a Starlette app.

``create_app({"digits": "digits.onnx", ...})`` returns an ASGI app; run it with any ASGI server
(``asyncinfer serve`` uses uvicorn). Workers (and batchers) are created at startup and disposed at
shutdown through the app's lifespan. Handlers await the engine, so the event loop never blocks.

Endpoints (each model path also in the ``/v2/models/{name}/versions/{version}/...`` form):

====================================  ==========================================================
``GET  /v2/health/live``              200 while the process serves
``GET  /v2/health/ready``             200 once every model's worker is up (503 before)
``GET  /v2``                          server metadata: name, version, extensions
``GET  /v2/models/{name}``            model metadata: inputs and outputs (shape -1: symbolic dim)
``GET  /v2/models/{name}/ready``      200 when the model can infer
``POST /v2/models/{name}/infer``      inference: JSON tensors or the binary tensor data extension
====================================  ==========================================================

Errors are ``{"error": "..."}``: 404 for an unknown model or version, 400 for a bad request.
"""
from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Union

import anyio.to_thread
import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .. import __version__
from ..backends import BackendType
from ..errors import AsyncInferError, DisposedError, InputError
from ..model.ir import Model
from ..loader import load_model
from ..runtime.worker import Worker
from .batching import DynamicBatcher
from .protocol import (
    InferRequest,
    ProtocolError,
    encode_infer_response,
    parse_infer_request,
    tensor_metadata,
)

ModelSource = Union[Model, str, "os.PathLike[str]", bytes]
SERVER_NAME = "asyncinfer"
MODEL_VERSION = "1"  # one version per served model
EXTENSIONS = ["binary_tensor_data"]
# Bodies larger than this are decoded/encoded on a worker thread, so the loop stays responsive.
OFFLOAD_BYTES = 1 << 20


class ServedModel:
    """One model behind the server: its worker (and batcher) exist between startup and shutdown."""

    def __init__(self, name: str, model: Model, backend: BackendType | str, batching: bool,
                 max_batch_size: int, max_delay: float, threads: int | None):
        self.name, self.model = name, model
        self.backend, self.threads = backend, threads
        self.batching, self.max_batch_size, self.max_delay = batching, max_batch_size, max_delay
        self.worker: Worker | None = None
        self.batcher: DynamicBatcher | None = None
        self.metadata = {
            "name": name,
            "versions": [MODEL_VERSION],
            "platform": "onnx",
            "inputs": [tensor_metadata(i) for i in model.inputs],
            "outputs": [tensor_metadata(o) for o in model.outputs],
        }

    @property
    def ready(self) -> bool:
        return self.worker is not None and not self.worker.disposed

    async def start(self, stack: AsyncExitStack) -> None:
        """Build the worker (and enter the batcher); ``stack`` disposes them at shutdown."""
        self.worker = Worker(self.model, self.backend, threads=self.threads)
        stack.push_async_callback(self.worker.dispose_async)
        if self.batching:
            batcher = DynamicBatcher(self.worker, max_batch_size=self.max_batch_size, max_delay=self.max_delay)
            self.batcher = await stack.enter_async_context(batcher)

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.batcher is not None:
            return await self.batcher.infer(inputs)
        if self.worker is None:
            raise DisposedError(f"model {self.name!r} is not loaded (server starting or stopping)")
        return await self.worker.run(inputs)


def create_app(models: Mapping[str, ModelSource], backend: BackendType | str = "cpu", batching: bool = True,
               max_batch_size: int = 32, max_delay: float = 0.002, *, threads: int | None = None) -> Starlette:
    """An ASGI app serving ``models`` (``{name: Model or path}``) over the Open Inference Protocol.

    Args:
        models: served names mapped to loaded models or anything :func:`asyncinfer.load_model`
            takes (a path, bytes, an ``onnx.ModelProto``). Paths are loaded now, so a bad file
            fails here rather than at the first request.
        backend: the backend every model's worker runs on.
        batching: merge concurrent requests to one model with a :class:`DynamicBatcher`.
        max_batch_size: most rows per merged run.
        max_delay: seconds a request may wait for batch-mates.
        threads: CPU thread-pool size of each worker (default: the core count).
    """
    if not models:
        raise ValueError("create_app needs at least one model")
    served: dict[str, ServedModel] = {}
    for name, source in models.items():
        if not name or "/" in name:
            raise ValueError(f"invalid model name {name!r}: must be non-empty without '/'")
        model = source if isinstance(source, Model) else load_model(source)
        served[name] = ServedModel(name, model, backend, batching, max_batch_size, max_delay, threads)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            for entry in served.values():
                await entry.start(stack)
            app.state.ready = True
            try:
                yield
            finally:
                app.state.ready = False

    routes = [
        Route("/v2/health/live", _live, methods=["GET"]),
        Route("/v2/health/ready", _ready, methods=["GET"]),
        Route("/v2", _server_metadata, methods=["GET"]),
    ]
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            Route(prefix, _model_metadata, methods=["GET"]),
            Route(prefix + "/ready", _model_ready, methods=["GET"]),
            Route(prefix + "/infer", _infer, methods=["POST"]),
        ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ProtocolError: _protocol_error, HTTPException: _http_error})
    app.state.models = served
    app.state.ready = False
    return app


# -- handlers -------------------------------------------------------------------------------------
def _json(content: Any, status: int = 200) -> Response:
    return Response(json.dumps(content, separators=(",", ":")), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return _json({"error": message}, status)


async def _protocol_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProtocolError)
    return _error(exc.status, exc.message)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _error(404, f"no such endpoint: {request.method} {request.url.path}")
    if exc.status_code == 405:
        return _error(405, f"{request.method} is not allowed on {request.url.path}")
    return _error(exc.status_code, str(exc.detail))


async def _live(request: Request) -> Response:
    return _json({"live": True})


async def _ready(request: Request) -> Response:
    models: dict[str, ServedModel] = request.app.state.models
    ready = bool(request.app.state.ready) and all(m.ready for m in models.values())
    return _json({"ready": ready}, 200 if ready else 503)


async def _server_metadata(request: Request) -> Response:
    return _json({"name": SERVER_NAME, "version": __version__, "extensions": EXTENSIONS})


def _lookup(request: Request) -> ServedModel:
    """The model named in the path (and its version, when given); 404 otherwise."""
    models: dict[str, ServedModel] = request.app.state.models
    name = request.path_params["name"]
    entry = models.get(name)
    if entry is None:
        raise ProtocolError(404, f"unknown model {name!r}; this server has {sorted(models)}")
    version = request.path_params.get("version")
    if version is not None and version != MODEL_VERSION:
        raise ProtocolError(404, f"model {name!r} has no version {version!r}; available: [{MODEL_VERSION!r}]")
    return entry


async def _model_metadata(request: Request) -> Response:
    return _json(_lookup(request).metadata)


async def _model_ready(request: Request) -> Response:
    entry = _lookup(request)
    return _json({"name": entry.name, "ready": entry.ready}, 200 if entry.ready else 503)


async def _infer(request: Request) -> Response:
    entry = _lookup(request)
    body = await request.body()
    header_length = request.headers.get("inference-header-content-length")
    parsed: InferRequest = await _maybe_offload(len(body), parse_infer_request, body, header_length,
                                               entry.model, entry.name)
    try:
        outputs = await entry.infer(parsed.inputs)
    except InputError as exc:  # shapes against the declared signature, checked by the engine
        raise ProtocolError(400, str(exc)) from None
    except DisposedError as exc:
        raise ProtocolError(503, str(exc)) from None
    except AsyncInferError as exc:  # the model failed on this input; the server stays up
        raise ProtocolError(500, f"{type(exc).__name__}: {exc}") from None
    size = sum(a.nbytes for a in outputs.values())
    content, headers = await _maybe_offload(size, encode_infer_response, entry.name, MODEL_VERSION, parsed, outputs)
    return Response(content, headers=headers)


async def _maybe_offload(size: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a worker thread for large payloads, inline for small ones."""
    if size > OFFLOAD_BYTES:
        return await anyio.to_thread.run_sync(fn, *args)
    return fn(*args)
