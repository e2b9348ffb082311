"""Generation requests to an inference service, whatever the protocol (OpenAI's, Triton's generate).

A served model is a **decoder** when its inputs and outputs fit a decoder convention
(`asyncinfer.runtime.generation.detect`), or when its ``config.pbtxt`` says so with the parameter
``generation`` (``"true"``; ``"false"`` keeps a decoder out of the generation endpoints). Its
**tokenizer** is the ``tokenizer.json`` beside the model file (in a model repository, also the
model's directory, shared by its versions), read once on a helper thread; without one, a decoder
still generates from token ids (Triton's endpoint with ``input_ids``).

A protocol adapter decodes its request into a prompt and `GenerationOptions`, then::

    async with service.request(name, version) as call:          # 404, 503 (admission)
        generation = await start_generation(call, prompt, options)   # 400: not a decoder, bad prompt…
        async for delta in generation.deltas():                  # one per token (+ a final flush)
            ...                                                   # delta.text, delta.token
        generation.close()                                        # metrics; the stream cancelled if running

Every error is a `ProtocolError` (400 for the client's, 500 for the model's, 503 when the model
goes away); `ParameterError` also names the request field at fault. Each token is timed into the
service's metrics (time to first token, inter-token latency, tokens), and the request counts as
one inference in the statistics.
"""
from __future__ import annotations

import logging
import math
import numbers
import time
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread

from ..errors import AsyncInferError, DisposedError, InputError
from ..runtime.generation import FinishReason, TextStream, TextTokenizer, TokenStream, TokenizerUnavailableError
from ..runtime.generation import detect
from ..runtime.generation.text import TOKENIZER_FILE
from . import chat
from .admission import unavailable
from .metrics import ServerMetrics
from .protocol import ProtocolError
from .served import ServedModel
from .service import Call

GENERATION_PARAMETER = "generation"  # config.pbtxt: "true" marks a decoder, "false" hides one
DEFAULT_MAX_TOKENS = 1024  # when a request names no limit and the model declares no context
logger = logging.getLogger(__name__)


class ParameterError(ProtocolError):
    """A 400 about one request field, named in ``param`` (OpenAI's error object has it)."""

    def __init__(self, param: str, message: str):
        super().__init__(400, message)
        self.param = param


@dataclass(frozen=True)
class GenerationOptions:
    """How one request generates (checked by `GenerationOptions.checked`)."""

    max_tokens: int | None = None  # None: up to the model's context (or DEFAULT_MAX_TOKENS)
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()  # extra end-of-sequence ids (Triton's end_id)

    @classmethod
    def checked(cls, *, max_tokens: Any = None, temperature: Any = 0.0, top_k: Any = None, top_p: Any = None,
                seed: Any = None, stop: Any = None, stop_ids: Any = None, max_temperature: float = math.inf,
                names: dict[str, str] | None = None) -> GenerationOptions:
        """The options of a request's JSON values; `ParameterError` names the field at fault
        (``names`` maps an option to the request's own field name)."""
        names = names or {}

        def name(option: str) -> str:
            return names.get(option, option)

        if max_tokens is not None and (not _integer(max_tokens) or max_tokens < 1):
            raise ParameterError(name("max_tokens"), f"'{name('max_tokens')}' must be an integer >= 1, "
                                                     f"got {max_tokens!r:.40}")
        if temperature is None:
            temperature = 0.0
        if (not isinstance(temperature, numbers.Real) or isinstance(temperature, bool)
                or not 0 <= temperature <= max_temperature):
            top = "" if math.isinf(max_temperature) else f" and <= {max_temperature:g}"
            raise ParameterError(name("temperature"), f"'{name('temperature')}' must be a number >= 0{top}, "
                                                      f"got {temperature!r:.40}")
        if top_k is not None and top_k != -1 and (not _integer(top_k) or top_k < 1):  # -1: off (vLLM's spelling)
            raise ParameterError(name("top_k"), f"'{name('top_k')}' must be an integer >= 1 (or -1: off), "
                                                f"got {top_k!r:.40}")
        if top_p is not None and (not isinstance(top_p, numbers.Real) or isinstance(top_p, bool)
                                  or not 0 < top_p <= 1):
            raise ParameterError(name("top_p"), f"'{name('top_p')}' must be a number in (0, 1], got {top_p!r:.40}")
        if seed is not None and (not _integer(seed) or seed < 0):
            raise ParameterError(name("seed"), f"'{name('seed')}' must be a non-negative integer, got {seed!r:.40}")
        stops: tuple[str, ...] = ()
        if stop is not None:
            items = [stop] if isinstance(stop, str) else stop
            if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
                raise ParameterError(name("stop"), f"'{name('stop')}' must be a string or an array of strings")
            stops = tuple(s for s in items if s)  # "" stops nothing (some clients send [""])
        ids: tuple[int, ...] = ()
        if stop_ids is not None:
            items = [stop_ids] if _integer(stop_ids) else stop_ids
            if not isinstance(items, list) or not all(_integer(t) and t >= 0 for t in items):
                raise ParameterError(name("stop_ids"), f"'{name('stop_ids')}' must be a token id or an array of "
                                                       "token ids")
            ids = tuple(int(t) for t in items)
        return cls(max_tokens=None if max_tokens is None else int(max_tokens), temperature=float(temperature),
                   top_k=None if top_k in (None, -1) else int(top_k),
                   top_p=None if top_p in (None, 1) else float(top_p),
                   seed=None if seed is None else int(seed), stop=stops, stop_ids=ids)


