"""The KServe v2 gRPC endpoint (``inference.GRPCInferenceService``), as Triton's clients call it.

``await start_grpc_server(service, host, port)`` serves an `InferenceService` over gRPC
(grpc.aio) in the running event loop, beside the HTTP app serving the same service. Every RPC is a
thin adapter: the request is decoded (`.convert`), the service answers, the answer is
encoded. Errors are the service's ``ProtocolError``, mapped from their HTTP status:

=========  ==============================  =========  ==============================
HTTP       gRPC                            HTTP       gRPC
=========  ==============================  =========  ==============================
400        INVALID_ARGUMENT                413        RESOURCE_EXHAUSTED
404        NOT_FOUND                       500        INTERNAL
408, 504   DEADLINE_EXCEEDED               501        UNIMPLEMENTED
409        ABORTED                         503        UNAVAILABLE (``retry-after`` in
                                                      the trailing metadata)
=========  ==============================  =========  ==============================

A message larger than ``Limits.max_request_bytes`` is refused by gRPC itself
(RESOURCE_EXHAUSTED) before it is decoded. ``ModelStreamInfer`` answers each request of a stream
in order, running up to ``STREAM_IN_FLIGHT`` of them at once; a failed request gets a response
with ``error_message`` and the stream goes on. A client that cancels an RPC (or closes its
stream) cancels the runs it started. Inference messages are parsed, decoded, encoded and
serialised on a worker thread when they exceed ``OFFLOAD_BYTES``, so the event loop (shared
with the HTTP server) stays responsive. Shared-memory RPCs answer UNIMPLEMENTED; trace settings are the
service's (`..tracing`); log settings can be read, not changed.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import grpc
from google.protobuf.message import DecodeError

from ..protocol import InferRequest, ProtocolError, json_depth
from . import grpc_service_pb2 as pb
from . import grpc_service_pb2_grpc as pb_grpc
from .convert import (
    decode_infer_request,
    encode_infer_response,
    from_json,
    repository_index_response,
    repository_parameters,
    request_bytes,
    response_bytes,
)

if TYPE_CHECKING:
    from ..service import InferenceService

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Payloads larger than this are decoded/encoded on a worker thread (as the HTTP side does).
OFFLOAD_BYTES = 1 << 20
# Requests of one ModelStreamInfer stream in progress at once; the stream is read no further
# until the oldest is answered (its answers go out in request order).
STREAM_IN_FLIGHT = 64
SERVICE_NAME = "inference.GRPCInferenceService"
_GRPC_MAX_MESSAGE = (1 << 31) - 1  # gRPC's message length is an int32

_STATUS: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    405: grpc.StatusCode.UNIMPLEMENTED,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

SHARED_MEMORY_UNSUPPORTED = ("shared memory is not supported by asyncinfer: send tensor data in the request "
                             "(raw_input_contents or contents)")


def status_code(status: int) -> grpc.StatusCode:
    """The gRPC status of a ``ProtocolError``'s HTTP status (another 4xx: INVALID_ARGUMENT,
    another 5xx: INTERNAL)."""
    code = _STATUS.get(status)
    if code is not None:
        return code
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= status < 500 else grpc.StatusCode.INTERNAL


async def start_grpc_server(service: InferenceService, host: str, port: int, *,
                            reuse_port: bool = False) -> grpc.aio.Server:
    """Serve ``service`` over gRPC on ``host:port`` (port 0: a free port), in the running event loop.

    The returned server is started; its bound port is ``server.port``. Stop it with
    ``await server.stop(grace)`` before the service is closed. Raises ``OSError`` when the
    address cannot be bound (in use, or not an address of this host). ``reuse_port``: bind
    with ``SO_REUSEPORT``, so that the worker processes of ``serve --workers N`` listen on one
    port and the kernel spreads the connections over them (Linux).
    """
    max_message = min(service.limits.max_request_bytes, _GRPC_MAX_MESSAGE)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", max_message),
        ("grpc.max_send_message_length", -1),  # responses are bounded by the model, not the client
        ("grpc.so_reuseport", int(reuse_port)),  # else a port in use is an error, not a second listener
    ])
    servicer = InferenceServicer(service)
    # First: the wire-form inference handlers take these two methods over from the generated ones.
    server.add_generic_rpc_handlers((_wire_handlers(servicer),))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc reports a failed bind this way
        raise OSError(f"cannot serve gRPC on {address}: {exc}") from None
    if bound == 0:  # older grpc reports a failed bind this way
        raise OSError(f"cannot serve gRPC on {address}: the address could not be bound")
    await server.start()
    server.port = bound  # type: ignore[attr-defined]
    return server


def _wire_handlers(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """ModelInfer and ModelStreamInfer without (de)serialisers: the servicer gets and returns bytes."""
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "ModelInfer": grpc.unary_unary_rpc_method_handler(servicer.model_infer_wire),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(servicer.model_stream_infer_wire),
    })


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Each RPC of ``inference.GRPCInferenceService`` over one `InferenceService`."""

    def __init__(self, service: InferenceService):
        self.service = service

    # -- health and metadata ---------------------------------------------------------------------
    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.service.live())

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext) -> pb.ModelReadyResponse:
        return await _answer(context, lambda: pb.ModelReadyResponse(
            ready=self.service.model_ready(request.name, request.version or None)))

    async def ServerMetadata(self, request: pb.ServerMetadataRequest,
                             context: grpc.aio.ServicerContext) -> pb.ServerMetadataResponse:
        return await _answer(context, lambda: from_json(self.service.server_metadata(), pb.ServerMetadataResponse))

    async def ModelMetadata(self, request: pb.ModelMetadataRequest,
                            context: grpc.aio.ServicerContext) -> pb.ModelMetadataResponse:
        return await _answer(context, lambda: from_json(
            self.service.model_metadata(request.name, request.version or None), pb.ModelMetadataResponse))

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext) -> pb.ModelConfigResponse:
        return await _answer(context, lambda: pb.ModelConfigResponse(config=from_json(
            self.service.model_config(request.name, request.version or None), pb.ModelConfig)))

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest,
                              context: grpc.aio.ServicerContext) -> pb.ModelStatisticsResponse:
        async def statistics() -> pb.ModelStatisticsResponse:
            return from_json(await self.service.gather_statistics(request.name or None, request.version or None),
                             pb.ModelStatisticsResponse)
        return await _answer_async(context, statistics)

    # -- repository ------------------------------------------------------------------------------
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest,
                              context: grpc.aio.ServicerContext) -> pb.RepositoryIndexResponse:
        return await _answer(context, lambda: repository_index_response(
            self.service.repository_index(ready_only=request.ready)))

    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest,
                                  context: grpc.aio.ServicerContext) -> pb.RepositoryModelLoadResponse:
        async def load() -> pb.RepositoryModelLoadResponse:
            config = _load_config(repository_parameters(request.parameters), self.service.limits.max_json_depth)
            await self.service.load(request.model_name, config)
            return pb.RepositoryModelLoadResponse()
        return await _answer_async(context, load)

    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest,
                                    context: grpc.aio.ServicerContext) -> pb.RepositoryModelUnloadResponse:
        async def unload() -> pb.RepositoryModelUnloadResponse:
            await self.service.unload(request.model_name)
            return pb.RepositoryModelUnloadResponse()
        return await _answer_async(context, unload)

    # -- inference -------------------------------------------------------------------------------
    # start_grpc_server registers ModelInfer and ModelStreamInfer on the wire form (bytes in and
    # out: `model_infer_wire`, `model_stream_infer_wire`), so that parsing a large request and
    # serialising a large response run on a worker thread like the rest of the decoding, not in
    # the event loop. The message-level methods serve a server built with the generated
    # add_GRPCInferenceServiceServicer_to_server alone.
    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        return await _answer_async(context, lambda: self._infer(request))

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context: grpc.aio.ServicerContext) -> None:
        await self._stream(request_iterator, context, wire=False)

    async def model_infer_wire(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """ModelInfer on serialised messages."""
        async def infer() -> bytes:
            return await self._infer(await _parse_request(data), wire=True)
        return await _answer_async(context, infer)

    async def model_stream_infer_wire(self, request_iterator: AsyncIterator[bytes],
                                      context: grpc.aio.ServicerContext) -> None:
        """ModelStreamInfer on serialised messages."""
        await self._stream(request_iterator, context, wire=True)

    async def _stream(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                      wire: bool) -> None:
        # A reader starts one task per request; the writer sends the answers in request order.
        # The bounded queue stops the reading while STREAM_IN_FLIGHT requests are unanswered.
        send: anyio.abc.ObjectSendStream[_Pending]
        receive: anyio.abc.ObjectReceiveStream[_Pending]
        send, receive = anyio.create_memory_object_stream(STREAM_IN_FLIGHT - 1)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._read_stream, request_iterator, send, tasks, wire)
            async with receive:
                async for pending in receive:
                    await pending.done.wait()
                    await context.write(pending.response)

    async def _read_stream(self, request_iterator: AsyncIterator[Any], send: anyio.abc.ObjectSendStream[_Pending],
                           tasks: anyio.abc.TaskGroup, wire: bool) -> None:
        async with send:
            async for request in request_iterator:
                pending = _Pending()
                await send.send(pending)
                tasks.start_soon(self._stream_one, request, pending, wire)

    async def _stream_one(self, request: Any, pending: _Pending, wire: bool) -> None:
        parsed: pb.ModelInferRequest | None = None
        try:
            parsed = await _parse_request(request) if wire else request
            answer = pb.ModelStreamInferResponse(infer_response=await self._infer(parsed))
        except ProtocolError as exc:
            answer = _stream_error(parsed, exc.message)
        except Exception as exc:  # noqa: BLE001 - a bug; the stream goes on
            logger.exception("a gRPC stream request failed")
            answer = _stream_error(parsed, f"internal server error ({type(exc).__name__})")
        try:
            pending.response = (await _offload(answer.ByteSize(), answer.SerializeToString)) if wire else answer
        finally:
            pending.done.set()

    async def _infer(self, request: pb.ModelInferRequest, wire: bool = False) -> Any:
        """The response to one inference request (serialised when ``wire``)."""
        limits = self.service.limits
        async with self.service.request(request.model_name, request.model_version or None) as call:
            with call.phase("input"):
                parsed = await _decode(request, call, limits)
            outputs = await call.infer(parsed.inputs, parsed.outputs if request.outputs else None)
            with call.phase("output"):
                missing = [name for name in parsed.outputs if name not in outputs]
                if missing:
                    raise ProtocolError(500, f"model {call.name!r} did not produce output(s) {missing}")
                size = response_bytes(outputs.values())
                return await _offload(size, _encode, call.name, call.version, parsed, outputs, wire)

    # -- unsupported and settings ----------------------------------------------------------------
    async def SystemSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY_UNSUPPORTED)

    async def SystemSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY_UNSUPPORTED)

    async def SystemSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY_UNSUPPORTED)

    async def CudaSharedMemoryStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY_UNSUPPORTED)

    async def CudaSharedMemoryRegister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY_UNSUPPORTED)

    async def CudaSharedMemoryUnregister(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, SHARED_MEMORY_UNSUPPORTED)

    async def TraceSetting(self, request: pb.TraceSettingRequest,
                           context: grpc.aio.ServicerContext) -> pb.TraceSettingResponse:
        async def answer() -> pb.TraceSettingResponse:
            name = request.model_name or None
            if name is not None:
                self.service.model_metadata(name)  # NOT_FOUND for an unknown model
            if request.settings:  # an empty value clears a model's setting (Triton's null)
                settings = await self.service.update_trace(
                    {k: list(v.value) or None for k, v in request.settings.items()}, name)
            else:
                settings = self.service.tracer.settings(name)
            response = pb.TraceSettingResponse()
            for key, value in settings.to_json().items():
                response.settings[key].value.extend(value if isinstance(value, list) else [value])
            return response

        return await _answer_async(context, answer)

    async def LogSettings(self, request: pb.LogSettingsRequest, context: grpc.aio.ServicerContext) -> pb.LogSettingsResponse:
        if request.settings:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "log settings cannot be changed over gRPC: configure Python's logging in the server")
        return _log_settings()


