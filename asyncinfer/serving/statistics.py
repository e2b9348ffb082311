"""Inference statistics per model version, counted as Triton counts them and reported in its JSON form.

One `ModelStatistics` per served (model, version) records every request (success or
failure, and for a success the time spent queued, decoding its inputs, running, encoding its
outputs) and every engine run (a merged batch is one execution). ``GET /v2/models/stats`` and
the gRPC ``ModelStatistics`` call report `ModelStatistics.to_json`; the Prometheus
``nv_inference_*`` counters are read from the same numbers, so the two always agree.

Times are nanoseconds from ``time.perf_counter_ns``; ``last_inference`` is milliseconds since
the epoch, as Triton gives it. Everything runs on the event loop: no locks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# Why a request failed, as Triton's ``nv_inference_request_failure`` ``reason`` label says it.
REJECTED = "REJECTED"  # refused at admission: queue full, model not ready, server draining
CANCELED = "CANCELED"  # deadline passed, client gone, or cancelled by the drain at shutdown
BACKEND = "BACKEND"  # the engine failed on the request
OTHER = "OTHER"  # a bad request (malformed, wrong inputs) or anything else
FAILURE_REASONS = (REJECTED, CANCELED, BACKEND, OTHER)


@dataclass
class Duration:
    """A count and the total nanoseconds of one kind of event (Triton's ``StatisticDuration``)."""

    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += max(int(ns), 0)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchDurations:
    """Engine runs of one batch size: merging inputs, running, splitting outputs."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class RequestTimes:
    """The phases of one successful request, in nanoseconds."""

    total: int
    queue: int = 0
    compute_input: int = 0
    compute_infer: int = 0
    compute_output: int = 0


class ModelStatistics:
    """Counters of one model version since the server started (they survive a reload)."""

    def __init__(self, name: str, version: str):
        self.name, self.version = name, version
        self.last_inference = 0  # ms since the epoch of the latest request's end
        self.inference_count = 0  # rows (batch size) inferred by successful requests
        self.execution_count = 0  # engine runs
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_input = Duration()
        self.compute_infer = Duration()
        self.compute_output = Duration()
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)
        self.batches: dict[int, BatchDurations] = {}

    def record_success(self, rows: int, times: RequestTimes) -> None:
        """A request answered: ``rows`` inferences (1 for a model without a batch dimension)."""
        self.last_inference = int(time.time() * 1000)
        self.inference_count += rows
        self.success.add(times.total)
        self.queue.add(times.queue)
        self.compute_input.add(times.compute_input)
        self.compute_infer.add(times.compute_infer)
        self.compute_output.add(times.compute_output)

    def record_failure(self, total_ns: int, reason: str) -> None:
        """A request that ended in an error; ``reason`` is one of `FAILURE_REASONS`."""
        self.last_inference = int(time.time() * 1000)
        self.fail.add(total_ns)
        self.failures[reason if reason in self.failures else OTHER] += 1

    def record_execution(self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One engine run over ``batch_size`` rows (a merged batch is one run)."""
        self.execution_count += 1
        durations = self.batches.get(batch_size)
        if durations is None:
            durations = self.batches[batch_size] = BatchDurations()
        durations.compute_input.add(input_ns)
        durations.compute_infer.add(infer_ns)
        durations.compute_output.add(output_ns)

    def to_json(self) -> dict[str, Any]:
        """Triton's ``model_stats`` entry for this version."""
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.to_json(),
                "fail": self.fail.to_json(),
                "queue": self.queue.to_json(),
                "compute_input": self.compute_input.to_json(),
                "compute_infer": self.compute_infer.to_json(),
                "compute_output": self.compute_output.to_json(),
                "cache_hit": Duration().to_json(),  # no response cache
                "cache_miss": Duration().to_json(),
            },
            "response_stats": {},
            "batch_stats": [
                {"batch_size": size, "compute_input": d.compute_input.to_json(),
                 "compute_infer": d.compute_infer.to_json(), "compute_output": d.compute_output.to_json()}
                for size, d in sorted(self.batches.items())
            ],
            "memory_usage": [],
        }


class Statistics:
    """Every model version's `ModelStatistics`, kept for the life of the server."""

    def __init__(self) -> None:
        self._by_version: dict[tuple[str, str], ModelStatistics] = {}

    def of(self, name: str, version: str) -> ModelStatistics:
        """The statistics of ``name`` version ``version``, made on first use."""
        key = (name, version)
        stats = self._by_version.get(key)
        if stats is None:
            stats = self._by_version[key] = ModelStatistics(name, version)
        return stats

    def all(self) -> list[ModelStatistics]:
        """Every version recorded so far, by name then version number."""
        return [self._by_version[k] for k in sorted(self._by_version, key=_order)]


def _order(key: tuple[str, str]) -> tuple[str, int, str]:
    name, version = key
    return (name, int(version) if version.isdigit() else -1, version)
