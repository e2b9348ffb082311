"""Text in, text out: ``worker.generate_text(prompt)`` streams decoded text pieces.

It needs the optional ``tokenizers`` package (``pip install 'asyncinfer[text]'``) and a
Hugging Face ``tokenizer.json``: beside the model file, or given (a path, a ``tokenizers.Tokenizer``
or a `TextTokenizer`).

**Incremental detokenization** (`Detokenizer`): a token is not a piece of text. A byte-level BPE
token may hold half of a UTF-8 character (an emoji is often four tokens), or a merge that ends
inside one; a SentencePiece decoder writes a token's leading space only when something comes
before it. So the growing id list is decoded, over a window that starts a few tokens back (those
give the first new token its context), and only the new suffix of that text is emitted, once it
no longer ends in U+FFFD (the replacement character of an incomplete UTF-8 sequence): that tail is
held back until the tokens that complete it arrive. The pieces of a stream concatenate to the
decoding of all its tokens at once.

**Stop strings** (`StopText`) are matched on the text, not on token ids (the same text has many
tokenizations): text that may begin a stop string is held back until it cannot; a completed stop
string ends the stream, and neither it nor anything after it is emitted.
"""
from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio.to_thread

from ...errors import AsyncInferError, InputError
from .sampling import token_ids
from .stream import FinishReason, TokenStream

TEXT_EXTRA = "pip install 'asyncinfer[text]'"
TOKENIZER_FILE = "tokenizer.json"
#: Tokens before the new one that are decoded with it (its context: a leading space, a merge).
CONTEXT_TOKENS = 6
#: Tokens held back at most while the text ends in U+FFFD: a UTF-8 character is at most 4 bytes,
#: so a longer run is bytes that will never form one (a model emitting garbage), not a split character.
MAX_HELD_TOKENS = 16
#: Prompts longer than this (characters) are encoded on a helper thread, not on the event loop.
INLINE_ENCODE_CHARS = 16_384
REPLACEMENT = "\ufffd"


class TokenizerUnavailableError(AsyncInferError, ImportError):
    """Text generation was asked for without the optional ``tokenizers`` package."""


