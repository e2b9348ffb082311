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

Every request is untrusted; every error is ``{"error": "..."}`` and the server stays up:

=====  =========================================================================================
400    a malformed request: bad JSON, JSON nested deeper than ``Limits.max_json_depth``, a shape
       that is not a list of non-negative integers, a rank over ``Limits.max_tensor_rank``, more
       elements than ``Limits.max_tensor_elements``, data that does not fit its shape, inputs
       that do not fit the model (the engine's ``InputError``)
404    an unknown model, version or endpoint (405: a wrong method)
408    the body did not arrive within ``request_timeout``
413    a body over ``Limits.max_request_bytes`` (by ``Content-Length`` before reading, or while
       reading a body sent without one)
500    the model failed on this input (``ExecutionError``), or a server bug (logged)
503    with ``Retry-After``: the model already has ``max_queue`` requests in progress, or the
       server is shutting down
504    inference did not finish within ``request_timeout`` (the run is cancelled)
=====  =========================================================================================

At shutdown the server drains: new inference requests get 503 and readiness 503, requests in
progress get up to ``drain_timeout`` seconds to finish, then the workers are disposed
(:mod:`.admission`).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Union

import anyio
import anyio.to_thread
import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from .. import __version__
from ..backends import BackendType
from ..errors import AsyncInferError, DisposedError, InputError, RequestTooLargeError
from ..limits import DEFAULT_LIMITS, Limits
from ..model.ir import Model
from ..loader import load_model
from ..runtime.worker import Worker
from .admission import Admission, unavailable
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
logger = logging.getLogger(__name__)


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
               max_batch_size: int = 32, max_delay: float = 0.002, *, threads: int | None = None,
               limits: Limits = DEFAULT_LIMITS, request_timeout: float | None = 60.0, max_queue: int | None = 64,
               drain_timeout: float = 30.0) -> Starlette:
    """An ASGI app serving ``models`` (``{name: Model or path}``) over the Open Inference Protocol.

    Args:
        models: served names mapped to loaded models or anything :func:`asyncinfer.load_model`
            takes (a path, bytes, an ``onnx.ModelProto``). Paths are loaded now (under
            ``limits``), so a bad file fails here rather than at the first request.
        backend: the backend every model's worker runs on.
        batching: merge concurrent requests to one model with a :class:`DynamicBatcher`.
        max_batch_size: most rows per merged run.
        max_delay: seconds a request may wait for batch-mates.
        threads: CPU thread-pool size of each worker (default: the core count).
        limits: bounds on requests: body bytes (413 above), JSON depth, tensor rank and elements
            (400 above).
        request_timeout: seconds a request may take from admission to its result (408 while the
            body arrives, 504 while inference runs, which is then cancelled); None: no deadline.
        max_queue: most inference requests per model in progress at once (received, queued or
            running); one more gets 503 with ``Retry-After`` at once. None: no bound.
        drain_timeout: seconds shutdown waits for requests in progress before cancelling them.
    """
    if not models:
        raise ValueError("create_app needs at least one model")
    if not isinstance(limits, Limits):
        raise TypeError(f"limits must be an asyncinfer.Limits, got {type(limits).__name__}")
    served: dict[str, ServedModel] = {}
    for name, source in models.items():
        if not name or "/" in name:
            raise ValueError(f"invalid model name {name!r}: must be non-empty without '/'")
        model = source if isinstance(source, Model) else load_model(source, limits=limits)
        served[name] = ServedModel(name, model, backend, batching, max_batch_size, max_delay, threads)
    admission = Admission(served, max_queue=max_queue, request_timeout=request_timeout, drain_timeout=drain_timeout)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:  # on exit: workers (and batchers) disposed
            for entry in served.values():
                await entry.start(stack)
            app.state.ready = True
            try:
                yield
            finally:
                app.state.ready = False
                if not await admission.drain():
                    logger.warning("shutdown: requests still in progress after drain_timeout=%s s were cancelled",
                                   admission.drain_timeout)

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
                    exception_handlers={ProtocolError: _protocol_error, HTTPException: _http_error,
                                        Exception: _internal_error})
    app.state.models = served
    app.state.limits = limits
    app.state.admission = admission
    app.state.ready = False
    return app


