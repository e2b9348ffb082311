"""Inference statistics and Prometheus metrics count what happened, exactly, under concurrency.

Requests that succeed, fail in the engine, are malformed, or are refused for a full queue run at
once; the statistics JSON and the ``/metrics`` text (parsed with prometheus-client's own parser)
must agree with each other and with the numbers the test knows. Nothing waits on the clock:
the one slow request is held by a ``Gate`` layer.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import asyncinfer as ai
from asyncinfer.serving import create_app
from asyncinfer.serving.service import InferenceService

HANG = 20  # seconds: a bound against hangs, never a timing assertion
TRITON_COUNTERS = ["nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                   "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                   "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                   "nv_inference_compute_output_duration_us"]


@asynccontextmanager
async def serving(service: InferenceService) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service=service)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
            yield client


def request_body(rows: int, value: float) -> dict:
    return {"inputs": [{"name": "x", "shape": [rows, 3], "datatype": "FP32", "data": [value] * (3 * rows)}]}


def scrape(text: str) -> dict[str, dict[tuple, float]]:
    """``{family: {sorted label items: value}}`` of a Prometheus text exposition."""
    families: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            families.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return families


@pytest.mark.anyio
@pytest.mark.parametrize("batching", [True, False], ids=["batched", "alone"])
async def test_statistics_and_metrics_count_concurrent_requests_exactly(picky_model, batching):
    good, bad, malformed, rows = 9, 4, 3, 2
    service = InferenceService({"picky": picky_model}, batching=batching, max_batch_size=8, max_delay=0.001)
    async with serving(service) as client:
        statuses: list[int] = []

        async def post(body: dict) -> None:
            statuses.append((await client.post("/v2/models/picky/infer", json=body)).status_code)

        async with anyio.create_task_group() as tg:
            for _ in range(good):
                tg.start_soon(post, request_body(rows, 1.5))
            for _ in range(bad):
                tg.start_soon(post, request_body(rows, -1.0))  # the engine fails: 500
            for _ in range(malformed):
                tg.start_soon(post, {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1]}]})
        assert sorted(statuses) == [200] * good + [400] * malformed + [500] * bad
        (await client.get("/v2/models/picky/versions/9/stats"))  # a 404 counts nowhere

        stats = (await client.get("/v2/models/picky/stats")).json()["model_stats"]
        assert [(s["name"], s["version"]) for s in stats] == [("picky", "1")]
        s = stats[0]
        inference = s["inference_stats"]
        assert inference["success"]["count"] == good and inference["fail"]["count"] == bad + malformed
        for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
            assert inference[phase]["count"] == good, phase
        assert inference["compute_infer"]["ns"] > 0 and inference["compute_input"]["ns"] > 0
        # the phases of a request are disjoint parts of its duration
        assert inference["success"]["ns"] >= sum(inference[p]["ns"] for p in
                                                 ("queue", "compute_input", "compute_infer", "compute_output"))
        # inferences are rows when the model is served with a batch dimension (max_batch_size > 0)
        per_request = rows if batching else 1
        assert s["inference_count"] == good * per_request
        executions = s["execution_count"]
        batcher = service.models["picky"].batcher
        assert executions == (batcher.stats.engine_runs if batcher else good + bad)
        assert sum(b["compute_infer"]["count"] for b in s["batch_stats"]) == executions
        assert s["last_inference"] > 0

        metrics = await client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        for name in TRITON_COUNTERS:  # Triton's exact names, declared as counters
            assert f"# TYPE {name} counter\n" in metrics.text, name
        families = scrape(metrics.text)
        labels = (("model", "picky"), ("version", "1"))
        assert families["nv_inference_request_success_total"][labels] == good
        failures = {dict(k)["reason"]: v for k, v in families["nv_inference_request_failure_total"].items()}
        assert failures == {"BACKEND": bad, "OTHER": malformed, "REJECTED": 0, "CANCELED": 0}
        assert families["nv_inference_count_total"][labels] == good * per_request
        assert families["nv_inference_exec_count_total"][labels] == executions
        assert families["nv_inference_compute_infer_duration_us_total"][labels] == \
            inference["compute_infer"]["ns"] // 1000
        assert families["nv_inference_request_duration_us_total"][labels] == inference["success"]["ns"] // 1000
        assert families["asyncinfer_batch_size_count"][labels] == executions
        if batcher is not None:  # rows per run: merged runs hold several requests
            assert families["asyncinfer_batch_size_sum"][labels] == sum(
                b["batch_size"] * b["compute_infer"]["count"] for b in s["batch_stats"])
        assert families["asyncinfer_models_loaded"][()] == 1
        assert families["nv_inference_pending_request_count"][labels] == 0


@pytest.mark.anyio
async def test_a_refused_request_counts_as_rejected_and_pending_requests_show(gated_model):
    model, gate = gated_model
    service = InferenceService({"slow": model}, max_queue=1)
    async with serving(service) as client:
        answers: list[int] = []
        body = {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [1.0] * 6}]}

        async def post() -> None:
            answers.append((await client.post("/v2/models/slow/infer", json=body)).status_code)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(post)
                with anyio.fail_after(HANG):
                    while service.admission.active("slow") != 1:
                        await anyio.sleep(0.002)
                families = scrape((await client.get("/metrics")).text)
                assert families["nv_inference_pending_request_count"][(("model", "slow"), ("version", "1"))] == 1
                refused = await client.post("/v2/models/slow/infer", json=body)
                assert refused.status_code == 503
                gate.set()
        finally:
            gate.set()
        assert answers == [200]
        families = scrape((await client.get("/metrics")).text)
        failures = {dict(k)["reason"]: v for k, v in families["nv_inference_request_failure_total"].items()}
        assert failures["REJECTED"] == 1 and families["nv_inference_request_success_total"][
            (("model", "slow"), ("version", "1"))] == 1


@pytest.mark.anyio
async def test_each_service_has_its_own_registry_and_samples_the_loop_lag(picky_model):
    first, second = InferenceService({"picky": picky_model}), InferenceService({"picky": picky_model})
    async with first, second:
        async with first.request("picky") as call:
            await call.infer({"x": np.ones((1, 3), np.float32)})
        assert first.metrics.registry is not second.metrics.registry
        assert scrape(first.metrics.render().decode())["nv_inference_request_success_total"][
            (("model", "picky"), ("version", "1"))] == 1
        assert scrape(second.metrics.render().decode())["nv_inference_request_success_total"][
            (("model", "picky"), ("version", "1"))] == 0
        async with anyio.create_task_group() as tg:  # a fast sampler, so the test needs no long wait
            tg.start_soon(first.metrics.sample_event_loop_lag, 0.001)
            with anyio.fail_after(HANG):
                while scrape(first.metrics.render().decode())["asyncinfer_event_loop_lag_seconds_count"][()] < 3:
                    await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
        lag = scrape(first.metrics.render().decode())
        assert lag["asyncinfer_event_loop_lag_seconds_sum"][()] >= 0


@pytest.mark.anyio
async def test_call_phases_and_intermediate_values(picky_model):
    async with InferenceService({"picky": picky_model}) as service:
        x = np.ones((2, 3), np.float32)
        async with service.request("picky") as call:
            assert call.name == "picky" and call.version == "1" and call.deadline > anyio.current_time()
            with call.phase("input"):
                inputs = {"x": x}
            outputs = await call.infer(inputs, ["checked", "y"])  # an intermediate value, and an output
            with pytest.raises(ValueError, match="phase is 'input' or 'output'"):
                with call.phase("infer"):
                    pass
        np.testing.assert_array_equal(outputs["checked"], x)
        np.testing.assert_array_equal(outputs["y"], 2 * x)
        from asyncinfer.serving.protocol import ProtocolError

        with pytest.raises(ProtocolError) as refused:
            async with service.request("picky") as call:
                await call.infer({"x": x}, ["nothing_of_that_name"])
        assert refused.value.status == 400 and "nothing_of_that_name" in refused.value.message
        stats = service.statistics("picky")["model_stats"][0]["inference_stats"]
        assert stats["success"]["count"] == 1 and stats["fail"]["count"] == 1


@pytest.mark.anyio
async def test_the_batcher_reports_each_engine_run_and_its_requests_timing(picky_model):
    from asyncinfer.serving import DynamicBatcher
    from asyncinfer.serving.batching import RunTiming

    records = []
    timings = [RunTiming() for _ in range(4)]
    # max_delay is long: the batch goes when full, so the grouping does not depend on timing
    async with DynamicBatcher(picky_model, max_batch_size=4, max_delay=30, on_run=records.append) as batcher:
        async with anyio.create_task_group() as tg:
            for timing in timings:
                tg.start_soon(lambda t=timing: batcher.infer({"x": np.ones((1, 3), np.float32)}, timing=t))
        with pytest.raises(ai.ExecutionError):  # a failing run alone is reported too, as failed
            await batcher.infer({"x": -np.ones((5, 3), np.float32)})  # more rows than a batch: runs alone
    assert [(r.rows, r.requests, r.ok) for r in records] == [(4, 4, True), (5, 1, False)]
    assert records[0].infer_ns > 0 and records[0].input_ns > 0 and records[0].output_ns > 0
    assert len({(t.started, t.ended) for t in timings}) == 1  # one run answered all four
    assert 0 < timings[0].started < timings[0].ended