def require_tokenizers() -> Any:
    """The ``tokenizers`` module, or a `TokenizerUnavailableError` naming the extra that brings it."""
    if importlib.util.find_spec("tokenizers") is None:
        raise TokenizerUnavailableError("text generation needs the optional 'tokenizers' package: " + TEXT_EXTRA)
    import tokenizers

    return tokenizers


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file beside the tokenizer; {} when absent, InputError when malformed."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{path.name} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path.name} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` and what generation reads beside it.

    Args:
        tokenizer: the ``tokenizers.Tokenizer``.
        eos_token_ids: ids that end a stream when the caller names none.
        special_tokens: ``bos_token``, ``eos_token``… as text (what chat templates use).
        chat_template: the Jinja chat template of ``tokenizer_config.json`` (or ``chat_template.jinja``).
        source: where it was read (for messages).
    """

    def __init__(self, tokenizer: Any, *, eos_token_ids: Sequence[int] = (),
                 special_tokens: dict[str, str] | None = None, chat_template: str | None = None,
                 source: str = "<memory>"):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.special_tokens = dict(special_tokens or {})
        self.chat_template = chat_template
        self.source = source

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TextTokenizer:
        """Read ``tokenizer.json`` (``path`` is the file or its folder) and, from the same folder when
        present, ``tokenizer_config.json`` (special tokens, chat template), ``chat_template.jinja``,
        ``generation_config.json`` and ``config.json`` (eos ids). Blocking file I/O: call it on a
        thread from async code.

        Raises:
            TokenizerUnavailableError: the ``tokenizers`` package is not installed.
            InputError: no such file, or a file that cannot be read.
        """
        tokenizers = require_tokenizers()
        file = Path(path)
        if file.is_dir():
            file = file / TOKENIZER_FILE
        if not file.is_file():
            raise InputError(f"no tokenizer: {os.fspath(file)!r} is not a file")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(os.fspath(file))
        except Exception as exc:  # noqa: BLE001 - the Rust side raises a plain Exception
            raise InputError(f"{file.name} is not a tokenizer the tokenizers package reads: {exc}") from None
        folder = file.parent
        config = _read_json(folder / "tokenizer_config.json")
        special = {key: text for key, value in config.items()
                   if key.endswith("_token") and (text := _token_text(value)) is not None}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = folder / "chat_template.jinja"
        if not isinstance(template, str) and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            value = _read_json(folder / name).get("eos_token_id")
            if value is not None:
                eos = list(token_ids(value, f"eos_token_id of {name}"))
                break
        if not eos and special.get("eos_token") is not None:
            found = tokenizer.token_to_id(special["eos_token"])
            eos = [] if found is None else [found]
        return cls(tokenizer, eos_token_ids=eos, special_tokens=special,
                   chat_template=template if isinstance(template, str) else None, source=os.fspath(file))

    @classmethod
    def of(cls, tokenizer: Any) -> TextTokenizer:
        """``tokenizer`` as a TextTokenizer: itself, a wrapped ``tokenizers.Tokenizer`` (no eos ids
        or chat template then), or `load` of a path."""
        if isinstance(tokenizer, TextTokenizer):
            return tokenizer
        if isinstance(tokenizer, (str, os.PathLike)):
            return cls.load(tokenizer)
        tokenizers = require_tokenizers()
        if isinstance(tokenizer, tokenizers.Tokenizer):
            return cls(tokenizer)
        raise InputError(f"tokenizer must be a tokenizers.Tokenizer, an asyncinfer.TextTokenizer or the path of a "
                         f"tokenizer.json, got {type(tokenizer).__name__}")

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows (added tokens included)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text`` (with the tokenizer's own BOS and the like when asked)."""
        if not isinstance(text, str):
            raise InputError(f"the prompt must be text (str), got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (ids the tokenizer does not know are skipped)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def __repr__(self) -> str:
        return f"<TextTokenizer {self.source}, {self.vocab_size} tokens>"


class TokenizerSource:
    """A tokenizer loaded once, when first needed (file I/O happens off the event loop)."""

    def __init__(self, given: Any = None, path: str | os.PathLike[str] | None = None):
        self._loaded: TextTokenizer | None = None
        self._path = path
        self._lock = threading.Lock()
        require_tokenizers()
        if given is not None:
            if isinstance(given, (str, os.PathLike)):
                self._path = given
            else:
                self._loaded = TextTokenizer.of(given)

    @classmethod
    def for_model(cls, model_source: str, model_name: str) -> TokenizerSource:
        """The ``tokenizer.json`` beside a model file; InputError when there is none."""
        folder = Path(model_source).parent if model_source and model_source != "<memory>" else None
        if folder is None or not (folder / TOKENIZER_FILE).is_file():
            where = f"in {os.fspath(folder)!r}" if folder is not None else "(it was loaded from memory, not a file)"
            raise InputError(f"model {model_name!r} has no {TOKENIZER_FILE} beside it {where}: pass tokenizer= "
                             "(a path, a tokenizers.Tokenizer or an asyncinfer.TextTokenizer)")
        return cls(path=folder / TOKENIZER_FILE)

    @property
    def loaded(self) -> TextTokenizer | None:
        """The tokenizer when it is loaded already."""
        return self._loaded

    def get(self) -> TextTokenizer:
        """The tokenizer, loaded now if it was not (blocking)."""
        with self._lock:
            if self._loaded is None:
                assert self._path is not None
                self._loaded = TextTokenizer.load(self._path)
            return self._loaded


class Detokenizer:
    """The text of one stream's tokens, a stable piece at a time (see the module docstring).

    Args:
        tokenizer: the stream's tokenizer.
        prompt_ids: the prompt: its last tokens are the first new token's context.
        skip_special_tokens: leave special tokens (eos, padding…) out of the text.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(t) for t in prompt_ids[max(len(prompt_ids) - CONTEXT_TOKENS, 0):]]
        self._prefix = 0                # the window decoded starts here
        self._read = len(self._ids)     # tokens before this are emitted
        self._prefix_text = self._decode(self._prefix, self._read)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def push(self, token: int) -> str:
        """Add a token; the new text now stable ('' while it ends inside a character)."""
        self._ids.append(int(token))
        text = self._decode(self._prefix)
        if text.endswith(REPLACEMENT) and len(self._ids) - self._read < MAX_HELD_TOKENS:
            return ""
        return self._advance(text)

    def flush(self) -> str:
        """The text still held back, at the end of the stream (an incomplete character shows as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._advance(self._decode(self._prefix))

    def _advance(self, text: str) -> str:
        piece = text[len(self._prefix_text):] if len(text) > len(self._prefix_text) else ""
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        return piece


class StopText:
    """Ends a stream on stop strings, holding back text that may begin one until it cannot."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(stops)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; the text now safe to emit, and whether a stop string completed (the text
        before it is then the last to emit)."""
        if not self.stops:
            return text, False
        held = self._held + text
        found = [i for i in (held.find(s) for s in self.stops) if i >= 0]
        if found:
            self._held = ""
            return held[:min(found)], True
        keep = 0  # the longest tail of held that begins some stop string
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(held)), keep, -1):
                if held.endswith(stop[:n]):
                    keep = n
                    break
        self._held = held[len(held) - keep:]
        return held[:len(held) - keep], False

    def flush(self) -> str:
        """The text still held, at the end of a stream that stopped for another reason."""
        held, self._held = self._held, ""
        return held


