"""Reading an HTTP request body under the server's limits (every endpoint that takes a body)."""
from __future__ import annotations

from starlette.requests import Request
from starlette.types import Receive

from ..errors import RequestTooLargeError
from ..limits import Limits
from .protocol import ProtocolError


async def read_body(request: Request, limits: Limits) -> bytes:
    """The body of a Starlette request: `receive_body` on its ASGI messages."""
    return await receive_body(request.receive, request.headers.get("content-length"), limits)


async def receive_body(receive: Receive, declared: str | None, limits: Limits) -> bytes:
    """The request body from its ASGI messages, refused with 413 beyond
    ``limits.max_request_bytes``: by the ``Content-Length`` header (``declared``) before a byte is
    read, and while reading (a body without ``Content-Length``, or longer than it said), so no
    more than the limit (plus one chunk) is ever held; 400 if the client leaves before the end."""
    if declared is not None:
        try:
            length = int(declared)
        except ValueError:
            raise ProtocolError(400, f"Content-Length must be an integer, got {declared[:40]!r}") from None
        _check_body_size(length, limits)
    chunks: list[bytes] = []
    received = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ProtocolError(400, "the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        if chunk:
            received += len(chunk)
            _check_body_size(received, limits)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _check_body_size(size: int, limits: Limits) -> None:
    try:
        limits.check_request("max_request_bytes", size, "the request body (bytes)")
    except RequestTooLargeError as exc:
        raise ProtocolError(413, str(exc)) from None
