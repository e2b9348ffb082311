"""An Open Inference Protocol (KServe v2 REST) server with Triton's extensions, as a Starlette app.

``create_app({"digits": "digits.onnx", ...})`` returns an ASGI app; run it with any ASGI server
(``asyncinfer serve`` uses uvicorn). The app is a thin adapter over an
`InferenceService` (``create_app(service=...)`` serves one built elsewhere, e.g.
from a model repository, or shared with the gRPC server): the service holds the models, their
workers and batchers, admission, statistics and metrics; the app's lifespan starts and stops it.
Handlers await the engine, so the event loop never blocks.

Endpoints (each ``/v2/models/{name}/...`` path also in the ``/v2/models/{name}/versions/{version}/...`` form):

==========================================  ====================================================
``GET  /v2/health/live``                    200 while the process serves
``GET  /v2/health/ready``                   200 once every model is up (503 before, and while draining)
``GET  /v2``                                server metadata: name, version, extensions
``GET  /v2/models/{name}``                  model metadata: inputs and outputs (shape -1: symbolic dim)
``GET  /v2/models/{name}/ready``            200 when the model can infer
``GET  /v2/models/{name}/config``           the model configuration, in Triton's JSON form
``POST /v2/models/{name}/infer``            inference: JSON tensors or the binary tensor data extension
``GET  /v2/models/stats``                   inference statistics of every model (Triton's JSON form)
``GET  /v2/models/{name}/stats``            ...of one model (or one version)
``POST /v2/repository/index``               the models and their states (body ``{"ready": true}``: ready ones)
``POST /v2/repository/models/{name}/load``  load or reload a model (explicit model control)
``POST /v2/repository/models/{name}/unload`` unload a model (explicit model control)
``GET  /metrics``                           Prometheus metrics (`.metrics`)
``GET|POST /v2/trace/setting``              Triton's trace settings (also per model:
                                            ``/v2/models/{name}/trace/setting``; `.tracing`)
``GET  /v2/trace``                          the latest traced requests, one Chrome/Perfetto trace
``/v2/systemsharedmemory/...``,             501: shared memory is not supported
``/v2/cudasharedmemory/...``
``POST /v2/models/{name}/generate``         decoders: Triton's generate extension (and
``POST /v2/models/{name}/generate_stream``  ``.../generate_stream``, server-sent events; `.triton_generate`)
``POST /v1/completions``,                   decoders: OpenAI's API, streamed or not (`.openai_api`)
``POST /v1/chat/completions``,
``GET  /v1/models``
==========================================  ====================================================

Every request is untrusted; every error is ``{"error": "..."}`` and the server stays up:

=====  =========================================================================================
400    a malformed request: bad JSON, JSON nested deeper than ``Limits.max_json_depth``, a shape
       that is not a list of non-negative integers, a rank over ``Limits.max_tensor_rank``, more
       elements than ``Limits.max_tensor_elements``, data that does not fit its shape, inputs
       that do not fit the model (the engine's ``InputError``); a load that failed, or a
       load/unload outside explicit model control
404    an unknown model, version or endpoint (405: a wrong method)
408    the body did not arrive within ``request_timeout``
413    a body over ``Limits.max_request_bytes`` (by ``Content-Length`` before reading, or while
       reading a body sent without one)
500    the model failed on this input (``ExecutionError``), or a server bug (logged)
501    shared memory (not supported: send tensors in the body)
503    with ``Retry-After``: the model already has ``max_queue`` requests in progress, is not
       ready, or the server is shutting down
504    inference did not finish within ``request_timeout`` (the run is cancelled)
=====  =========================================================================================

At shutdown the service drains: new inference requests get 503 and readiness 503, requests in
progress get up to ``drain_timeout`` seconds to finish, then the workers are disposed
(`.admission`).
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..backends import BackendType
from ..limits import DEFAULT_LIMITS, Limits
from .http_body import read_body, receive_body
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .openai_api import openai_routes
from .protocol import InferRequest, ProtocolError, _load_json, encode_infer_response, parse_infer_request
from .service import EXTENSIONS, SERVER_NAME, Call, InferenceService, ModelSource, ServedModel
from .triton_generate import generate_routes

__all__ = ["create_app", "read_body", "ServedModel", "InferenceService", "EXTENSIONS", "SERVER_NAME"]

# Bodies larger than this are decoded/encoded on a worker thread, so the loop stays responsive.
OFFLOAD_BYTES = 1 << 20
SHARED_MEMORY_UNSUPPORTED = ("shared memory is not supported by this server (asyncinfer): send tensors in the "
                             "request body, as JSON or with the binary tensor data extension")
logger = logging.getLogger(__name__)
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def create_app(models: Mapping[str, ModelSource] | None = None, backend: BackendType | str = "cpu",
               batching: bool = True, max_batch_size: int = 32, max_delay: float = 0.002, *,
               threads: int | None = None, limits: Limits = DEFAULT_LIMITS, request_timeout: float | None = 60.0,
               max_queue: int | None = 64, drain_timeout: float = 30.0, service: InferenceService | None = None,
               manage_service: bool = True) -> Starlette:
    """An ASGI app serving ``models`` (``{name: Model or path}``) over the Open Inference Protocol.

    Args:
        models: served names mapped to loaded models or anything `asyncinfer.load_model`
            takes (a path, bytes, an ``onnx.ModelProto``). Paths are loaded now (under
            ``limits``), so a bad file fails here rather than at the first request.
        backend: the backend every model's worker runs on.
        batching: merge concurrent requests to one model with a `DynamicBatcher`.
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
        service: serve this `InferenceService` instead (then give no ``models``; the
            other options are the service's own).
        manage_service: the app's lifespan starts and stops the service (False: the caller
            does, e.g. to share it with a gRPC server).
    """
    if service is None:
        service = InferenceService(models, backend=backend, batching=batching, max_batch_size=max_batch_size,
                                   max_delay=max_delay, threads=threads, limits=limits,
                                   request_timeout=request_timeout, max_queue=max_queue, drain_timeout=drain_timeout)
    elif models:
        raise ValueError("give create_app models or a service, not both")
    served = service

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_service:
            async with served:  # on exit: drained, then workers (and batchers) disposed
                yield
        else:
            yield

    routes = [  # inference first: Starlette tries routes in order, and almost every request infers
        Route("/v2/models/{name}/infer", _InferRoute(), methods=["POST"]),
        Route("/v2/models/{name}/versions/{version}/infer", _InferRoute(), methods=["POST"]),
        Route("/v2/health/live", _live, methods=["GET"]),
        Route("/v2/health/ready", _ready, methods=["GET"]),
        Route("/v2", _server_metadata, methods=["GET"]),
        Route("/v2/models/stats", _statistics, methods=["GET"]),  # before /v2/models/{name}
        Route("/v2/repository/index", _repository_index, methods=["POST"]),
        Route("/v2/repository/models/{name}/load", _load, methods=["POST"]),
        Route("/v2/repository/models/{name}/unload", _unload, methods=["POST"]),
        Route("/metrics", _metrics, methods=["GET"]),
        Route("/v2/trace/setting", _trace_setting, methods=["GET", "POST"]),
        Route("/v2/trace", _traces, methods=["GET"]),
        *generate_routes(),  # decoders: Triton's generate extension and OpenAI's completions
        *openai_routes(),
    ]
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            Route(prefix, _model_metadata, methods=["GET"]),
            Route(prefix + "/ready", _model_ready, methods=["GET"]),
            Route(prefix + "/config", _model_config, methods=["GET"]),
            Route(prefix + "/stats", _statistics, methods=["GET"]),
            Route(prefix + "/trace/setting", _trace_setting, methods=["GET", "POST"]),
        ]
    for kind in ("systemsharedmemory", "cudasharedmemory"):
        routes += [Route(f"/v2/{kind}/{{rest:path}}", _shared_memory, methods=["GET", "POST"])]
    app = _App(routes=routes, lifespan=lifespan,
               exception_handlers={ProtocolError: _protocol_error, HTTPException: _http_error,
                                   Exception: _internal_error})
    app.state.service = service
    app.state.models = service.models  # {name: latest ServedModel}, read live
    app.state.limits = service.limits
    app.state.admission = service.admission
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


def _service(request: Request) -> InferenceService:
    return request.app.state.service


def _model(request: Request) -> tuple[str, str | None]:
    return request.path_params["name"], request.path_params.get("version")


async def _live(request: Request) -> Response:
    live = _service(request).live()
    return _json({"live": live}, 200 if live else 503)


async def _ready(request: Request) -> Response:
    ready = _service(request).ready()  # False while draining
    return _json({"ready": ready}, 200 if ready else 503)


async def _server_metadata(request: Request) -> Response:
    return _json(_service(request).server_metadata())


async def _model_metadata(request: Request) -> Response:
    return _json(_service(request).model_metadata(*_model(request)))


async def _model_ready(request: Request) -> Response:
    name, version = _model(request)
    ready = _service(request).model_ready(name, version)
    return _json({"name": name, "ready": ready}, 200 if ready else 503)


async def _model_config(request: Request) -> Response:
    return _json(_service(request).model_config(*_model(request)))


async def _statistics(request: Request) -> Response:
    name = request.path_params.get("name")
    return _json(await _service(request).gather_statistics(name, request.path_params.get("version")))


async def _trace_setting(request: Request) -> Response:
    """Triton's trace settings, the server's or a model's (``null`` resets a model's setting)."""
    service = _service(request)
    name = request.path_params.get("name")
    if name is not None:
        service.model_metadata(name, request.path_params.get("version"))  # 404 for an unknown model
    if request.method == "POST":
        return _json((await service.update_trace(await _json_body(request), name)).to_json())
    return _json(service.tracer.settings(name).to_json())


async def _traces(request: Request) -> Response:
    """The latest traced requests as one Chrome/Perfetto trace (see `.tracing`)."""
    return _json(await _service(request).gather_traces())


async def _metrics(request: Request) -> Response:
    return Response(await _service(request).render_metrics(), media_type=METRICS_CONTENT_TYPE)


async def _shared_memory(request: Request) -> Response:
    return _error(501, SHARED_MEMORY_UNSUPPORTED)


async def _json_body(request: Request) -> dict[str, Any]:
    """A small JSON object body (an empty body is ``{}``); 400 when it is anything else."""
    service = _service(request)
    body = await read_body(request, service.limits)
    if not body.strip():
        return {}
    return _load_json(body, service.limits.max_json_depth)


async def _repository_index(request: Request) -> Response:
    body = await _json_body(request)
    ready = body.get("ready", False)
    if not isinstance(ready, bool):
        raise ProtocolError(400, f"'ready' must be true or false, got {type(ready).__name__}")
    return _json(_service(request).repository_index(ready_only=ready))


async def _load(request: Request) -> Response:
    body = await _json_body(request)
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise ProtocolError(400, "'parameters' of a load request must be an object")
    if any(isinstance(key, str) and key.startswith("file:") for key in parameters):
        raise ProtocolError(400, "loading a model from files sent with the request is not supported: put the "
                                 "files in the model repository")
    config = parameters.get("config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as exc:
            raise ProtocolError(400, f"the 'config' parameter is not valid JSON: {exc}") from None
    if config is not None and not isinstance(config, dict):
        raise ProtocolError(400, "the 'config' parameter must be a model configuration: a JSON object")
    await _service(request).load(request.path_params["name"], config)
    return _json({})


async def _unload(request: Request) -> Response:
    await _json_body(request)  # checked; 'unload_dependents' has no meaning here (no ensembles)
    await _service(request).unload(request.path_params["name"])
    return _json({})


# -- inference: the hot path, in plain ASGI ----------------------------------------------------------
class _App(Starlette):
    """Starlette, except that inference requests are taken before its middleware and router.

    Almost every request infers: it is answered by `_infer` straight from the ASGI scope, with
    the same errors as every other route, but without building a Request, matching the routes
    in turn and passing through the middleware stack (the rest goes to Starlette)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            target = _infer_target(scope["path"])
            if target is not None:
                await _infer(self.state.service, target[0], target[1], scope, receive, send)
                return
        await super().__call__(scope, receive, send)


