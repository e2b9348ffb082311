"""Serving generation: OpenAI's completions and chat completions with the official ``openai``
client, unchanged, streamed and not; Triton's generate and generate_stream over httpx; a client
that disconnects cancels its stream; errors in each protocol's shape; metrics; the config's
``generation`` parameter. Against a real server (uvicorn on a free port: the ``openai`` client
brings its own HTTP stack) serving tiny random-weight decoders built by the tests."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import onnx
import pytest

import asyncinfer as ai
from asyncinfer import assets
from asyncinfer.runtime.generation import TextTokenizer
from asyncinfer.serving import create_app
from asyncinfer.serving.service import InferenceService
from conftest import GATES

openai = pytest.importorskip("openai", reason="the openai client is a dev dependency")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn comes with the serve extra")
pytest.importorskip("tokenizers", reason="the text extra's tokenizers package")

from runtime.test_generation import decoder, eventually  # noqa: E402 - after the skips
from text_testing import CHAT_TEMPLATE, Turnstile, decoder_folder  # noqa: E402

from .uvicorn_thread import ServerThread  # noqa: E402

PROMPT = "Emoji: 🤗 héllo"
TOKENS = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("generate")
    turnstile = GATES["generate-serving"] = Turnstile()
    ids_only = root / "ids" / "model.onnx"
    ids_only.parent.mkdir()
    onnx.save(decoder(seed=3), str(ids_only))  # a decoder without a tokenizer.json: token ids only
    failing = root / "failing" / "model.onnx"
    failing.parent.mkdir()
    onnx.save(decoder(declare_vocab=False), str(failing))  # an id beyond its table fails in a Gather
    yield {"tiny": decoder_folder(root / "tiny", decoder(seed=3)), "ids": ids_only, "failing": failing,
           "gated": decoder_folder(root / "gated", decoder(seed=3, gate="generate-serving")),
           "digits": assets.default_model_path()}
    turnstile.set()


@pytest.fixture(scope="module")
def served(models) -> Iterator[tuple[InferenceService, str]]:
    service = InferenceService(models)
    with ServerThread(create_app(service=service)) as server:
        try:
            yield service, server.url
        finally:
            GATES["generate-serving"].set()  # before the server stops: a gated run must not hold its shutdown


@pytest.fixture(scope="module")
def reference(models):
    """What the engine itself generates (greedy) for `PROMPT` and for the chat prompt."""
    tokenizer = TextTokenizer.load(models["tiny"].parent)
    with ai.Worker(ai.load_model(models["tiny"]), "cpu") as worker:
        ids = worker.generate_blocking(tokenizer.encode(PROMPT), max_new_tokens=TOKENS)
        chat_prompt = tokenizer.encode("<|user|>hi there<|assistant|>", add_special_tokens=False)
        chat_ids = worker.generate_blocking(chat_prompt, max_new_tokens=TOKENS)
    return {"tokenizer": tokenizer, "ids": ids, "text": tokenizer.decode(ids), "chat": tokenizer.decode(chat_ids)}


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def sse_events(response: httpx.Response) -> list:
    """The ``data:`` payloads of a server-sent event stream, JSON-decoded (``[DONE]`` kept as is)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# -- OpenAI's API with the openai client -------------------------------------------------------------