def stop_strings(stop: Any) -> tuple[str, ...]:
    """``stop`` (None, a string, or a sequence of strings) as a tuple of non-empty strings."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise InputError(f"stop must be a string or a list of strings for text generation, got {stop!r:.80}")
    if any(not s for s in items):
        raise InputError("stop holds an empty string")
    return tuple(items)


Submit = Callable[..., TokenStream]


class TextStream:
    """The text of one ``worker.generate_text(...)`` call, in pieces as it is generated.

    ``async for piece in stream`` (never blocks the event loop), ``await stream.collect()`` (the
    whole text), ``for piece in stream`` / ``stream.collect_blocking()`` on a thread. The prompt
    is tokenized and the stream started by `start` (``await``), which the first iteration calls:
    an error in the prompt or the options (an `InputError`) is raised there. Leaving the loop
    early with ``aclose()`` (or ``async with``), cancelling the consumer, or a stop string stops
    generation at the next step and frees the stream's cache, as for a `TokenStream`.
    """

    def __init__(self, submit: Submit, tokenizer: TokenizerSource, prompt: str | Sequence[int], *,
                 stop: tuple[str, ...] = (), eos_token_id: Any = None, add_special_tokens: bool = True,
                 skip_special_tokens: bool = True, options: dict[str, Any] | None = None):
        if not isinstance(prompt, str):
            prompt = list(token_ids(prompt, "prompt"))
        self._submit, self._source, self._prompt = submit, tokenizer, prompt
        self._stop = StopText(stop)
        self._eos, self._add_special, self._skip_special = eos_token_id, add_special_tokens, skip_special_tokens
        self._options = dict(options or {})
        self._tokens: TokenStream | None = None
        self._detokenizer: Detokenizer | None = None
        self._prompt_ids: list[int] = []
        self._pieces: deque[tuple[str, int | None]] = deque()
        self._text: list[str] = []
        self._stopped = False       # a stop string completed
        self._ended = False         # nothing more will be queued
        self._cancelled = False
        self._start_lock = threading.Lock()

    # -- starting --------------------------------------------------------------------------------
    def start_blocking(self) -> None:
        """Blocking twin of `start`: loads the tokenizer and encodes the prompt on the calling thread."""
        with self._start_lock:
            if self._tokens is not None:
                return
            if self._cancelled:
                raise InputError("this text stream was cancelled before it started")
            tokenizer = self._source.get()
            ids = tokenizer.encode(self._prompt, add_special_tokens=self._add_special) \
                if isinstance(self._prompt, str) else list(self._prompt)
            if not ids:
                raise InputError("the prompt encodes to no token at all: give some text")
            eos = tokenizer.eos_token_ids if self._eos is None else self._eos
            self._tokens = self._submit(ids, eos_token_id=eos, **self._options)
            self._prompt_ids = ids
            self._detokenizer = Detokenizer(tokenizer, ids, skip_special_tokens=self._skip_special)

    async def start(self) -> None:
        """Tokenize the prompt and start generating (idempotent; the first iteration calls it).
        The tokenizer is loaded, and a long prompt encoded, on a helper thread.

        Raises:
            InputError: a bad prompt or option (empty, longer than the model's context…), or a
                tokenizer file that cannot be read.
        """
        if self._tokens is not None:
            return
        slow = self._source.loaded is None or (isinstance(self._prompt, str)
                                               and len(self._prompt) > INLINE_ENCODE_CHARS)
        if not slow:
            self.start_blocking()
            return
        try:
            await anyio.to_thread.run_sync(self.start_blocking)
        except BaseException:
            if self._tokens is not None:  # cancelled while the helper thread started it
                self._tokens.cancel()
            raise

    # -- state -----------------------------------------------------------------------------------
    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's token ids (empty before the stream starts)."""
        return list(self._prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        """The tokens generated and released so far (eos and stop-sequence tokens are not)."""
        return [] if self._tokens is None else self._tokens.tokens

    @property
    def text(self) -> str:
        """The text yielded so far."""
        return "".join(self._text)

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the stream ended (None while it runs): a stop string is `FinishReason.STOP`."""
        if self._stopped:
            return FinishReason.STOP
        if self._cancelled and self._tokens is None:
            return FinishReason.CANCELLED
        return None if self._tokens is None or not self._ended else self._tokens.finish_reason

    def cancel(self) -> None:
        """Stop generating (idempotent); text not yet read is dropped."""
        self._cancelled = True
        self._ended = True
        self._pieces.clear()
        if self._tokens is not None:
            self._tokens.cancel()

    # -- the pieces ------------------------------------------------------------------------------
    def _feed(self, token: int | None) -> None:
        """Queue the text that ``token`` makes stable (None: the stream ended: flush)."""
        assert self._detokenizer is not None and self._tokens is not None
        text = self._detokenizer.push(token) if token is not None else self._detokenizer.flush()
        released, stopped = self._stop.push(text)
        if token is None and not stopped:
            released += self._stop.flush()
        if released or token is not None:
            self._pieces.append((released, token))
        if stopped:
            self._stopped = True
            self._tokens.cancel()  # the cache goes at the next step boundary
        if stopped or token is None:
            self._ended = True

    def _take(self) -> tuple[str, int | None]:
        piece = self._pieces.popleft()
        if piece[0]:
            self._text.append(piece[0])
        return piece

    async def _next_delta(self) -> tuple[str, int | None]:
        await self.start()
        assert self._tokens is not None
        while not self._pieces:
            if self._ended:
                raise StopAsyncIteration
            try:
                token: int | None = await self._tokens.__anext__()
            except StopAsyncIteration:
                token = None
            except BaseException:  # the run failed, or the consumer was cancelled: the stream is over
                self._ended = True
                raise
            if self._cancelled:
                raise StopAsyncIteration
            self._feed(token)
        return self._take()

    def _next_delta_blocking(self) -> tuple[str, int | None]:
        self.start_blocking()
        assert self._tokens is not None
        while not self._pieces:
            if self._ended:
                raise StopIteration
            try:
                token = next(self._tokens, None)
            except BaseException:
                self._ended = True
                raise
            if self._cancelled:
                raise StopIteration
            self._feed(token)
        return self._take()

    async def deltas(self) -> AsyncIterator[tuple[str, int | None]]:
        """Every step of the stream as ``(text, token_id)``: one per generated token (``text`` may
        be '' while a character is incomplete or a stop string possible), then ``(text, None)``
        for text held back to the end. What servers use to time and count tokens."""
        while True:
            try:
                yield await self._next_delta()
            except StopAsyncIteration:
                return

    def __aiter__(self) -> TextStream:
        return self

    async def __anext__(self) -> str:
        while True:
            text, _ = await self._next_delta()
            if text:
                return text

    async def collect(self) -> str:
        """Await the end of the stream; the whole text (pieces already read included)."""
        async for _ in self:
            pass
        return self.text

    async def aclose(self) -> None:
        """Cancel the stream (what leaving ``async for`` early should be followed by)."""
        self.cancel()

    async def __aenter__(self) -> TextStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while True:
            text, _ = self._next_delta_blocking()
            if text:
                return text

    def collect_blocking(self) -> str:
        """Blocking twin of `collect`. Do not call it on an event loop."""
        for _ in self:
            pass
        return self.text

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __repr__(self) -> str:
        reason = self.finish_reason
        state = "not started" if self._tokens is None and reason is None else \
            "running" if reason is None else reason.value
        return f"<TextStream {len(self.text)} characters, {len(self.token_ids)} tokens, {state}>"