class _InferRoute:
    """The inference routes for Starlette's router (a request reaching it some other way: `_App`
    takes them first); they keep wrong methods answered 405 like every route."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = scope["path_params"]
        await _infer(scope["app"].state.service, params["name"], params.get("version"), scope, receive, send)


def _infer_target(path: str) -> tuple[str, str | None] | None:
    """``(name, version)`` of ``/v2/models/{name}/infer`` or ``.../versions/{version}/infer``, else None."""
    if not path.startswith("/v2/models/") or not path.endswith("/infer"):
        return None
    parts = path[len("/v2/models/"):-len("/infer")].split("/")
    if len(parts) == 1 and parts[0]:
        return parts[0], None
    if len(parts) == 3 and parts[1] == "versions" and parts[0] and parts[2]:
        return parts[0], parts[2]
    return None


async def _infer(service: InferenceService, name: str, version: str | None, scope: Scope, receive: Receive,
                 send: Send) -> None:
    """Answer one inference request: the outputs, or ``{"error": ...}`` with the status of the
    `ProtocolError` (500 for anything else, logged)."""
    try:
        content, headers = await _infer_answer(service, name, version, scope, receive)
        status = 200
    except ProtocolError as exc:
        status, content = exc.status, _error_body(exc.message)
        headers = {"content-type": "application/json", **exc.headers}
    except Exception as exc:  # noqa: BLE001 - a bug: logged, answered without its traceback
        logger.exception("an inference request to %r raised %s", name, type(exc).__name__)
        status, content = 500, _error_body(f"internal server error ({type(exc).__name__})")
        headers = {"content-type": "application/json"}
    raw = [(key.encode("latin-1"), value.encode("latin-1")) for key, value in headers.items()]
    raw.append((b"content-length", str(len(content)).encode("latin-1")))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content})


async def _infer_answer(service: InferenceService, name: str, version: str | None, scope: Scope,
                        receive: Receive) -> tuple[bytes, dict[str, str]]:
    declared = header_length = None
    for key, value in scope["headers"]:
        if key == b"content-length" and declared is None:
            declared = value.decode("latin-1")
        elif key == b"inference-header-content-length" and header_length is None:
            header_length = value.decode("latin-1")
    async with service.request(name, version) as call:  # 404 unknown, 503 full / not ready / shutting down
        call.guarded = True  # one deadline scope for the body and the run, not one each
        stage = "body"
        with anyio.move_on_at(call.deadline) as timer:
            body = await receive_body(receive, declared, service.limits)
            stage = "run"
            with call.phase("input"):
                parsed = await _parse(body, header_length, call, service.limits)
            outputs = await call.infer(parsed.inputs, parsed.outputs)  # 400 / 500 / 503
        if timer.cancelled_caught:
            if stage == "body":
                raise ProtocolError(408, f"the request body did not arrive within the request timeout "
                                         f"({service.admission.request_timeout} s)")
            raise call.timed_out()  # 504
        size = sum(a.nbytes for a in outputs.values())
        with call.phase("output"):
            return await _maybe_offload(size, encode_infer_response, call.name, call.version, parsed, outputs)


def _error_body(message: str) -> bytes:
    return json.dumps({"error": message}, separators=(",", ":")).encode()


async def _parse(body: bytes, header_length: str | None, call: Call, limits: Limits) -> InferRequest:
    """Decode the body (on a helper thread when large). Anything but a ProtocolError escaping the
    decoder is a bug in it, yet still the request's fault: 400, and logged."""
    try:
        return await _maybe_offload(len(body), parse_infer_request, body, header_length, call.model,
                                    call.name, limits, call.served.header_plans)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - answered as a bad request, logged as a bug
        logger.exception("decoding a request to %r raised %s", call.name, type(exc).__name__)
        raise ProtocolError(400, f"the request could not be decoded ({type(exc).__name__})") from None


async def _maybe_offload(size: int, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a worker thread for large payloads, inline for small ones."""
    if size > OFFLOAD_BYTES:
        return await anyio.to_thread.run_sync(fn, *args)
    return fn(*args)
