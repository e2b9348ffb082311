"""Per-layer profiles of runs: what each step did, when and on which thread; as a trace and a table.

A `Profile` collects one `StepRecord` for every step (a layer, an upload, a
download) of every run it is attached to, and turns them into

- a **trace** in the Chrome Trace Event Format (`Profile.trace()`, `Profile.write_trace()`),
  which ui.perfetto.dev and chrome://tracing open: one complete slice per step on the track of the
  thread that ran it, each run as an async slice from its ``schedule`` to its last step;
- **per-op totals** (`Profile.op_totals()`, `Profile.summary()`).

Times come from `time.perf_counter_ns()`, one monotonic clock for every thread. A step's
*queue* time runs from the moment its inputs were ready and it was handed to its backend (for a
layer inside a segment of light layers, the moment the segment's job reached it) to its start.

The runtime writes to a profile through a `RunRecorder`, made once per profiled run; a run
nobody profiles has none, and pays nothing per step.
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# (run, layer, op_type, backend, kind, queued_ns, start_ns, end_ns, thread ident, thread name,
#  bytes, failed, output shapes): what a step completion appends, converted to StepRecord on demand.
_Raw = tuple[int, str, str, str, str, int, int, int, int, str, int, bool, tuple]


@dataclass(frozen=True)
class StepRecord:
    """One step of one profiled run.

    ``kind`` is ``"layer"``, ``"upload"`` or ``"download"``; ``op_type`` is the layer's op with its
    fused activations (``Conv+Relu``; ``Upload``/``Download`` for transfers). ``nbytes`` is the
    size of the host array a transfer moved (0 for layers). ``failed`` marks a step whose kernel
    failed. Times are `time.perf_counter_ns()` values. On a device backend a layer's slice is
    the time to *issue* its work on the device queue, not the device's execution time; a
    download's runs until its data is on the host.
    """

    run: int
    layer: str
    op_type: str
    backend: str
    kind: str
    queued_ns: int
    start_ns: int
    end_ns: int
    thread_id: int
    thread_name: str
    nbytes: int = 0
    failed: bool = False
    output_shapes: tuple = ()

    @property
    def queue_ns(self) -> int:
        """How long the step waited, ready, before it started."""
        return max(0, self.start_ns - self.queued_ns)

    @property
    def duration_ns(self) -> int:
        """How long the step ran."""
        return self.end_ns - self.start_ns


@dataclass(frozen=True)
class RunRecord:
    """One profiled run: its number in the profile, its model and backend, when it was scheduled."""

    run: int
    model: str
    backend: str
    scheduled_ns: int


@dataclass(frozen=True)
class OpTotal:
    """The steps of one op type on one backend, summed over every run of a profile."""

    op_type: str
    backend: str
    count: int
    total_ns: int
    queue_ns: int
    nbytes: int

    @property
    def mean_ns(self) -> float:
        """Mean duration of one step."""
        return self.total_ns / self.count if self.count else 0.0


class Profile:
    """Per-step timings of the runs it is attached to (see `asyncinfer.Worker.profile()`).

    Thread-safe: steps are recorded from the threads that run them, while the profile may be read
    (a trace or a summary covers the steps finished so far). One profile may collect runs of
    several workers, e.g. to see two models side by side in one trace.

    Args:
        name: the process name the trace shows (default ``asyncinfer``).
    """

    def __init__(self, name: str = "asyncinfer"):
        self.name = name
        self.origin_ns = time.perf_counter_ns()
        self._lock = threading.Lock()
        self._runs: list[RunRecord] = []
        self._raw: list[_Raw] = []
        self._last_run = 0  # never reused, even after clear(): runs in flight keep their numbers

    # -- recording (runtime side) ---------------------------------------------------------------
    def _begin_run(self, model: str, backend: str) -> int:
        with self._lock:
            self._last_run = run = self._last_run + 1
            self._runs.append(RunRecord(run, model, backend, time.perf_counter_ns()))
        return run

    # -- reading ----------------------------------------------------------------------------------
    @property
    def runs(self) -> list[RunRecord]:
        """The runs recorded so far, in the order they were scheduled."""
        with self._lock:
            return list(self._runs)

    @property
    def records(self) -> list[StepRecord]:
        """Every step finished so far, ordered by start time."""
        return sorted((StepRecord(*raw) for raw in list(self._raw)), key=lambda r: (r.start_ns, r.end_ns))

    def clear(self) -> None:
        """Forget every run and step recorded so far (the profile stays attached where it was)."""
        with self._lock:
            self._runs.clear()
            self._raw.clear()

    def op_totals(self) -> list[OpTotal]:
        """Per (op type, backend): step count, total and queue time, bytes moved; longest first."""
        sums: dict[tuple[str, str], list[int]] = {}
        for r in self.records:
            entry = sums.setdefault((r.op_type, r.backend), [0, 0, 0, 0])
            entry[0] += 1
            entry[1] += r.duration_ns
            entry[2] += r.queue_ns
            entry[3] += r.nbytes
        totals = [OpTotal(op, backend, *values) for (op, backend), values in sums.items()]
        return sorted(totals, key=lambda t: (-t.total_ns, t.op_type, t.backend))

    def summary(self) -> str:
        """A text table of `op_totals()`, with each op type's share of the step time, and a
        last line with the run count and their mean wall time (schedule to last step)."""
        totals = self.op_totals()
        busy = sum(t.total_ns for t in totals) or 1
        header = f"{'op type':<28} {'backend':<10} {'steps':>6} {'total ms':>10} {'mean us':>10} " \
                 f"{'queue ms':>9} {'share':>6} {'bytes':>12}"
        lines = [header, "-" * len(header)]
        for t in totals:
            lines.append(f"{t.op_type[:28]:<28} {t.backend[:10]:<10} {t.count:>6} {t.total_ns / 1e6:>10.3f} "
                         f"{t.mean_ns / 1e3:>10.1f} {t.queue_ns / 1e6:>9.3f} {100 * t.total_ns / busy:>5.1f}% "
                         f"{t.nbytes if t.nbytes else '':>12}".rstrip())
        walls = list(self._run_spans().values())
        mean_wall = sum(end - start for start, end in walls) / len(walls) / 1e6 if walls else 0.0
        steps = sum(t.count for t in totals)
        lines.append("-" * len(header))
        lines.append(f"{len(walls)} run(s), {steps} steps, {busy / 1e6 if totals else 0:.3f} ms in steps; "
                     f"mean run {mean_wall:.3f} ms (schedule to last step)")
        return "\n".join(lines)

    def _run_spans(self) -> dict[int, tuple[int, int]]:
        """Each run with at least one finished step: (scheduled, last step's end)."""
        ends: dict[int, int] = {}
        for raw in list(self._raw):
            ends[raw[0]] = max(ends.get(raw[0], 0), raw[7])
        return {run.run: (run.scheduled_ns, ends[run.run]) for run in self.runs if run.run in ends}

    # -- the trace --------------------------------------------------------------------------------
    def trace(self) -> dict[str, Any]:
        """The profile as Chrome Trace Event Format JSON (a dict; `write_trace()` saves it).

        Each step is a complete event (``"ph": "X"``, ``ts``/``dur`` in microseconds since the
        profile was made) named after its layer, on the track of its thread (named by metadata
        events); ``args`` hold its op type, backend, run, queue time, bytes and output shapes.
        Each run is an async slice (``"b"``/``"e"``, category ``run``) from ``schedule`` to its
        last step. Steps that overlap on one thread (a download waits for its data while the
        device thread issues later layers) go to an extra track of that thread, so every track's
        slices are ordered and disjoint.
        """
        pid = os.getpid()
        records = self.records
        tracks = _assign_tracks(records)
        origin = self.origin_ns

        def us(ns: int) -> float:
            return round((ns - origin) / 1e3, 3)

        events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                                         "args": {"name": self.name}}]
        for (ident, lane), (tid, name) in sorted(tracks.names.items(), key=lambda kv: kv[1][0]):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": name if lane == 0 else f"{name} ({lane + 1})"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        slices = []
        for record, tid in zip(records, tracks.tids):
            args: dict[str, Any] = {"op_type": record.op_type, "backend": record.backend, "run": record.run,
                                    "queue_us": round(record.queue_ns / 1e3, 3)}
            if record.nbytes:
                args["bytes"] = record.nbytes
            if record.output_shapes:
                args["output_shapes"] = [list(s) for s in record.output_shapes]
            if record.failed:
                args["failed"] = True
            slices.append({"ph": "X", "name": record.layer, "cat": record.kind, "ts": us(record.start_ns),
                           "dur": round(record.duration_ns / 1e3, 3), "pid": pid, "tid": tid, "args": args})
        runs = {r.run: r for r in self.runs}
        for run, (start, end) in self._run_spans().items():
            info = runs[run]
            common = {"cat": "run", "name": f"run {run} ({info.model} on {info.backend})", "id": run, "pid": pid, "tid": 0}
            slices.append({**common, "ph": "b", "ts": us(start), "args": {"model": info.model, "backend": info.backend}})
            slices.append({**common, "ph": "e", "ts": us(max(end, start))})
        slices.sort(key=lambda e: (e["ts"], 0 if e["ph"] == "e" else 1))
        return {"traceEvents": events + slices, "displayTimeUnit": "ms",
                "otherData": {"generator": "asyncinfer", "clock": "time.perf_counter_ns"}}

    def write_trace(self, path: str | os.PathLike[str]) -> Path:
        """Write `trace()` as JSON to ``path`` (open it in ui.perfetto.dev); returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.trace(), separators=(",", ":")), encoding="utf-8")
        return path

    def __repr__(self) -> str:
        return f"<Profile {len(self._runs)} runs, {len(self._raw)} steps>"


class _Tracks:
    """Trace tracks: each record's track id, and each track's (id, thread name)."""

    def __init__(self) -> None:
        self.tids: list[int] = []
        self.names: dict[tuple[int, int], tuple[int, str]] = {}


def _assign_tracks(records: Iterable[StepRecord]) -> _Tracks:
    """Give every record (ordered by start) the first track of its thread where it overlaps no
    earlier slice: lane 0 is the thread itself, later lanes hold slices that overlap on it."""
    tracks = _Tracks()
    lane_ends: dict[int, list[int]] = {}
    for record in records:
        ends = lane_ends.setdefault(record.thread_id, [])
        lane = next((k for k, end in enumerate(ends) if end <= record.start_ns), len(ends))
        if lane == len(ends):
            ends.append(record.end_ns)
        else:
            ends[lane] = record.end_ns
        key = (record.thread_id, lane)
        if key not in tracks.names:
            tracks.names[key] = (len(tracks.names) + 1, record.thread_name)
        tracks.tids.append(tracks.names[key][0])
    return tracks


class RunRecorder:
    """Where the steps of one profiled run are written: each profile it was made for, under the
    run number that profile gave it. Made by the runtime when the run is scheduled."""

    __slots__ = ("_targets",)

    def __init__(self, profiles: Iterable[Profile], model: str, backend: str):
        self._targets = [(profile, profile._begin_run(model, backend)) for profile in profiles]

    def record(self, layer: str, op_type: str, backend: str, kind: str, queued_ns: int, start_ns: int,
               end_ns: int, thread: threading.Thread, nbytes: int, failed: bool, shapes: tuple) -> None:
        """(any thread) One finished step."""
        ident, name = thread.ident or 0, thread.name
        for profile, run in self._targets:
            profile._raw.append((run, layer, op_type, backend, kind, queued_ns, start_ns, end_ns,
                                 ident, name, nbytes, failed, shapes))