@dataclass
class _Pending:
    """One stream request's answer, set when it is ready."""

    done: anyio.Event = field(default_factory=anyio.Event)
    response: pb.ModelStreamInferResponse | bytes | None = None  # bytes: serialised (the wire handler)


def _stream_error(request: pb.ModelInferRequest | None, message: str) -> pb.ModelStreamInferResponse:
    # The failed request's name, version and id go along, so a client can tell which one failed.
    if request is None:  # not even a message
        return pb.ModelStreamInferResponse(error_message=message)
    echo = pb.ModelInferResponse(model_name=request.model_name, model_version=request.model_version, id=request.id)
    return pb.ModelStreamInferResponse(error_message=message, infer_response=echo)


async def _parse_request(data: bytes) -> pb.ModelInferRequest:
    """A serialised ModelInferRequest (parsed on a helper thread when large)."""
    try:
        return await _offload(len(data), pb.ModelInferRequest.FromString, data)
    except DecodeError:
        raise ProtocolError(400, "the request is not a valid inference.ModelInferRequest message") from None


def _encode(model_name: str, version: str, request: InferRequest, outputs: Mapping[str, Any],
            wire: bool) -> pb.ModelInferResponse | bytes:
    response = encode_infer_response(model_name, version, request, outputs)
    return response.SerializeToString() if wire else response


