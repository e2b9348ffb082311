"""Request tracing with Triton's trace settings: which requests are traced, and where traces go.

Triton's trace extension, as ``tritonclient`` and ``perf_analyzer`` drive it
(``GET/POST /v2/trace/setting`` and ``/v2/models/{m}/trace/setting``, gRPC ``TraceSetting``):
``trace_level`` ``["OFF"]`` or ``["TIMESTAMPS"]``, ``trace_rate`` (trace one request in that
many), ``trace_count`` (how many more to trace; -1: no bound), ``trace_file`` and
``log_frequency``. A model's own settings override the server's; a setting posted as ``null``
goes back to the server's value.

A traced request runs alone on its model's worker (never merged into a batch) under an
``asyncinfer.Profile``, so its trace has one slice per layer with queue, start, end, thread,
backend and transfer bytes. Traces are kept in memory, the latest `KEEP_TRACES` of them
(``GET /v2/trace`` gives them as one Chrome/Perfetto trace), and when the server was started
with a trace folder (``asyncinfer serve --trace-dir DIR``), written to ``DIR/<trace_file>``: the
setting is a file *name* only, as a request may not choose where the server writes. With
OpenTelemetry installed (``pip install 'asyncinfer[otel]'``) each traced request is also a span
(``infer <model>``) with a child span per layer, sent wherever the application configured
OpenTelemetry's tracer provider (nothing is sent when none is).
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..files import write_atomically
from ..runtime.profiling import Profile
from .protocol import ProtocolError

#: Traces kept in memory for ``GET /v2/trace`` (the oldest dropped first).
KEEP_TRACES = 64
LEVELS = ("OFF", "TIMESTAMPS")
SETTINGS = ("trace_level", "trace_rate", "trace_count", "trace_file", "log_frequency")
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceSettings:
    """One set of trace settings (the server's, or a model's)."""

    level: str = "OFF"
    rate: int = 1000
    count: int = -1
    file: str = ""
    log_frequency: int = 0

    def to_json(self) -> dict[str, Any]:
        """Triton's JSON form: every value a string, the level a list."""
        return {"trace_level": [self.level], "trace_rate": str(self.rate), "trace_count": str(self.count),
                "trace_file": self.file, "log_frequency": str(self.log_frequency), "trace_mode": "triton"}


def _one(value: Any, key: str) -> str:
    """A setting's value as one string (Triton's clients send a string or a one-item list)."""
    if isinstance(value, list):
        if len(value) != 1:
            raise ProtocolError(400, f"trace setting {key!r} takes one value, got {len(value)}")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ProtocolError(400, f"trace setting {key!r} must be a string, got {type(value).__name__}")
    return str(value)


def _integer(value: Any, key: str, low: int) -> int:
    text = _one(value, key)
    try:
        number = int(text)
    except ValueError:
        raise ProtocolError(400, f"trace setting {key!r} must be an integer, got {text[:40]!r}") from None
    if number < low or number > 2**31 - 1:
        raise ProtocolError(400, f"trace setting {key!r} must be from {low} to {2**31 - 1}, got {number}")
    return number