def test_openai_client_completions_streamed_and_not(served, reference):
    service, url = served
    api = client(url)
    assert sorted(m.id for m in api.models.list()) == ["failing", "gated", "ids", "tiny"]  # the decoders, not digits
    answer = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    assert answer.choices[0].text == reference["text"]
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == TOKENS
    assert answer.usage.prompt_tokens == len(reference["tokenizer"].encode(PROMPT))
    chunks = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == reference["text"]
    assert len([p for p in pieces if p]) > 2  # it came in pieces, not at once
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    # a stop string: the text ends before it
    text = reference["text"]
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stopped = api.completions.create(model="tiny", prompt=PROMPT, max_tokens=TOKENS, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[:text.index(stop)] and stopped.choices[0].finish_reason == "stop"


def test_openai_client_chat_streamed_and_not(served, reference):
    _, url = served
    api = client(url)
    messages = [{"role": "user", "content": "hi there"}]
    answer = api.chat.completions.create(model="tiny", messages=messages, max_tokens=TOKENS, temperature=0)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == reference["chat"]  # the chat template rendered the prompt
    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=TOKENS,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference["chat"]
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == TOKENS


# -- Triton's generate extension -----------------------------------------------------------------------
def test_triton_generate_and_generate_stream(served, reference):
    _, url = served
    answer = httpx.post(url + "/v2/models/tiny/generate", json={"text_input": PROMPT, "parameters": {
        "max_tokens": TOKENS}}, timeout=60)
    assert answer.status_code == 200
    assert answer.json() == {"model_name": "tiny", "model_version": "1", "text_output": reference["text"],
                             "finish_reason": "length"}
    with httpx.stream("POST", url + "/v2/models/tiny/versions/1/generate_stream",
                      json={"text_input": PROMPT, "max_tokens": TOKENS, "id": "r1"}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert "".join(e["text_output"] for e in events) == reference["text"]
    assert events[-1]["finish_reason"] == "length" and all(e["id"] == "r1" for e in events)
    # token ids in, token ids out; a model without a tokenizer answers them alone
    ids = reference["tokenizer"].encode(PROMPT)
    for model in ("tiny", "ids"):
        answer = httpx.post(f"{url}/v2/models/{model}/generate", json={"input_ids": ids, "max_tokens": TOKENS},
                            timeout=60).json()
        assert answer["output_ids"] == reference["ids"]
        assert answer.get("text_output", reference["text"]) == reference["text"] and \
            ("text_output" in answer) == (model == "tiny")


# -- a client that goes away ----------------------------------------------------------------------------
@pytest.mark.anyio
async def test_a_client_disconnect_cancels_the_stream_and_frees_its_cache(served):
    service, url = served
    turnstile: Turnstile = GATES["generate-serving"]
    worker = service.models["gated"].worker
    stats = service.stats_store.of("gated", "1")
    turnstile.allow(2)  # the prompt's run and one step; the next step waits at the gate
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", url + "/v2/models/gated/generate_stream",
                               json={"input_ids": [5, 17, 3], "max_tokens": 10_000}) as response:
            assert response.status_code == 200
            received = 0
            async for line in response.aiter_lines():
                received += line.startswith("data: ")
                if received == 2:
                    break  # leaving the block closes the connection
    await eventually(lambda: stats.failures["CANCELED"] == 1)  # the server saw it go: the request is over
    assert worker.generation_stats().active == 0
    turnstile.set()  # the step in flight ends (its layers after the gate skipped)
    await eventually(lambda: worker.generation_stats().cache_bytes == 0)
    assert worker.generation_stats().tokens == 2  # no token after the disconnect
    metrics = httpx.get(url + "/metrics").text
    assert 'asyncinfer_generation_streams_total{finish_reason="cancelled",model="gated",version="1"} 1.0' in metrics
    answer = httpx.post(url + "/v2/models/gated/generate", json={"input_ids": [5, 17, 3], "max_tokens": 3}).json()
    assert len(answer["output_ids"]) == 3  # the worker goes on serving


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_a_stream_past_its_deadline_ends_with_an_error_event(tmp_path):
    """Past ``request_timeout`` a stream already answering 200 ends with OpenAI's error object as
    an event (then ``[DONE]``), and its generation is cancelled."""
    turnstile = GATES["generate-deadline"] = Turnstile()
    path = decoder_folder(tmp_path / "slow", decoder(seed=3, gate="generate-deadline"))
    service = InferenceService({"slow": path}, request_timeout=0.5)
    turnstile.allow(1)  # the prompt's run; the first step then waits at the gate past the deadline
    with ServerThread(create_app(service=service)) as server:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                    "model": "slow", "prompt": [5, 17, 3], "max_tokens": 50, "stream": True}) as response:
                assert response.status_code == 200
                events = sse_events(response)
            assert events[-1] == "[DONE]"
            error = events[-2]["error"]
            assert "within the request timeout (0.5 s)" in error["message"] and error["type"] == "timeout"
            assert service.stats_store.of("slow", "1").failures["CANCELED"] == 1
            assert service.models["slow"].worker.generation_stats().active == 0
        finally:
            turnstile.set()  # before the server stops: its worker's gate layer must not hold the shutdown


