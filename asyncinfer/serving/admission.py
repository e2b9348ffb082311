"""Admission control for inference requests: a bound per model, a deadline per request, a drain at shutdown.

The server treats load as untrusted too. Each model admits at most ``max_queue`` requests at a
time (being received, queued or running); one more is refused at once with 503 and a
``Retry-After`` header, never queued. Each admitted request has ``request_timeout`` seconds from
admission: past it, the request answers 408 if its body is still arriving, 504 if inference is
still running, and the run is cancelled (layers not started are skipped). At shutdown,
`Admission.drain` refuses new requests (503), waits up to ``drain_timeout`` seconds for the
admitted ones to finish, and cancels those still running (they answer 503) before the workers go.
"""
from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import anyio

from .protocol import ProtocolError

RETRY_AFTER_SECONDS = 1  # what a 503 tells the client to wait before trying again


def unavailable(message: str) -> ProtocolError:
    """A 503 answer with a ``Retry-After`` header."""
    return ProtocolError(503, message, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def drained() -> ProtocolError:
    """The 503 of a request the drain cancelled (the server is going away)."""
    return unavailable("the server shut down before this request finished")


class Admission:
    """Which inference requests a server takes, for how long, and when it stops taking them.

    Args:
        models: the served model names (others are added when first admitted: a loaded model).
        max_queue: most requests per model admitted at once (None: no bound).
        request_timeout: seconds an admitted request may take (None: no deadline).
        drain_timeout: seconds `drain` waits for admitted requests before cancelling them.
    """

    def __init__(self, models: Iterable[str], *, max_queue: int | None = 64, request_timeout: float | None = 60.0,
                 drain_timeout: float = 30.0):
        if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1):
            raise ValueError(f"max_queue must be a positive integer or None, got {max_queue!r}")
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be a positive number of seconds or None, got {request_timeout!r}")
        if not drain_timeout >= 0:
            raise ValueError(f"drain_timeout must be >= 0 seconds, got {drain_timeout!r}")
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.drain_timeout = drain_timeout
        self.draining = False
        self._active = dict.fromkeys(models, 0)
        self._scopes: set[anyio.CancelScope] = set()
        self._idle: anyio.Event | None = None

    def active(self, model: str | None = None) -> int:
        """Requests admitted and not finished, for one model or (None) for all of them."""
        return sum(self._active.values()) if model is None else self._active.get(model, 0)

    def deadline(self) -> float:
        """The deadline (``anyio.current_time()`` clock) of a request admitted now."""
        return math.inf if self.request_timeout is None else anyio.current_time() + self.request_timeout

    @asynccontextmanager
    async def admit(self, model: str) -> AsyncIterator[None]:
        """Hold a place of ``model`` while the request is handled.

        Raises:
            ProtocolError: 503 with ``Retry-After`` when the model already has ``max_queue``
                requests, when the server is draining, or when the drain timed out and cancelled
                this request.
        """
        scope = self.enter(model)
        try:
            with scope:
                yield
        finally:
            self.leave(model, scope)
        if scope.cancelled_caught:
            raise drained()

    def enter(self, model: str) -> anyio.CancelScope:
        """`admit` in two calls, for a caller that is itself a context manager (one layer less on
        the hot path): take a place of ``model`` and return the scope the drain cancels; enter
        that scope around the request, then call `leave` whatever happens, and answer
        ``drained()`` when the scope caught a cancellation.

        Raises:
            ProtocolError: 503 with ``Retry-After`` when the model is full or the server draining.
        """
        if self.draining:
            raise unavailable("the server is shutting down and takes no new requests")
        active = self._active.get(model, 0)
        if self.max_queue is not None and active >= self.max_queue:
            raise unavailable(f"model {model!r} has {active} requests in progress, the most this "
                              f"server takes (max_queue={self.max_queue}); retry later")
        self._active[model] = active + 1
        scope = anyio.CancelScope()
        self._scopes.add(scope)
        return scope

    def leave(self, model: str, scope: anyio.CancelScope) -> None:
        """Give back the place taken by `enter`."""
        self._scopes.discard(scope)
        self._active[model] -= 1
        if self._idle is not None and not self.active():
            self._idle.set()

    async def drain(self) -> bool:
        """Refuse new requests, wait up to ``drain_timeout`` seconds for the admitted ones, then
        cancel those left (they answer 503) and wait for them to unwind.

        Returns True when every request finished on its own.
        """
        self.draining = True
        with anyio.move_on_after(self.drain_timeout):
            await self._wait_idle()
        finished = not self.active()
        for scope in list(self._scopes):
            scope.cancel()
        await self._wait_idle()  # cancelled requests unwind at once (a parse on a helper thread ends first)
        return finished

    async def _wait_idle(self) -> None:
        while self.active():
            self._idle = anyio.Event()
            await self._idle.wait()