class Tracer:
    """The trace settings of one service and the traces of its sampled requests. Thread-safe."""

    def __init__(self, trace_dir: str | os.PathLike[str] | None = None):
        self.trace_dir = None if trace_dir is None else Path(trace_dir).resolve()
        if self.trace_dir is not None and not self.trace_dir.is_dir():
            raise ValueError(f"trace folder {trace_dir} does not exist")
        self._server = TraceSettings()
        self._models: dict[str, dict[str, Any]] = {}  # a model's overrides, by setting
        self._seen: dict[str, int] = {}  # requests counted towards trace_rate, per model
        self._left: dict[str | None, int] = {}  # trace_count left, per settings owner
        self._traces: deque[dict[str, Any]] = deque(maxlen=KEEP_TRACES)
        self._lock = threading.Lock()
        self._ids = 0
        # A worker process of `serve --workers N` writes its own trace file: "trace.json" -> "trace.w1.json".
        self.file_tag = ""

    # -- settings ------------------------------------------------------------------------------
    def settings(self, model: str | None = None) -> TraceSettings:
        """The settings in force for ``model`` (None: the server's)."""
        with self._lock:
            return self._settings(model)

    def _settings(self, model: str | None) -> TraceSettings:
        own = self._models.get(model, {}) if model is not None else {}
        return replace(self._server, **own)

    def update(self, changes: Mapping[str, Any], model: str | None = None) -> TraceSettings:
        """Apply posted settings (``null`` resets a model's setting to the server's); the settings
        now in force. ProtocolError(400) names a bad key or value; nothing changes then."""
        if not isinstance(changes, Mapping):
            raise ProtocolError(400, "trace settings must be a JSON object")
        parsed: dict[str, Any] = {}
        for key, value in changes.items():
            if key not in SETTINGS:
                raise ProtocolError(400, f"unknown trace setting {key!r}; known: {list(SETTINGS)}")
            field = {"trace_level": "level", "trace_rate": "rate", "trace_count": "count", "trace_file": "file",
                     "log_frequency": "log_frequency"}[key]
            if value is None:
                parsed[field] = None
            elif key == "trace_level":
                level = _one(value, key).upper()
                if level not in LEVELS:
                    raise ProtocolError(400, f"trace_level {level!r} is not supported; use one of {list(LEVELS)}")
                parsed[field] = level
            elif key == "trace_file":
                parsed[field] = self._file_name(_one(value, key))
            elif key == "trace_count":
                parsed[field] = _integer(value, key, -1)
            else:
                parsed[field] = _integer(value, key, 1 if key == "trace_rate" else 0)
        with self._lock:
            if model is None:
                if any(v is None for v in parsed.values()):
                    raise ProtocolError(400, "the server's trace settings cannot be null (only a model's can)")
                self._server = replace(self._server, **parsed)
            else:
                own = self._models.setdefault(model, {})
                for field, value in parsed.items():
                    if value is None:
                        own.pop(field, None)
                    else:
                        own[field] = value
            if "count" in parsed:
                self._left.pop(model, None)  # a new count starts over
            return self._settings(model)

    def _file_name(self, name: str) -> str:
        if name == "":
            return ""
        if self.trace_dir is None:
            raise ProtocolError(400, "trace_file cannot be set: the server was started without a trace folder "
                                     "(asyncinfer serve --trace-dir DIR); traces are at GET /v2/trace")
        if not _FILE_NAME.match(name):
            raise ProtocolError(400, f"trace_file must be a plain file name (letters, digits, '.', '_', '-'), "
                                     f"written in the server's trace folder; got {name[:60]!r}")
        return name

    # -- sampling and recording ------------------------------------------------------------------
    def sample(self, model: str) -> Profile | None:
        """A fresh Profile when this request to ``model`` is to be traced, else None."""
        if self._server.level == "OFF" and model not in self._models:
            return None  # every request asks: tracing off costs no lock and no settings copy
        with self._lock:
            settings = self._settings(model)
            if settings.level == "OFF":
                return None
            seen = self._seen.get(model, 0) + 1
            self._seen[model] = seen
            if seen % settings.rate:
                return None
            owner = model if model in self._models and "count" in self._models[model] else None
            left = self._left.get(owner, settings.count)
            if left == 0:
                return None
            if left > 0:
                self._left[owner] = left - 1
        return Profile()

    def record(self, model: str, version: str, profile: Profile) -> dict[str, Any]:
        """Keep the trace of one traced request (and write it to the trace file, and send it to
        OpenTelemetry when those are set up). Blocking file I/O: call it off the event loop."""
        with self._lock:
            self._ids += 1
            trace_id = self._ids
            settings = self._settings(model)
        trace = profile.trace()
        for event in trace["traceEvents"]:  # one trace per request: tell them apart in Perfetto
            event["pid"] = trace_id
            if event.get("ph") == "b" or event.get("ph") == "e":
                event["name"] = f"request {trace_id}: {model} v{version}"
        entry = {"id": trace_id, "model": model, "version": version, "events": trace["traceEvents"]}
        with self._lock:
            self._traces.append(entry)
        if settings.file and self.trace_dir is not None:
            name = Path(settings.file)
            self._write(self.trace_dir / (f"{name.stem}.{self.file_tag}{name.suffix}" if self.file_tag else name.name))
        _export_opentelemetry(model, version, profile)
        return entry

    def traces(self) -> dict[str, Any]:
        """The kept traces as one Chrome Trace Event Format document (one process per request)."""
        with self._lock:
            entries = list(self._traces)
        events: list[dict[str, Any]] = []
        for entry in entries:
            events.append({"ph": "M", "name": "process_name", "pid": entry["id"], "tid": 0,
                           "args": {"name": f"request {entry['id']}: {entry['model']} v{entry['version']}"}})
            events.extend(entry["events"])
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def _write(self, path: Path) -> None:
        try:
            write_atomically(path, json.dumps(self.traces(), separators=(",", ":")))
        except OSError as exc:  # a full disk must not fail the request that was traced
            logger.warning("could not write trace file %s: %s", path, exc)


def _export_opentelemetry(model: str, version: str, profile: Profile) -> None:
    """One span for the request and one per layer, with the profile's times (no-op without
    OpenTelemetry, or with no tracer provider configured)."""
    try:
        from opentelemetry import trace
    except ImportError:
        return
    records, runs = profile.records, profile.runs
    if not records or not runs:
        return
    to_epoch = time.time_ns() - time.perf_counter_ns()
    tracer = trace.get_tracer("asyncinfer")
    start = min([runs[0].scheduled_ns] + [r.start_ns for r in records])
    end = max(r.end_ns for r in records)
    root = tracer.start_span(f"infer {model}", start_time=start + to_epoch,
                             attributes={"model": model, "model.version": version, "layers": len(records)})
    context = trace.set_span_in_context(root)
    for r in records:
        span = tracer.start_span(r.layer, context=context, start_time=r.start_ns + to_epoch,
                                 attributes={"op_type": r.op_type, "backend": r.backend, "queue_us": r.queue_ns / 1e3,
                                             "bytes": r.nbytes, "failed": r.failed})
        span.end(end_time=r.end_ns + to_epoch)
    root.end(end_time=end + to_epoch)