# -- errors ---------------------------------------------------------------------------------------------
OPENAI_ERRORS = [
    ("/v1/completions", b"{not json", 400, None, "malformed JSON"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model", "unknown model 'nope'"),
    ("/v1/completions", {"model": "digits", "prompt": "x"}, 400, None, "no input named 'input_ids'"),
    ("/v1/completions", {"model": "tiny", "prompt": "fox " * 100}, 400, None, "more than the model's context of 64"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature", "'temperature' must"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p", "'top_p' must be"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "'max_tokens' must"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "n": 2}, 400, "n", "'n' is not supported"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "bogus": 1}, 400, "bogus", "Unrecognized request argument"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("/v1/completions", {"model": "ids", "prompt": [1, 2]}, 400, None, "needs the model's tokenizer"),
    ("/v1/chat/completions", {"model": "tiny"}, 400, "messages", "'messages' must be a non-empty array"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages",
     "role must be one of"),
    # asking for a stream changes nothing: refused before it starts, the answer is a status, not an event
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}], "stream": True}, 404,
     "model", "unknown model"),
    ("/v1/completions", {"model": "digits", "prompt": "x", "stream": True}, 400, None, "no input named 'input_ids'"),
    ("/v1/completions", {"model": "tiny", "prompt": "fox " * 100, "stream": True}, 400, None,
     "more than the model's context"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), OPENAI_ERRORS)
def test_openai_errors_are_openai_error_objects(served, path, body, status, param, message):
    _, url = served
    response = httpx.post(url + path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"


def test_the_openai_client_raises_its_own_errors(served):
    _, url = served
    api = client(url)
    with pytest.raises(openai.NotFoundError, match="unknown model 'nope'"):
        api.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        api.completions.create(model="tiny", prompt="fox " * 100, stream=True)


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("/v2/models/tiny/generate", b"[1, 2", 400, "malformed JSON"),
    ("/v2/models/nope/generate", {"text_input": "x"}, 404, "unknown model 'nope'"),
    ("/v2/models/tiny/versions/7/generate_stream", {"text_input": "x"}, 404, "has no version '7'"),
    ("/v2/models/digits/generate_stream", {"text_input": "x"}, 400, "no input named 'input_ids'"),
    ("/v2/models/tiny/generate", {"text_input": "fox " * 100}, 400, "more than the model's context of 64"),
    ("/v2/models/tiny/generate", {"text_input": "x", "parameters": {"top_k": 0}}, 400, "'parameters.top_k' must"),
    ("/v2/models/tiny/generate", {"text_input": "x", "parameters": {"temperature": "hot"}}, 400,
     "'parameters.temperature' must be a number"),
    ("/v2/models/tiny/generate", {"text_input": "x", "beams": 4}, 400, "unknown field 'beams'"),
    ("/v2/models/tiny/generate", {"parameters": {}}, 400, "needs 'text_input'"),
    ("/v2/models/tiny/generate", {"input_ids": [1, 500]}, 400, "beyond the model's vocabulary of 97"),
    ("/v2/models/ids/generate_stream", {"text_input": "x"}, 400, "no tokenizer.json"),
    ("/v2/models/ids/generate", {"input_ids": [1], "stop": "x"}, 400, "stop strings need the model's tokenizer"),
])
def test_triton_generate_errors_are_triton_errors(served, path, body, status, message):
    _, url = served
    response = httpx.post(url + path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert response.status_code == status
    assert message in response.json()["error"]


def test_a_model_that_fails_mid_stream_ends_it_with_an_error_event(served):
    service, url = served
    with httpx.stream("POST", url + "/v2/models/failing/generate_stream", json={"input_ids": [1, 500]}) as response:
        assert response.status_code == 200  # the stream had started: the error comes as its last event
        events = sse_events(response)
    assert "ExecutionError" in events[-1]["error"] and "Gather" in events[-1]["error"]
    answer = httpx.post(url + "/v2/models/failing/generate", json={"input_ids": [1, 500]})
    assert answer.status_code == 500 and "Gather" in answer.json()["error"]
    assert service.stats_store.of("failing", "1").failures["BACKEND"] == 2
    ok = httpx.post(url + "/v2/models/failing/generate", json={"input_ids": [1, 2], "max_tokens": 2})
    assert len(ok.json()["output_ids"]) == 2  # the worker stays usable


# -- metrics and statistics -------------------------------------------------------------------------------
def _sample(metrics: str, name: str) -> float:
    line = next((line for line in metrics.splitlines() if line.startswith(name + " ")), None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])