def _integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# -- which served models are decoders -------------------------------------------------------------
def decoder_problem(served: ServedModel) -> str | None:
    """Why ``served`` is not served for generation (None: it is); found once per served version."""
    if served in _problems:
        return _problems[served]
    assert served.model is not None
    marked = served.settings.parameters.get(GENERATION_PARAMETER, "").strip().lower()
    problem = None
    if marked == "false":
        problem = f"model {served.name!r} is not served for generation (its config sets {GENERATION_PARAMETER}: false)"
    else:
        try:
            detect(served.model)
        except InputError as exc:
            problem = str(exc)
    _problems[served] = problem
    return problem


def is_decoder(served: ServedModel) -> bool:
    """Whether ``served`` is listed as a decoder (``/v1/models``): detected, or marked in its config
    (a marked model that fits no convention is listed; its requests get the reason)."""
    marked = served.settings.parameters.get(GENERATION_PARAMETER, "").strip().lower()
    return served.model is not None and (marked == "true" or (marked != "false" and decoder_problem(served) is None))


@dataclass(frozen=True)
class Decoder:
    """A served decoder and its tokenizer (None: token ids only; ``why`` says why)."""

    tokenizer: TextTokenizer | None
    why: str = ""


_decoders: weakref.WeakKeyDictionary[ServedModel, Decoder] = weakref.WeakKeyDictionary()
_problems: weakref.WeakKeyDictionary[ServedModel, str | None] = weakref.WeakKeyDictionary()


async def decoder_of(served: ServedModel) -> Decoder:
    """``served`` as a decoder, its tokenizer read once (on a helper thread); ProtocolError 400
    when it is not one."""
    found = _decoders.get(served)
    if found is not None:
        return found
    problem = decoder_problem(served)
    if problem is not None:
        raise ProtocolError(400, problem)
    found = await anyio.to_thread.run_sync(_read_tokenizer, served)
    _decoders[served] = found
    return found


def _read_tokenizer(served: ServedModel) -> Decoder:
    assert served.model is not None
    source = served.model.source
    if not source or source == "<memory>":
        return Decoder(None, f"model {served.name!r} was given from memory, so no {TOKENIZER_FILE} is beside it")
    folder = Path(source).parent
    candidates = [folder, folder.parent] if folder.name == served.version else [folder]  # a repository's version dir
    for candidate in candidates:
        if (candidate / TOKENIZER_FILE).is_file():
            try:
                tokenizer = TextTokenizer.load(candidate)
                chat.prepare(tokenizer)  # the template compiled here, on this helper thread
                return Decoder(tokenizer)
            except TokenizerUnavailableError as exc:
                logger.warning("model %r: %s", served.name, exc)
                return Decoder(None, str(exc))
            except InputError as exc:
                logger.error("model %r: its tokenizer cannot be read: %s", served.name, exc)
                return Decoder(None, f"its tokenizer cannot be read: {exc}")
    return Decoder(None, f"model {served.name!r} has no {TOKENIZER_FILE} beside its model file")


# -- one request -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Delta:
    """One step of a generation: the text it made stable (None: no tokenizer) and its token
    (None: the text held back to the end)."""

    text: str | None
    token: int | None


