"""Prometheus metrics of one inference service (``GET /metrics``), with Triton's names where they exist.

Each `ServerMetrics` owns its own ``prometheus_client.CollectorRegistry`` (never the
process-global one), so two services in one process do not mix their numbers.

Triton's counters (labels ``model``, ``version``) are read from the service's
`Statistics` when scraped, so ``/metrics`` and ``/v2/models/stats`` agree:

==========================================  ===============================================
``nv_inference_request_success``            requests answered
``nv_inference_request_failure``            requests failed (label ``reason``: REJECTED,
                                            CANCELED, BACKEND, OTHER)
``nv_inference_count``                      inferences (rows of the batch dimension)
``nv_inference_exec_count``                 engine runs (a merged batch is one)
``nv_inference_request_duration_us``        total time of successful requests
``nv_inference_queue_duration_us``          ...waiting for their engine run
``nv_inference_compute_input_duration_us``  ...decoding inputs
``nv_inference_compute_infer_duration_us``  ...running
``nv_inference_compute_output_duration_us`` ...encoding outputs
``nv_inference_pending_request_count``      requests in progress now (a gauge)
==========================================  ===============================================

They are written exactly as Triton writes them (``# TYPE nv_inference_count counter`` and a sample
of the same name): prometheus-client's own writer would append ``_total``, which dashboards built
for Triton do not expect. asyncinfer's own metrics come from the registry as prometheus-client
writes them: ``asyncinfer_batch_size`` (histogram of rows per engine run),
``asyncinfer_event_loop_lag_seconds`` (histogram of how late a periodic timer fires: a blocked
loop shows here) and ``asyncinfer_models_loaded`` (model versions ready). Generation streams (`.generation`) add,
per model and version: ``asyncinfer_time_to_first_token_seconds`` (histogram: from admission to
the first token), ``asyncinfer_inter_token_latency_seconds`` (histogram: between two tokens of a
stream), ``asyncinfer_generated_tokens_total`` (counter: its rate is tokens/s) and
``asyncinfer_generation_streams_total`` (counter, label ``finish_reason``: stop, length,
cancelled, error).

With several worker processes (``asyncinfer serve --workers N``) every process exposes the whole
server's numbers (`ServerMetrics.render_processes`): the histograms and counters live in
prometheus-client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``, a folder the supervisor
makes and removes) and are summed over the processes, those that exited included; Triton's
counters are the processes' summed statistics; ``nv_inference_pending_request_count`` is summed
over the live processes (prometheus-client's ``livesum`` mode) and ``asyncinfer_models_loaded``
is their largest count (``livemax``).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import anyio
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from .statistics import FAILURE_REASONS, ModelStatistics, Statistics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LAG_INTERVAL = 0.25  # seconds between two samples of the event loop's lag
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# name, help, value read from a ModelStatistics (Triton's wording for the help texts' meaning)
_COUNTERS: list[tuple[str, str, Callable[[ModelStatistics], float]]] = [
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
     lambda s: s.success.count),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)",
     lambda s: s.inference_count),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     lambda s: s.execution_count),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds",
     lambda s: s.success.ns // 1000),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds",
     lambda s: s.queue.ns // 1000),
    ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds",
     lambda s: s.compute_input.ns // 1000),
    ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in microseconds",
     lambda s: s.compute_infer.ns // 1000),
    ("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds",
     lambda s: s.compute_output.ns // 1000),
]


class _ServiceCollector:
    """Gauges read from the service when scraped."""

    def __init__(self, models_loaded: Callable[[], int], pending: Callable[[], dict[tuple[str, str], int]]):
        self._models_loaded, self._pending = models_loaded, pending

    def collect(self) -> Iterable[Metric]:
        loaded = GaugeMetricFamily("asyncinfer_models_loaded", "Model versions loaded and ready to infer")
        loaded.add_metric([], self._models_loaded())
        yield loaded
        pending = GaugeMetricFamily("nv_inference_pending_request_count",
                                    "Instantaneous number of pending requests awaiting execution per-model.",
                                    labels=["model", "version"])
        for (name, version), count in sorted(self._pending().items()):
            pending.add_metric([name, version], count)
        yield pending


class ServerMetrics:
    """The metrics of one service: a registry of its own plus Triton's counters.

    Args:
        statistics: the service's per-version statistics (Triton's counters are read from it).
        models_loaded: how many model versions are ready now.
        pending: requests in progress now, by (model, version).
    """

    def __init__(self, statistics: Statistics, models_loaded: Callable[[], int] = lambda: 0,
                 pending: Callable[[], dict[tuple[str, str], int]] = dict):
        self.statistics = statistics
        self.registry = CollectorRegistry()
        self.batch_size = Histogram("asyncinfer_batch_size", "Rows (batch size) of each engine run",
                                    ["model", "version"], buckets=BATCH_SIZE_BUCKETS, registry=self.registry)
        self.event_loop_lag = Histogram("asyncinfer_event_loop_lag_seconds",
                                        "How late a periodic timer on the server's event loop fires",
                                        buckets=LAG_BUCKETS, registry=self.registry)
        labels = ["model", "version"]
        self.first_token = Histogram("asyncinfer_time_to_first_token_seconds",
                                     "Seconds from a generation request's admission to its first token", labels,
                                     buckets=FIRST_TOKEN_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("asyncinfer_inter_token_latency_seconds",
                                     "Seconds between two consecutive tokens of a generation stream", labels,
                                     buckets=INTER_TOKEN_BUCKETS, registry=self.registry)
        self.generated_tokens = Counter("asyncinfer_generated_tokens", "Tokens generated, all streams", labels,
                                        registry=self.registry)
        self.generation_streams = Counter("asyncinfer_generation_streams", "Generation streams ended, by why",
                                          [*labels, "finish_reason"], registry=self.registry)
        self.registry.register(_ServiceCollector(models_loaded, pending))

    def observe_token(self, name: str, version: str, seconds: float, first: bool) -> None:
        """One generated token, ``seconds`` after the request's admission (``first``) or after
        the stream's previous token."""
        (self.first_token if first else self.inter_token).labels(name, version).observe(seconds)
        self.generated_tokens.labels(name, version).inc()

    def observe_stream_end(self, name: str, version: str, finish_reason: str) -> None:
        """A generation stream ended (``stop``, ``length``, ``cancelled`` or ``error``)."""
        self.generation_streams.labels(name, version, finish_reason).inc()

    def observe_execution(self, name: str, version: str, batch_size: int) -> None:
        """One engine run of ``batch_size`` rows."""
        self.batch_size.labels(name, version).observe(batch_size)

    def render(self) -> bytes:
        """The Prometheus text exposition (format 0.0.4) of every metric."""
        return self.triton_text().encode() + generate_latest(self.registry)

    def render_processes(self, statistics: Iterable[ModelStatistics], pending: Mapping[tuple[str, str], int],
                         models_loaded: int, multiprocess_dir: str) -> bytes:
        """The exposition of several worker processes (`.multiprocess`): Triton's counters from
        their summed ``statistics``; the gauges as given (``pending`` summed over the live
        processes, prometheus-client's ``livesum``; ``models_loaded`` their most, ``livemax``);
        every other metric (histograms, counters) summed by prometheus-client's multiprocess
        mode from the files of ``multiprocess_dir``, the dead processes' included."""
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=multiprocess_dir)
        registry.register(_ServiceCollector(lambda: models_loaded, lambda: dict(pending)))
        return self.triton_text(statistics).encode() + generate_latest(registry)

    def triton_text(self, statistics: Iterable[ModelStatistics] | None = None) -> str:
        """Triton's ``nv_inference_*`` counters, written as Triton writes them (of ``statistics``;
        default: this service's)."""
        everything = list(statistics) if statistics is not None else self.statistics.all()
        lines: list[str] = []
        lines += _family("nv_inference_request_success", _COUNTERS[0][1],
                         [({"model": s.name, "version": s.version}, s.success.count) for s in everything])
        lines += _family("nv_inference_request_failure", "Number of failed inference requests, all batch sizes",
                         [({"model": s.name, "reason": reason, "version": s.version}, s.failures[reason])
                          for s in everything for reason in FAILURE_REASONS])
        for name, help_text, read in _COUNTERS[1:]:
            lines += _family(name, help_text, [({"model": s.name, "version": s.version}, read(s)) for s in everything])
        return "".join(lines)

    async def sample_event_loop_lag(self, interval: float = LAG_INTERVAL) -> None:
        """Run forever (cancel it): every ``interval`` seconds, record how late the timer fired."""
        while True:
            before = anyio.current_time()
            await anyio.sleep(interval)
            self.event_loop_lag.observe(max(anyio.current_time() - before - interval, 0.0))


def _family(name: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}\n", f"# TYPE {name} counter\n"]
    for labels, value in samples:
        text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
        lines.append(f"{name}{{{text}}} {floatToGoString(value)}\n")
    return lines


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