def test_metrics_time_tokens_and_statistics_count_requests(served):
    service, url = served
    labels = '{model="tiny",version="1"}'
    before = httpx.get(url + "/metrics").text
    successes = service.stats_store.of("tiny", "1").success.count
    httpx.post(url + "/v2/models/tiny/generate", json={"input_ids": [5, 6, 7], "max_tokens": 5}).raise_for_status()
    after = httpx.get(url + "/metrics").text
    for name, grew in [("asyncinfer_generated_tokens_total", 5), ("asyncinfer_time_to_first_token_seconds_count", 1),
                       ("asyncinfer_inter_token_latency_seconds_count", 4)]:
        assert _sample(after, name + labels) - _sample(before, name + labels) == grew, name
    assert service.stats_store.of("tiny", "1").success.count == successes + 1


# -- the config says which models generate ---------------------------------------------------------------
def test_the_generation_parameter_of_a_config(tmp_path):
    decoder_folder(tmp_path / "hidden" / "1", decoder(seed=3), chat_template=CHAT_TEMPLATE)
    (tmp_path / "hidden" / "config.pbtxt").write_text(
        'parameters { key: "generation" value { string_value: "false" } }\n')
    (tmp_path / "marked" / "1").mkdir(parents=True)
    (tmp_path / "marked" / "1" / "model.onnx").write_bytes(assets.default_model_path().read_bytes())
    (tmp_path / "marked" / "config.pbtxt").write_text(
        'max_batch_size: 8\nparameters { key: "generation" value { string_value: "true" } }\n')
    (tmp_path / "plain" / "1").mkdir(parents=True)  # a decoder whose tokenizer is in its model directory
    onnx.save(decoder(seed=3), str(tmp_path / "plain" / "1" / "model.onnx"))
    (tmp_path / "plain" / "tokenizer.json").write_bytes((tmp_path / "hidden" / "1" / "tokenizer.json").read_bytes())
    service = InferenceService.from_repository(tmp_path)
    with ServerThread(create_app(service=service)) as server:
        listed = httpx.get(server.url + "/v1/models").json()
        assert [m["id"] for m in listed["data"]] == ["marked", "plain"]
        hidden = httpx.post(server.url + "/v1/completions", json={"model": "hidden", "prompt": "x"})
        assert hidden.status_code == 400 and "generation: false" in hidden.json()["error"]["message"]
        marked = httpx.post(server.url + "/v2/models/marked/generate", json={"text_input": "x"})
        assert marked.status_code == 400 and "no input named 'input_ids'" in marked.json()["error"]
        plain = httpx.post(server.url + "/v1/completions", json={"model": "plain", "prompt": "fox", "max_tokens": 3})
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 3
