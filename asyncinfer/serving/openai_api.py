"""OpenAI's completions API for the served decoders, so the ``openai`` client works unchanged.

==================================  =================================================================
``POST /v1/completions``            a prompt (text, or token ids) → text; ``stream: true`` for events
``POST /v1/chat/completions``       messages → the assistant's reply, rendered with the model's chat
                                    template (`.chat`); ``stream: true`` for events
``GET  /v1/models``                 the served decoders
==================================  =================================================================

Streams are server-sent events (``data: {chunk}``, ending with ``data: [DONE]``); with
``stream_options: {"include_usage": true}`` a last chunk carries the token counts. Supported
request fields: ``model``, ``prompt`` / ``messages``, ``max_tokens`` (chat: also
``max_completion_tokens``), ``temperature`` (default 1, as OpenAI's: sampling; 0 is greedy),
``top_p``, ``top_k`` (an extension, as vLLM's), ``seed``, ``stop`` (strings), ``stream``,
``stream_options``, ``user``; ``n``, ``logprobs``, penalties, ``logit_bias``, ``echo``,
``suffix``, ``best_of``, tools and non-text response formats are refused unless they ask for
what is done anyway (``n: 1``, ``logprobs: null``…). An unknown field is a 400, as OpenAI's.

Errors are OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` (404 with ``code: model_not_found`` for an unknown model), 413, 408/504
``timeout``, 503 with ``Retry-After``, 500 ``server_error``.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..runtime.generation import TextTokenizer
from . import chat
from .generate_http import DONE, GenerationProtocol, GenerationResponse, _dumps
from .generation import (Delta, Generation, GenerationOptions, ParameterError, decoder_of, is_decoder,
                         start_generation)
from .protocol import ProtocolError
from .service import SERVER_NAME, Call, InferenceService

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: up to the context)
MAX_TEMPERATURE = 2.0
MAX_STOPS = 4
# fields that are refused unless they ask for what is done anyway, with the values that do
_DEFAULTS_ONLY: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "logprobs": (None, False),
    "top_logprobs": (None, 0), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "logit_bias": (None,), "tools": (None,), "tool_choice": (None, "none"), "functions": (None,),
    "function_call": (None, "none"), "response_format": (None,),
}
_IGNORED = ("user", "store", "metadata", "service_tier", "parallel_tool_calls")
_COMMON = ("model", "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "stop", "max_tokens")


class _OpenAIRequest(GenerationProtocol):
    """What completions and chat completions share."""

    object_name = ""
    id_prefix = ""
    fields: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = False
        self.options = GenerationOptions()

    def parse(self, body: dict[str, Any], path_params: dict[str, str]) -> None:
        known = set(_COMMON) | set(self.fields) | set(_DEFAULTS_ONLY) | set(_IGNORED)
        for key in body:
            if key not in known:
                raise ParameterError(key, f"Unrecognized request argument supplied: {key}")
        for key, allowed in _DEFAULTS_ONLY.items():
            value = body.get(key)
            if key in body and value not in allowed and not (key == "logit_bias" and value == {}) \
                    and not (key == "tools" and value == []) and not (key == "response_format" and value ==
                                                                       {"type": "text"}):
                raise ParameterError(key, f"'{key}' is not supported by this server (asyncinfer) beyond its "
                                          f"default; got {value!r:.60}")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ParameterError("model", "'model' must name a served model (GET /v1/models lists them)")
        self.name = model
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise ParameterError("stream", "'stream' must be true or false")
        self.stream = bool(stream)
        stream_options = body.get("stream_options")
        if stream_options is not None:
            if not isinstance(stream_options, dict) or not isinstance(stream_options.get("include_usage", False), bool):
                raise ParameterError("stream_options", "'stream_options' must be {\"include_usage\": true|false}")
            self.include_usage = bool(stream_options.get("include_usage", False))
        stop = body.get("stop")
        if isinstance(stop, list) and len(stop) > MAX_STOPS:
            raise ParameterError("stop", f"'stop' holds at most {MAX_STOPS} strings, got {len(stop)}")
        self.options = GenerationOptions.checked(
            max_tokens=self.max_tokens(body), temperature=body.get("temperature", 1.0), top_k=body.get("top_k"),
            top_p=body.get("top_p"), seed=body.get("seed"), stop=stop, max_temperature=MAX_TEMPERATURE,
            names=self.names(body))
        self.parse_prompt(body)

    def max_tokens(self, body: dict[str, Any]) -> Any:
        return body.get("max_tokens")

    def names(self, body: dict[str, Any]) -> dict[str, str]:
        return {}

    def parse_prompt(self, body: dict[str, Any]) -> None:
        raise NotImplementedError

    # -- answers ---------------------------------------------------------------------------------
    def error_body(self, error: ProtocolError) -> dict[str, Any]:
        return openai_error(error)

    def error_event(self, error: ProtocolError) -> list[Any]:
        return [openai_error(error), DONE]

    def usage(self, generation: Generation) -> dict[str, int]:
        prompt, completion = generation.prompt_tokens, generation.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.id, "object": self.object_name + ".chunk" if self.object_name ==
                                 "chat.completion" else self.object_name, "created": self.created,
                                 "model": self.name, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def tail_events(self, generation: Generation) -> list[Any]:
        events: list[Any] = [self.chunk([self.final_choice(generation)])]
        if self.include_usage:
            usage = self.chunk([])
            usage["usage"] = self.usage(generation)
            events.append(usage)
        return events + [DONE]

    def final_choice(self, generation: Generation) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRequest(_OpenAIRequest):
    """``POST /v1/completions``."""

    object_name = "text_completion"
    id_prefix = "cmpl"
    fields = ("prompt",)

    def max_tokens(self, body: dict[str, Any]) -> Any:
        return body.get("max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)

    def parse_prompt(self, body: dict[str, Any]) -> None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, str):
            if not prompt:
                raise ParameterError("prompt", "'prompt' is empty")
            self.prompt: str | list[int] = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            self.prompt = prompt
        elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise ParameterError("prompt", f"one prompt per request: got {len(prompt)} (send them as separate, "
                                           "concurrent requests: they are batched together)")
        else:
            raise ParameterError("prompt", "'prompt' must be a string or an array of token ids")

    async def begin(self, call: Call, service: InferenceService) -> Generation:
        await _tokenizer(call)
        return await start_generation(call, self.prompt, self.options, metrics=service.metrics)

    def delta_event(self, generation: Generation, delta: Delta) -> Any | None:
        if not delta.text:
            return None
        return self.chunk([{"index": 0, "text": delta.text, "logprobs": None, "finish_reason": None}])

    def final_choice(self, generation: Generation) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": generation.finish_reason}

    def response(self, generation: Generation, text: str, tokens: list[int]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": generation.finish_reason}],
                "usage": self.usage(generation)}


class ChatCompletionRequest(_OpenAIRequest):
    """``POST /v1/chat/completions``."""

    object_name = "chat.completion"
    id_prefix = "chatcmpl"
    fields = ("messages", "max_completion_tokens")

    def max_tokens(self, body: dict[str, Any]) -> Any:
        return body.get("max_completion_tokens", body.get("max_tokens"))

    def names(self, body: dict[str, Any]) -> dict[str, str]:
        return {"max_tokens": "max_completion_tokens"} if "max_completion_tokens" in body else {}

    def parse_prompt(self, body: dict[str, Any]) -> None:
        try:
            self.messages = chat.messages_of(body.get("messages"))
        except ProtocolError as exc:
            raise ParameterError("messages", exc.message) from None

    async def begin(self, call: Call, service: InferenceService) -> Generation:
        prompt, templated = chat.render(self.messages, await _tokenizer(call))
        return await start_generation(call, prompt, self.options, metrics=service.metrics,
                                      add_special_tokens=not templated)

    def head_events(self, generation: Generation) -> list[Any]:
        return [self.chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])]

    def delta_event(self, generation: Generation, delta: Delta) -> Any | None:
        if not delta.text:
            return None
        return self.chunk([{"index": 0, "delta": {"content": delta.text}, "logprobs": None, "finish_reason": None}])

    def final_choice(self, generation: Generation) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": generation.finish_reason}

    def response(self, generation: Generation, text: str, tokens: list[int]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": generation.finish_reason}],
                "usage": self.usage(generation)}


async def _tokenizer(call: Call) -> TextTokenizer:
    """The model's tokenizer: OpenAI's API answers text (400 for a model without one)."""
    decoder = await decoder_of(call.served)
    if decoder.tokenizer is None:
        raise ProtocolError(400, f"OpenAI's API answers text, which needs the model's tokenizer: {decoder.why} "
                                 "(POST /v2/models/{name}/generate takes and returns token ids)")
    return decoder.tokenizer


def openai_error(error: ProtocolError) -> dict[str, Any]:
    """``error`` as OpenAI's error object."""
    kind = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
            408: "timeout", 413: "invalid_request_error", 503: "server_error", 504: "timeout"}
    code = None
    if error.status == 404 and "unknown model" in error.message:
        code = "model_not_found"
    elif "context" in error.message and error.status == 400:
        code = "context_length_exceeded"
    param = getattr(error, "param", None)
    if code == "model_not_found":
        param = "model"
    return {"error": {"message": error.message, "type": kind.get(error.status, "server_error"), "param": param,
                      "code": code}}