# -- handlers -------------------------------------------------------------------------------------
def _json(content: Any, status: int = 200) -> Response:
    return Response(json.dumps(content, separators=(",", ":")), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return _json({"error": message}, status)


async def _protocol_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ProtocolError)
    response = _error(exc.status, exc.message)
    response.headers.update(exc.headers)
    return response


async def _internal_error(request: Request, exc: Exception) -> Response:
    # A bug, not the client's fault: a JSON 500 without the traceback (Starlette logs it).
    return _error(500, f"internal server error ({type(exc).__name__})")


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
    ready = bool(request.app.state.ready) and all(m.ready for m in models.values())  # False while draining
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
    ready = bool(request.app.state.ready) and entry.ready
    return _json({"name": entry.name, "ready": ready}, 200 if ready else 503)


async def _infer(request: Request) -> Response:
    entry = _lookup(request)
    admission: Admission = request.app.state.admission
    limits: Limits = request.app.state.limits
    async with admission.admit(entry.name):  # 503 when full or shutting down
        deadline = admission.deadline()
        with anyio.move_on_at(deadline) as receiving:
            body = await read_body(request, limits)
        if receiving.cancelled_caught:
            raise ProtocolError(408, f"the request body did not arrive within the request timeout "
                                     f"({admission.request_timeout} s)")
        parsed = await _parse(request, body, entry, limits)
        with anyio.move_on_at(deadline) as running:  # cancelling the run skips its layers not started
            outputs = await _run(entry, parsed.inputs)
        if running.cancelled_caught:
            raise ProtocolError(504, f"model {entry.name!r} did not answer within the request timeout "
                                     f"({admission.request_timeout} s); the run was cancelled")
        size = sum(a.nbytes for a in outputs.values())
        content, headers = await _maybe_offload(size, encode_infer_response, entry.name, MODEL_VERSION, parsed, outputs)
    return Response(content, headers=headers)


async def read_body(request: Request, limits: Limits) -> bytes:
    """The request body, refused with 413 beyond ``limits.max_request_bytes``: by ``Content-Length``
    before a byte is read, and while reading (a body without ``Content-Length``, or longer than it
    said), so no more than the limit (plus one chunk) is ever held."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise ProtocolError(400, f"Content-Length must be an integer, got {declared[:40]!r}") from None
        _check_body_size(length, limits)
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            _check_body_size(received, limits)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ProtocolError(400, "the client disconnected before sending the whole body") from None
    return b"".join(chunks)


def _check_body_size(size: int, limits: Limits) -> None:
    try:
        limits.check_request("max_request_bytes", size, "the request body (bytes)")
    except RequestTooLargeError as exc:
        raise ProtocolError(413, str(exc)) from None


async def _parse(request: Request, body: bytes, entry: ServedModel, limits: Limits) -> InferRequest:
    """Decode the body (on a helper thread when large). Anything but a ProtocolError escaping the
    decoder is a bug in it, yet still the request's fault: 400, and logged."""
    header_length = request.headers.get("inference-header-content-length")
    try:
        return await _maybe_offload(len(body), parse_infer_request, body, header_length, entry.model,
                                    entry.name, limits)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - answered as a bad request, logged as a bug
        logger.exception("decoding a request to %r raised %s", entry.name, type(exc).__name__)
        raise ProtocolError(400, f"the request could not be decoded ({type(exc).__name__})") from None


async def _run(entry: ServedModel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inference, with engine errors mapped to HTTP answers."""
    try:
        return await entry.infer(inputs)
    except InputError as exc:  # shapes against the declared signature (and Limits), checked by the engine
        raise ProtocolError(400, str(exc)) from None
    except DisposedError as exc:
        raise unavailable(str(exc)) from None
    except AsyncInferError as exc:  # the model failed on this input; the server stays up
        raise ProtocolError(500, f"{type(exc).__name__}: {exc}") from None


async def _maybe_offload(size: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a worker thread for large payloads, inline for small ones."""
    if size > OFFLOAD_BYTES:
        return await anyio.to_thread.run_sync(fn, *args)
    return fn(*args)
