"""Inference statistics per model version, counted as Triton counts them and reported in its JSON form.

One `ModelStatistics` per served (model, version) records every request (success or
failure, and for a success the time spent queued, decoding its inputs, running, encoding its
outputs) and every engine run (a merged batch is one execution). ``GET /v2/models/stats`` and
the gRPC ``ModelStatistics`` call report `ModelStatistics.to_json`; the Prometheus
``nv_inference_*`` counters are read from the same numbers, so the two always agree.

Times are nanoseconds from ``time.perf_counter_ns``; ``last_inference`` is milliseconds since
the epoch, as Triton gives it. Everything runs on the event loop: no locks.

With several worker processes (``asyncinfer serve --workers N``, `.multiprocess`) each keeps
its own counters; `ModelStatistics.snapshot` writes them as plain JSON values,
`ModelStatistics.from_snapshot` reads them back, and `ModelStatistics.add` sums another
process's into a total: counts and times add up, ``last_inference`` is the latest.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Iterable
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
        if ns > 0:
            self.ns += int(ns)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}

    def to_list(self) -> list[int]:
        return [self.count, self.ns]

    @classmethod
    def from_list(cls, value: Any) -> Duration:
        count, ns = value
        return cls(_count(count), _count(ns))


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

    # -- several processes --------------------------------------------------------------------------
    _DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")

    def snapshot(self) -> dict[str, Any]:
        """Every counter as plain JSON values (what a worker process shares with the others)."""
        return {"name": self.name, "version": self.version, "last_inference": self.last_inference,
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                **{key: getattr(self, key).to_list() for key in self._DURATIONS},
                "failures": dict(self.failures),
                "batches": {str(size): [d.compute_input.to_list(), d.compute_infer.to_list(),
                                        d.compute_output.to_list()] for size, d in self.batches.items()}}

    @classmethod
    def from_snapshot(cls, data: Any) -> ModelStatistics:
        """The counters of a `snapshot`; ValueError when ``data`` is not one."""
        try:
            stats = cls(str(data["name"]), str(data["version"]))
            stats.last_inference = _count(data["last_inference"])
            stats.inference_count = _count(data["inference_count"])
            stats.execution_count = _count(data["execution_count"])
            for key in cls._DURATIONS:
                setattr(stats, key, Duration.from_list(data[key]))
            for reason, count in data["failures"].items():
                stats.failures[reason if reason in stats.failures else OTHER] += _count(count)
            for size, (inputs, infer, outputs) in data["batches"].items():
                stats.batches[_count(size)] = BatchDurations(Duration.from_list(inputs), Duration.from_list(infer),
                                                             Duration.from_list(outputs))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a statistics snapshot: {type(exc).__name__}: {exc}") from None
        return stats

    def add(self, other: ModelStatistics) -> None:
        """Sum ``other``'s counters (another process's, of the same version) into these."""
        self.last_inference = max(self.last_inference, other.last_inference)
        self.inference_count += other.inference_count
        self.execution_count += other.execution_count
        for key in self._DURATIONS:
            mine, theirs = getattr(self, key), getattr(other, key)
            mine.count += theirs.count
            mine.ns += theirs.ns
        for reason, count in other.failures.items():
            self.failures[reason] += count
        for size, theirs_batch in other.batches.items():
            mine_batch = self.batches.setdefault(size, BatchDurations())
            for key in ("compute_input", "compute_infer", "compute_output"):
                getattr(mine_batch, key).add(getattr(theirs_batch, key).ns, getattr(theirs_batch, key).count)

    def copy(self) -> ModelStatistics:
        return ModelStatistics.from_snapshot(self.snapshot())

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


@dataclass
class ProcessSnapshot:
    """One worker process's counters and gauges, as the others see them (`.multiprocess`)."""

    pid: int
    live: bool  # asked now (False: read from the file it last wrote; its gauges are stale)
    statistics: list[ModelStatistics]
    pending: dict[tuple[str, str], int]  # requests in progress, by (model, version)
    models_loaded: int

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "statistics": [s.snapshot() for s in self.statistics],
                "pending": [[name, version, count] for (name, version), count in self.pending.items()],
                "models_loaded": self.models_loaded}

    @classmethod
    def from_json(cls, data: Any, live: bool) -> ProcessSnapshot:
        """ValueError when ``data`` is not a `to_json` document."""
        try:
            return cls(_count(data["pid"]), live, [ModelStatistics.from_snapshot(s) for s in data["statistics"]],
                       {(str(n), str(v)): _count(c) for n, v, c in data["pending"]}, _count(data["models_loaded"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a process snapshot: {type(exc).__name__}: {exc}") from None


def summed(groups: Iterable[Iterable[ModelStatistics]]) -> dict[tuple[str, str], ModelStatistics]:
    """``{(name, version): total}`` over the statistics of several processes."""
    totals: dict[tuple[str, str], ModelStatistics] = {}
    for group in groups:
        for stats in group:
            key = (stats.name, stats.version)
            if key in totals:
                totals[key].add(stats)
            else:
                totals[key] = stats.copy()
    return {key: totals[key] for key in sorted(totals, key=_order)}


def _count(value: Any) -> int:
    """A non-negative integer read from a snapshot."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or int(value) < 0:
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return int(value)


def _order(key: tuple[str, str]) -> tuple[str, int, str]:
    name, version = key
    return (name, int(version) if version.isdigit() else -1, version)
