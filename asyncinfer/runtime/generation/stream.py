"""A stream of generated tokens: the caller's side (`TokenStream`) and the engine's (`Sequence`).

The engine thread appends tokens to a `Sequence`; the caller reads them from the `TokenStream`
wrapping it, with ``async for`` (never blocking the loop: it awaits a `TaskFuture` the engine
completes) or with a plain ``for`` on a thread. The engine holds only the `Sequence`, so a
`TokenStream` the caller drops (a ``break`` out of ``async for`` without ``aclose``) is collected
at once and cancels its sequence.
"""
from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable
import numpy as np

from ...concurrency.bridge import wait_done
from ...concurrency.future import TaskFuture
from .sampling import Sampling, StopMatcher


class FinishReason(enum.Enum):
    """Why a stream ended: a stop token or sequence, its length limit, or a cancellation."""

    STOP = "stop"            # an eos_token_id or a stop sequence (neither is yielded)
    LENGTH = "length"        # max_new_tokens, or the model's context is full
    CANCELLED = "cancelled"  # aclose(), cancel(), a cancelled or timed-out consumer, the worker disposed
    ERROR = "error"          # the run failed: the iteration that reaches the end raises the error


class Sequence:
    """One stream's state on the engine side: its prompt, options and the tokens so far.

    Tokens pass from the engine thread to the reader through a locked deque and a `TaskFuture`
    the reader waits on when the deque is empty.
    """

    def __init__(self, prompt: np.ndarray, *, max_new_tokens: int, sampling: Sampling, seed: int | None,
                 eos: frozenset[int], stop: StopMatcher, on_cancel: Callable[["Sequence"], None]):
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.rng = np.random.default_rng(seed)
        self.eos = eos
        self.stop = stop
        self.generated: list[int] = []   # every chosen token (engine thread only)
        self.cancelled = False
        self.group: object = None        # the engine's batch holding this stream (engine bookkeeping)
        self._on_cancel = on_cancel
        self._lock = threading.RLock()  # re-entrant: a dropped stream's __del__ may run anywhere
        self._ready: deque[int] = deque()
        self._delivered: list[int] = []
        self._finished: FinishReason | None = None
        self._error: BaseException | None = None
        self._waiter: TaskFuture | None = None

    # -- engine side ---------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._finished is not None

    def add(self, token: int, context_full: bool) -> None:
        """(engine) Record the token chosen this step; finish on eos, stop, or a limit."""
        self.generated.append(token)
        if token in self.eos:
            self._end(FinishReason.STOP, self.stop.flush())
            return
        released, stopped = self.stop.push(token)
        if stopped:
            self._end(FinishReason.STOP, released)
        elif len(self.generated) >= self.max_new_tokens or context_full:
            self._end(FinishReason.LENGTH, released + self.stop.flush())
        elif released:
            self._deliver(released, None, None)

    def fail(self, error: BaseException) -> None:
        """(engine) End the stream with ``error``: the reader raises it."""
        self._deliver([], FinishReason.ERROR, error)

    def _end(self, reason: FinishReason, tokens: list[int]) -> None:
        self._deliver(tokens, reason, None)

    def _deliver(self, tokens: list[int], reason: FinishReason | None, error: BaseException | None) -> None:
        with self._lock:
            if self._finished is not None:
                return
            self._ready.extend(tokens)
            self._delivered.extend(tokens)
            if reason is not None:
                self._finished, self._error = reason, error
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter.set_result(None)

    def cancel(self) -> None:
        """(any thread) Stop the stream: the reader sees its end now, the engine drops it at the
        next step boundary (cancelling its run in flight when no other stream shares it)."""
        with self._lock:
            if self._finished is not None:
                return
            self.cancelled = True
        self._deliver([], FinishReason.CANCELLED, None)
        self._on_cancel(self)

    # -- reader side ---------------------------------------------------------------------------
    def _next_or_waiter(self) -> tuple[int | None, TaskFuture | None]:
        """The next token; else (None, a future to wait on); (None, None) at the end."""
        with self._lock:
            if self._ready:
                return self._ready.popleft(), None
            if self._finished is not None:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                return None, None
            if self._waiter is None:
                self._waiter = TaskFuture(label="next token")
            return None, self._waiter


class TokenStream:
    """The tokens of one ``worker.generate(...)`` call, as they are generated.

    Iterate it with ``async for`` (never blocks the event loop) or with a plain ``for`` (blocks
    the calling thread; not on an event loop); ``await stream.collect()`` /
    ``stream.collect_blocking()`` wait for the end and return every token. Leaving the loop early
    and calling ``await stream.aclose()`` (or using ``async with`` / ``with``), cancelling the
    consuming task, a timeout around it, or dropping the stream stops generation at the next step
    and frees the stream's cache. ``finish_reason`` says why it ended.

    An error of the run (an `ExecutionError`; a `DisposedError` when the worker is disposed)
    is raised by the iteration that reaches it.
    """

    def __init__(self, sequence: Sequence):
        self._sequence = sequence

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids."""
        return [int(t) for t in self._sequence.prompt]

    @property
    def tokens(self) -> list[int]:
        """The tokens released so far (stop sequences and eos are never released)."""
        with self._sequence._lock:
            return list(self._sequence._delivered)

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the stream ended (None while it runs)."""
        return self._sequence._finished

    @property
    def done(self) -> bool:
        """True once the stream ended (its last tokens may still be unread)."""
        return self._sequence.finished

    def cancel(self) -> None:
        """Stop generating (idempotent); tokens not yet read are dropped."""
        self._sequence.cancel()

    # -- async ---------------------------------------------------------------------------------
    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> int:
        while True:
            token, waiter = self._sequence._next_or_waiter()
            if token is not None:
                return token
            if waiter is None:
                raise StopAsyncIteration
            try:
                await wait_done(waiter)
            except BaseException:  # the consumer was cancelled (or timed out): so is the stream
                self.cancel()
                raise

    async def collect(self) -> list[int]:
        """Await the end of the stream; every token it released (those already read included).
        Cancelling the awaiting task cancels the stream."""
        async for _ in self:
            pass
        return self.tokens

    async def aclose(self) -> None:
        """Cancel the stream (what leaving ``async for`` early should be followed by)."""
        self.cancel()

    async def __aenter__(self) -> "TokenStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    # -- blocking ------------------------------------------------------------------------------
    def __iter__(self) -> "TokenStream":
        return self

    def __next__(self) -> int:
        while True:
            token, waiter = self._sequence._next_or_waiter()
            if token is not None:
                return token
            if waiter is None:
                raise StopIteration
            try:
                waiter.wait()
            except BaseException:  # KeyboardInterrupt on the waiting thread
                self.cancel()
                raise

    def collect_blocking(self) -> list[int]:
        """Blocking twin of [`collect`][asyncinfer.TokenStream.collect]. Do not call it on an event loop."""
        for _ in self:
            pass
        return self.tokens

    def __enter__(self) -> "TokenStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        try:
            self._sequence.cancel()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to free
            pass

    def __repr__(self) -> str:
        state = "running" if self.finish_reason is None else self.finish_reason.value
        return f"<TokenStream {len(self.prompt_ids)} prompt tokens, {len(self.tokens)} generated, {state}>"
