"""Request tracing with Triton's trace settings (asyncinfer/serving/tracing.py): tritonclient sets
them, the sampled requests (rate, count) are traced layer by layer, the traces read back as a
Chrome/Perfetto trace and land in the trace folder, bad settings are refused, and traced requests
become OpenTelemetry spans when an SDK is configured."""
from __future__ import annotations

import json

import numpy as np
import pytest

from asyncinfer import assets
from asyncinfer.serving import create_app
from asyncinfer.serving.service import InferenceService
from asyncinfer.serving.tracing import Tracer
from .uvicorn_thread import ServerThread

triton = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is a dev dependency")
from tritonclient.utils import InferenceServerException  # noqa: E402


def _digits_input() -> "triton.InferInput":
    x = np.random.default_rng(0).standard_normal((1, 1, 8, 8)).astype(np.float32)
    item = triton.InferInput("image", list(x.shape), "FP32")
    item.set_data_from_numpy(x)
    return item


def _check_chrome_trace(trace: dict, layers: int, requests: int) -> None:
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == layers * requests
    for event in slices:
        assert {"name", "ts", "dur", "pid", "tid"} <= set(event) and event["dur"] >= 0
    assert len({e["pid"] for e in slices}) == requests  # one process per traced request


def test_tritonclient_sets_a_model_trace_and_the_sampled_requests_are_traced(tmp_path):
    service = InferenceService({"digits": assets.default_model_path()}, trace_dir=tmp_path)
    with ServerThread(create_app(service=service)) as server:
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
        assert client.get_trace_settings()["trace_level"] == ["OFF"]
        settings = client.update_trace_settings("digits", {"trace_level": ["TIMESTAMPS"], "trace_rate": "2",
                                                           "trace_count": "2", "trace_file": "digits.json"})
        assert settings["trace_level"] == ["TIMESTAMPS"] and settings["trace_rate"] == "2"
        assert client.get_trace_settings()["trace_level"] == ["OFF"]  # the server's own are unchanged
        for _ in range(7):  # requests 2 and 4 are traced; then trace_count is spent
            client.infer("digits", [_digits_input()])
        layers = len(service.models["digits"].worker._plan.nodes)
        traces = json.loads(client._get("v2/trace", None, None).read())
        _check_chrome_trace(traces, layers, 2)
        _check_chrome_trace(json.loads((tmp_path / "digits.json").read_text()), layers, 2)
        # null puts the model back on the server's settings
        assert client.update_trace_settings("digits", {"trace_level": None})["trace_level"] == ["OFF"]
        client.infer("digits", [_digits_input()])
        assert len([e for e in json.loads(client._get("v2/trace", None, None).read())["traceEvents"]
                    if e["ph"] == "X"]) == layers * 2
        stats = client.get_inference_statistics("digits")["model_stats"][0]["inference_stats"]
        assert stats["success"]["count"] == 8  # traced requests count like any other


@pytest.mark.parametrize("settings, message", [
    ({"trace_level": ["TENSORS"]}, "not supported"),
    ({"trace_rate": "0"}, "from 1"),
    ({"trace_count": "ten"}, "integer"),
    ({"trace_file": "../escape.json"}, "plain file name"),
    ({"trace_mode": "opentelemetry"}, "unknown trace setting"),
])
def test_bad_trace_settings_are_refused_and_change_nothing(tmp_path, settings, message):
    tracer = Tracer(tmp_path)
    from asyncinfer.serving.protocol import ProtocolError

    with pytest.raises(ProtocolError, match=message) as caught:
        tracer.update({"trace_level": ["TIMESTAMPS"], **settings}, "m")
    assert caught.value.status == 400
    assert tracer.settings("m").level == "OFF"


def test_trace_file_needs_a_trace_folder():
    from asyncinfer.serving.protocol import ProtocolError

    with pytest.raises(ProtocolError, match="without a trace folder"):
        Tracer().update({"trace_file": "t.json"})


def test_an_unknown_model_s_trace_settings_are_404(tmp_path):
    service = InferenceService({"digits": assets.default_model_path()})
    with ServerThread(create_app(service=service)) as server:
        client = triton.InferenceServerClient(f"127.0.0.1:{server.port}")
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.get_trace_settings("nope")


def test_traced_requests_become_opentelemetry_spans(tmp_path):
    sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is a dev dependency")
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # the application's choice; once per process
    if trace.get_tracer_provider() is not provider:
        pytest.skip("another test already set this process's OpenTelemetry tracer provider")
    service = InferenceService({"digits": assets.default_model_path()})
    service.tracer.update({"trace_level": "TIMESTAMPS", "trace_rate": "1"})
    with ServerThread(create_app(service=service)) as server:
        triton.InferenceServerClient(f"127.0.0.1:{server.port}").infer("digits", [_digits_input()])
        layers = len(service.models["digits"].worker._plan.nodes)
    spans = exporter.get_finished_spans()
    root = [s for s in spans if s.name == "infer digits"]
    assert len(root) == 1
    children = [s for s in spans if s.parent is not None and s.parent.span_id == root[0].context.span_id]
    assert len(children) == layers
    assert all(root[0].start_time <= c.start_time <= c.end_time <= root[0].end_time for c in children)
