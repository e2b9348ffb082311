"""Triton's generate extension for the served decoders.

==================================================  ==================================================
``POST /v2/models/{name}/generate``                 one JSON answer
``POST /v2/models/{name}/generate_stream``          server-sent events, one per piece of text
==================================================  ==================================================

(each also under ``/v2/models/{name}/versions/{version}/...``). The request is Triton's
``{"text_input": "...", "parameters": {...}}``; options may be given in ``parameters`` or at the
top level (as TensorRT-LLM's ensembles take them): ``max_tokens``, ``temperature`` (default 0:
greedy), ``top_k``, ``top_p``, ``seed`` (or ``random_seed``), ``stop`` (or ``stop_words``: a
string or an array), ``end_id`` (more token ids that end the stream), ``stream`` (accepted,
ignored: the endpoint decides). Instead of ``text_input``, ``input_ids`` (an array of token
ids) gives the prompt as tokens: the answer then has ``output_ids`` too, and a model without a
tokenizer answers with ``output_ids`` alone.

The answer is ``{"model_name", "model_version", "text_output", "finish_reason"}`` (``id`` echoed
when the request had one); each event of a stream is such an object with the new text in
``text_output``, and the last one has the ``finish_reason``. Errors are Triton's
``{"error": "..."}``: with the HTTP status before the stream starts, as an event after.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from .generate_http import GenerationProtocol, GenerationResponse
from .generation import Delta, Generation, GenerationOptions, ParameterError, start_generation
from .protocol import ProtocolError
from .service import Call, InferenceService

_OPTIONS = {"max_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
            "seed": "seed", "random_seed": "seed", "stop": "stop", "stop_words": "stop", "end_id": "stop_ids"}
_ACCEPTED = ("stream",)  # read, and ignored: the endpoint says whether to stream


class TritonGenerateRequest(GenerationProtocol):
    """``POST /v2/models/{name}[/versions/{v}]/generate`` and ``.../generate_stream``."""

    def __init__(self, stream: bool):
        self.stream = stream
        self.request_id: str | None = None
        self.ids_mode = False

    def parse(self, body: dict[str, Any], path_params: dict[str, str]) -> None:
        self.name, self.version = path_params["name"], path_params.get("version")
        parameters = body.get("parameters", {})
        if not isinstance(parameters, dict):
            raise ProtocolError(400, "'parameters' must be an object")
        values: dict[str, tuple[str, Any]] = {}
        for where, source in (("", body), ("parameters.", parameters)):
            for key, value in source.items():
                if where == "" and key in ("text_input", "input_ids", "parameters", "id"):
                    continue
                if key in _ACCEPTED:
                    continue
                option = _OPTIONS.get(key)
                if option is None:
                    known = sorted({*_OPTIONS, *_ACCEPTED} | ({"text_input", "input_ids", "parameters", "id"}
                                                              if not where else set()))
                    raise ParameterError(key, f"unknown field {where + key!r} of a generate request (known: "
                                              f"{', '.join(known)})")
                if option in values:
                    raise ParameterError(key, f"{where + key!r} repeats {values[option][0]!r}")
                values[option] = (where + key, value)
        request_id = body.get("id")
        if request_id is not None and not isinstance(request_id, str):
            raise ProtocolError(400, "'id' must be a string")
        self.request_id = request_id
        self.options = GenerationOptions.checked(**{option: value for option, (_, value) in values.items()},
                                                 names={option: name for option, (name, _) in values.items()})
        text, ids = body.get("text_input"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise ProtocolError(400, "a generate request needs 'text_input' (a string) or 'input_ids' (token ids), "
                                     "one of them")
        if text is not None:
            if not isinstance(text, str) or not text:
                raise ParameterError("text_input", "'text_input' must be a non-empty string")
            self.prompt: str | list[int] = text
        else:
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in ids):
                raise ParameterError("input_ids", "'input_ids' must be a non-empty array of token ids")
            self.prompt, self.ids_mode = ids, True

    async def begin(self, call: Call, service: InferenceService) -> Generation:
        self.version = call.version
        return await start_generation(call, self.prompt, self.options, metrics=service.metrics)

    def _answer(self, generation: Generation, text: str, tokens: list[int] | None) -> dict[str, Any]:
        answer: dict[str, Any] = {"model_name": self.name, "model_version": self.version}
        if self.request_id is not None:
            answer["id"] = self.request_id
        if generation.has_text:
            answer["text_output"] = text
        if tokens is not None and (self.ids_mode or not generation.has_text):
            answer["output_ids"] = tokens
        return answer

    def delta_event(self, generation: Generation, delta: Delta) -> Any | None:
        if not delta.text and not (self.ids_mode or not generation.has_text):
            return None
        return self._answer(generation, delta.text or "", [] if delta.token is None else [delta.token])

    def tail_events(self, generation: Generation) -> list[Any]:
        return [{**self._answer(generation, "", []), "finish_reason": generation.finish_reason}]

    def response(self, generation: Generation, text: str, tokens: list[int]) -> dict[str, Any]:
        return {**self._answer(generation, text, tokens), "finish_reason": generation.finish_reason}


async def _generate(request: Request) -> GenerationResponse:
    return GenerationResponse(request, TritonGenerateRequest(stream=False))


async def _generate_stream(request: Request) -> GenerationResponse:
    return GenerationResponse(request, TritonGenerateRequest(stream=True))


def generate_routes() -> Sequence[Route]:
    """The generate extension's routes (mounted by `.server`)."""
    routes = []
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [Route(prefix + "/generate", _generate, methods=["POST"]),
                   Route(prefix + "/generate_stream", _generate_stream, methods=["POST"])]
    return routes
