"""A middleware for Ray Serve's HTTP proxy: a request whose replica died is retried, or refused clearly.

When a replica dies (a crash, an OOM kill, a lost node) while it holds a request, Ray Serve's proxy
gives up on that request and its HTTP server answers a bare ``500 Internal Server Error``. This
middleware, run inside the proxy, notices that the proxy returned without an answer and:

- retries the request once more (``RETRIES``) when it is safe to send again: an inference (it has
  no side effect) or a GET, whose body (at most ``MAX_RETRY_BODY`` bytes) it kept; Ray Serve
  then routes it to a live replica, and the answer carries ``asyncinfer-retried: 1``;
- otherwise answers ``503`` with ``Retry-After`` and a JSON ``{"error": ...}`` that says the
  replica was lost, as every other asyncinfer error is written.

A client that went away is neither retried nor answered. Install it in every proxy by setting, in
the environment of each Ray node (``ray start``, the KubeRay pod spec)::

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=asyncinfer.serving.ray.proxy:middlewares

``asyncinfer serve --ray`` sets it for the local cluster it starts. This module does not import Ray.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["middlewares", "LostReplicaRetry", "send_json", "IMPORT_PATH", "ENV_VAR"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ENV_VAR = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
IMPORT_PATH = "asyncinfer.serving.ray.proxy:middlewares"
RETRIES = 1  # more sends of a request whose replica died; each goes to a replica still alive
MAX_RETRY_BODY = 16 << 20  # bodies larger than this (or of unknown length) stream through, unretried
RETRY_AFTER_SECONDS = 1
RETRIED_HEADER = "asyncinfer-retried"  # on an answer that came from a retry: how many
LOST = ("the replica serving this request stopped before it answered (it crashed or was killed); "
        "Ray Serve replaces it: retry the request")


def middlewares() -> list[Any]:
    """The proxy middlewares Ray Serve installs (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``)."""
    from starlette.middleware import Middleware

    return [Middleware(LostReplicaRetry)]


class LostReplicaRetry:
    """ASGI middleware around Ray Serve's proxy app (see the module's docstring)."""

    def __init__(self, app: ASGIApp, retries: int = RETRIES, max_body: int = MAX_RETRY_BODY):
        self.app, self.retries, self.max_body = app, retries, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await self._body(scope, receive)
        gone = False  # the client disconnected: nobody to answer

        async def client_receive() -> Message:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect":
                gone = True
            return message

        attempts = 1 + (self.retries if body is not None and _idempotent(scope) else 0)
        for attempt in range(attempts):
            started = False

            async def tracking_send(message: Message, retried: int = attempt) -> None:
                nonlocal started
                if message["type"] == "http.response.start":
                    started = True
                    if retried:  # visible to the client and to tests: this answer came from a retry
                        message = {**message, "headers": [*message.get("headers", []),
                                                          (RETRIED_HEADER.encode(), str(retried).encode())]}
                await send(message)

            await self.app(scope, _replay(body, client_receive) if body is not None else client_receive,
                           tracking_send)
            if started or gone:
                return
        await send_json(send, 503, {"error": LOST}, {"retry-after": str(RETRY_AFTER_SECONDS)})

    async def _body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body when it is small enough to keep for a retry, else None (unread)."""
        length = dict(scope.get("headers") or []).get(b"content-length")
        try:
            size = int(length) if length is not None else (0 if scope["method"] in ("GET", "HEAD") else -1)
        except ValueError:
            return None
        if not 0 <= size <= self.max_body:
            return None
        chunks = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # a disconnect before the body arrived
                return None if chunks else b""
            chunks.extend(message.get("body", b""))
            if len(chunks) > self.max_body:
                return None  # longer than it said: the replica's own limit answers (413)
            if not message.get("more_body", False):
                return bytes(chunks)


def _idempotent(scope: Scope) -> bool:
    """Requests safe to send twice: reads, and inference (it changes nothing on the server)."""
    return scope["method"] in ("GET", "HEAD") or (scope["method"] == "POST" and scope["path"].endswith("/infer"))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` giving the kept body once, then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def send_json(send: Send, status: int, content: Any, headers: dict[str, str] | None = None) -> None:
    """Answer with ``content`` as JSON (the form of every asyncinfer error)."""
    data = json.dumps(content, separators=(",", ":")).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})