class Generation:
    """One generation request in flight (made by `start_generation`)."""

    def __init__(self, call: Call, stream: TextStream | TokenStream, began: float, metrics: ServerMetrics | None):
        self.call = call
        self.stream = stream
        self._metrics = metrics
        self._began = began
        self._last: float | None = None
        self._ended = False
        self.has_text = isinstance(stream, TextStream)

    @property
    def prompt_tokens(self) -> int:
        return len(self.stream.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.stream.token_ids if isinstance(self.stream, TextStream) else self.stream.tokens)

    @property
    def finish_reason(self) -> str:
        """``stop``, ``length``, ``cancelled`` or ``error`` (``cancelled`` while it runs)."""
        reason = self.stream.finish_reason
        return (reason or FinishReason.CANCELLED).value

    async def deltas(self) -> AsyncIterator[Delta]:
        """The stream's steps; errors as ProtocolError (500: the model failed; 503: unloaded)."""
        try:
            if isinstance(self.stream, TextStream):
                async for text, token in self.stream.deltas():
                    self._timed(token)
                    yield Delta(text, token)
            else:
                async for token in self.stream:
                    self._timed(token)
                    yield Delta(None, token)
        except ProtocolError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped, the server stays up
            raise protocol_error(exc, self.call.name) from None

    def _timed(self, token: int | None) -> None:
        if token is None:
            return
        now = time.perf_counter()
        metrics = self._metrics
        if metrics is not None:
            first = self._last is None
            metrics.observe_token(self.call.name, self.call.version, now - (self._began if first else self._last),
                                  first)
        self._last = now

    def close(self, *, succeeded: bool) -> None:
        """The request is over: cancel the stream if it still runs (its cache goes at the next
        step), count the run and how it ended."""
        if self._ended:
            return
        self._ended = True
        self.stream.cancel()
        reason = self.stream.finish_reason
        if succeeded:
            self.call.record_run(1, int((time.perf_counter() - self._began) * 1e9))
        metrics = self._metrics
        if metrics is not None:
            metrics.observe_stream_end(self.call.name, self.call.version,
                                       reason.value if reason is not None else FinishReason.CANCELLED.value)


async def start_generation(call: Call, prompt: str | Sequence[int], options: GenerationOptions, *,
                           metrics: ServerMetrics | None = None, add_special_tokens: bool = True) -> Generation:
    """Start generating for an admitted ``call``: ``prompt`` is text (needs the model's
    tokenizer) or token ids. ProtocolError 400 when the model is no decoder or the prompt or
    options do not fit it (too long for its context, an id beyond its vocabulary…)."""
    began = time.perf_counter()
    served = call.served
    decoder = await decoder_of(served)
    worker = served.worker
    if worker is None:
        raise unavailable(f"model {call.name!r} is not loaded (server starting or stopping)")
    max_tokens = options.max_tokens or _context(served) or DEFAULT_MAX_TOKENS
    common = dict(max_new_tokens=max_tokens, temperature=options.temperature, top_k=options.top_k,
                  top_p=options.top_p, seed=options.seed)
    try:
        if decoder.tokenizer is not None:
            eos = None if not options.stop_ids else tuple(decoder.tokenizer.eos_token_ids) + options.stop_ids
            text = worker.generate_text(prompt, tokenizer=decoder.tokenizer, stop=options.stop or None,
                                        eos_token_id=eos, add_special_tokens=add_special_tokens, **common)
            await text.start()
            return Generation(call, text, began, metrics)
        if isinstance(prompt, str):
            raise ProtocolError(400, f"{decoder.why}: send the prompt as token ids")
        if options.stop:
            raise ParameterError("stop", f"stop strings need the model's tokenizer ({decoder.why})")
        tokens = worker.generate(list(prompt), eos_token_id=options.stop_ids or None, **common)
        return Generation(call, tokens, began, metrics)
    except ProtocolError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped, the server stays up
        raise protocol_error(exc, call.name) from None


def _context(served: ServedModel) -> int | None:
    assert served.model is not None
    try:
        return detect(served.model).max_context
    except InputError:
        return None


def protocol_error(exc: BaseException, model: str) -> ProtocolError:
    """An engine error as the status it answers: 400 the request's fault, 503 the model went
    away, 500 the model (or the server) failed."""
    if isinstance(exc, InputError):
        return ProtocolError(400, str(exc))
    if isinstance(exc, DisposedError):
        return unavailable(f"model {model!r} was unloaded: {exc}")
    if isinstance(exc, TokenizerUnavailableError):
        return ProtocolError(500, f"this server cannot handle text: {exc}")
    if isinstance(exc, AsyncInferError):
        return ProtocolError(500, f"{type(exc).__name__}: {exc}")
    logger.exception("generation on model %r raised %s", model, type(exc).__name__, exc_info=exc)
    return ProtocolError(500, f"internal server error ({type(exc).__name__})")