async def _decode(request: pb.ModelInferRequest, call: Any, limits: Any) -> InferRequest:
    """Decode (on a helper thread when large). Anything but a ProtocolError escaping the decoder is
    a bug in it, yet still the request's fault: 400, and logged."""
    try:
        return await _offload(request_bytes(request), decode_infer_request, request, call.model, call.name, limits)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - answered as a bad request, logged as a bug
        logger.exception("decoding a gRPC request to %r raised %s", call.name, type(exc).__name__)
        raise ProtocolError(400, f"the request could not be decoded ({type(exc).__name__})") from None


async def _offload(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread for large payloads, inline for small ones."""
    if size > OFFLOAD_BYTES:
        return await anyio.to_thread.run_sync(fn, *args)
    return fn(*args)


async def _answer(context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
    async def call() -> T:
        return fn()
    return await _answer_async(context, call)


async def _answer_async(context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[T]]) -> T:
    """``await fn()``, with a ProtocolError (or a bug) turned into the RPC's error status."""
    try:
        return await fn()
    except ProtocolError as exc:
        retry_after = exc.headers.get("Retry-After") or exc.headers.get("retry-after")
        metadata = (("retry-after", str(retry_after)),) if retry_after is not None else ()
        await context.abort(status_code(exc.status), exc.message, metadata)
    except grpc.aio.AbortError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bug: logged, answered without the traceback
        logger.exception("gRPC request failed")
        await context.abort(grpc.StatusCode.INTERNAL, f"internal server error ({type(exc).__name__})")
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


def _load_config(parameters: dict[str, Any], max_json_depth: int) -> dict[str, Any] | None:
    """The ``config`` parameter of a load request as a dict (None when absent)."""
    files = [key for key in parameters if key.startswith("file:")]
    if files:
        raise ProtocolError(501, f"loading a model from files sent in the request ({files[0]!r}) is not supported; "
                                 "place the model in the model repository")
    config = parameters.get("config")
    if config is None:
        return None
    if not isinstance(config, str):
        raise ProtocolError(400, "the 'config' parameter must be a string holding a JSON model configuration")
    depth = json_depth(config.encode())
    if depth > max_json_depth:
        raise ProtocolError(400, f"the 'config' parameter nests {depth} levels deep, more than "
                                 f"Limits.max_json_depth = {max_json_depth}")
    try:
        value = json.loads(config)
    except ValueError as exc:
        raise ProtocolError(400, f"the 'config' parameter is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(400, f"the 'config' parameter must be a JSON object, got {type(value).__name__}")
    return value


def _log_settings() -> pb.LogSettingsResponse:
    """What asyncinfer's Python logger records (the settings Triton's clients read)."""
    root = logging.getLogger("asyncinfer")
    response = pb.LogSettingsResponse()
    response.settings["log_info"].bool_param = root.isEnabledFor(logging.INFO)
    response.settings["log_warning"].bool_param = root.isEnabledFor(logging.WARNING)
    response.settings["log_error"].bool_param = root.isEnabledFor(logging.ERROR)
    response.settings["log_verbose_level"].uint32_param = 1 if root.isEnabledFor(logging.DEBUG) else 0
    response.settings["log_format"].string_param = "default"
    response.settings["log_file"].string_param = ""
    return response


__all__ = ["InferenceServicer", "OFFLOAD_BYTES", "STREAM_IN_FLIGHT", "start_grpc_server", "status_code"]