def _json(content: Any, status: int = 200) -> Response:
    return Response(_dumps(content), status_code=status, media_type="application/json")


async def _completions(request: Request) -> GenerationResponse:
    return GenerationResponse(request, CompletionRequest())


async def _chat_completions(request: Request) -> GenerationResponse:
    return GenerationResponse(request, ChatCompletionRequest())


async def _models(request: Request) -> Response:
    service: InferenceService = request.app.state.service
    data = [{"id": name, "object": "model", "created": 0, "owned_by": SERVER_NAME}
            for name, served in sorted(service.models.items()) if is_decoder(served)]
    return _json({"object": "list", "data": data})


async def _model(request: Request) -> Response:
    service: InferenceService = request.app.state.service
    name = request.path_params["name"]
    served = service.models.get(name)
    if served is None or not is_decoder(served):
        return _json(openai_error(ProtocolError(404, f"unknown model {name!r}: GET /v1/models lists the served "
                                                     "decoders")), 404)
    return _json({"id": name, "object": "model", "created": 0, "owned_by": SERVER_NAME})


async def _unknown(request: Request) -> Response:
    return _json(openai_error(ProtocolError(404, f"no such endpoint: {request.method} {request.url.path}")), 404)


def openai_routes() -> Sequence[Route]:
    """The ``/v1`` routes (mounted by `.server`)."""
    return [
        Route("/v1/chat/completions", _chat_completions, methods=["POST"]),
        Route("/v1/completions", _completions, methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/v1/models/{name:path}", _model, methods=["GET"]),
        Route("/v1/{rest:path}", _unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ]
