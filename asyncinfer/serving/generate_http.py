"""Generation over HTTP: one ASGI response that reads the request, admits it, generates, and
answers as one JSON object or as server-sent events, whatever the protocol (`GenerationProtocol`:
OpenAI's completions and chat completions in `.openai_api`, Triton's generate extension in
`.triton_generate`).

Everything runs in the request's own task, so admission's cancel scope is entered and left in
one task and the stream's end is certain: while generating, a second task waits for the client's
``http.disconnect`` and cancels the generation; the stream is cancelled (its KV cache freed at
the next step boundary), and the request counts as CANCELED in the statistics. The request's
deadline (``request_timeout``) bounds the whole generation: past it, 504 (or, once streaming, an
error event), and the stream is cancelled.

Errors before the first byte are an HTTP status with the protocol's JSON error; once streaming
(status 200 sent), an error is an event of the protocol's error shape, then the end.
"""
from __future__ import annotations

import json
import logging
from typing import Any

import anyio
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from .generation import Delta, Generation, protocol_error
from .http_body import read_body
from .protocol import ProtocolError, _load_json
from .service import Call, InferenceService

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]  # proxies (nginx) must not buffer the stream
DONE = "[DONE]"  # OpenAI's last event
logger = logging.getLogger(__name__)


class GenerationProtocol:
    """One generation request of one protocol: how it is read, started and answered.

    `parse` sets ``name``, ``version`` and ``stream`` (and whatever the subclass keeps).
    """

    name: str = ""
    version: str | None = None
    stream: bool = False

    def parse(self, body: dict[str, Any], path_params: dict[str, str]) -> None:
        """Read the request (ProtocolError 400 when it does not fit the protocol)."""
        raise NotImplementedError

    async def begin(self, call: Call, service: InferenceService) -> Generation:
        """Start generating for the admitted request."""
        raise NotImplementedError

    def error_body(self, error: ProtocolError) -> dict[str, Any]:
        """The JSON body of an error answered with its HTTP status."""
        return {"error": error.message}

    def error_event(self, error: ProtocolError) -> list[Any]:
        """The events that end a stream that failed."""
        return [self.error_body(error)]

    def head_events(self, generation: Generation) -> list[Any]:
        """Events before the first delta."""
        return []

    def delta_event(self, generation: Generation, delta: Delta) -> Any | None:
        """The event of one delta (None: nothing to send for it)."""
        raise NotImplementedError

    def tail_events(self, generation: Generation) -> list[Any]:
        """Events after the last delta."""
        return []

    def response(self, generation: Generation, text: str, tokens: list[int]) -> dict[str, Any]:
        """The JSON answer of a request that does not stream."""
        raise NotImplementedError


class _State:
    started = False       # the 200 and its headers were sent: errors are events now
    disconnected = False  # the client went away


class GenerationResponse:
    """The ASGI response of a generation endpoint (see the module docstring)."""

    def __init__(self, request: Request, protocol: GenerationProtocol):
        self.request = request
        self.protocol = protocol

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = _State()
        try:
            await self._serve(receive, send, state)
        except ProtocolError as exc:
            await self._fail(exc, send, state)
        except Exception as exc:  # noqa: BLE001 - a bug: logged, answered without its traceback
            if isinstance(exc, OSError) and state.started:
                return  # the connection broke while streaming
            logger.exception("a generation request raised %s", type(exc).__name__)
            await self._fail(ProtocolError(500, f"internal server error ({type(exc).__name__})"), send, state)

    async def _serve(self, receive: Receive, send: Send, state: _State) -> None:
        service: InferenceService = self.request.app.state.service
        with anyio.move_on_after(service.admission.request_timeout or float("inf")) as receiving:
            body = await read_body(self.request, service.limits)
        if receiving.cancelled_caught:
            raise ProtocolError(408, f"the request body did not arrive within the request timeout "
                                     f"({service.admission.request_timeout} s)")
        self.protocol.parse(_load_json(body, service.limits.max_json_depth) if body.strip() else {},
                            dict(self.request.path_params))
        async with service.request(self.protocol.name, self.protocol.version) as call:
            generation = await self.protocol.begin(call, service)
            try:
                await self._generate(call, generation, receive, send, state, service.admission.request_timeout)
                generation.close(succeeded=True)
            finally:
                generation.close(succeeded=False)  # (a no-op once closed)

    async def _generate(self, call: Call, generation: Generation, receive: Receive, send: Send,
                        state: _State, timeout: float | None) -> None:
        error: ProtocolError | None = None
        text: list[str] = []
        tokens: list[int] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watch_disconnect, receive, tg.cancel_scope, state)
            try:
                with anyio.move_on_at(call.deadline) as timer:
                    if self.protocol.stream:
                        await self._start(send, state)
                        for event in self.protocol.head_events(generation):
                            await _event(send, event)
                    async for delta in generation.deltas():
                        if self.protocol.stream:
                            event = self.protocol.delta_event(generation, delta)
                            if event is not None:
                                await _event(send, event)
                        else:
                            if delta.text:
                                text.append(delta.text)
                            if delta.token is not None:
                                tokens.append(delta.token)
            except ProtocolError as exc:
                error = exc
            except OSError:  # the connection broke under a send
                state.disconnected = True
            except Exception as exc:  # noqa: BLE001 - kept out of the task group's exception group
                error = protocol_error(exc, call.name)
            finally:
                tg.cancel_scope.cancel()  # the watcher
        if state.disconnected:
            raise ProtocolError(499, "the client disconnected; the stream was cancelled")
        if error is not None:
            raise error
        if timer.cancelled_caught:
            raise ProtocolError(504, f"model {call.name!r} did not finish generating within the request timeout "
                                     f"({timeout} s); the stream was cancelled")
        if self.protocol.stream:
            for event in self.protocol.tail_events(generation):
                await _event(send, event)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            content = self.protocol.response(generation, "".join(text), tokens)
            await _send_json(send, 200, content, state)

    async def _start(self, send: Send, state: _State) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        state.started = True

    async def _fail(self, error: ProtocolError, send: Send, state: _State) -> None:
        if state.disconnected or error.status == 499:
            return  # nobody to answer
        try:
            if state.started:
                for event in self.protocol.error_event(error):
                    await _event(send, event)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await _send_json(send, error.status, self.protocol.error_body(error), state, error.headers)
        except OSError:
            pass  # the connection is gone


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope, state: _State) -> None:
    """Cancel ``scope`` when the client disconnects (the body was read: nothing else comes)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            state.disconnected = True
            scope.cancel()
            return


def _dumps(content: Any) -> bytes:
    return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()


async def _event(send: Send, event: Any) -> None:
    data = event.encode() if isinstance(event, str) else _dumps(event)
    await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": True})


async def _send_json(send: Send, status: int, content: Any, state: _State,
                     headers: dict[str, str] | None = None) -> None:
    body = _dumps(content)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    state.started = True
    await send({"type": "http.response.body", "body": body, "more_body": False})
