"""One worker process of ``asyncinfer serve --workers N``, and how it reaches the others.

The supervisor (`.supervisor`) makes a folder for the group, binds the listening socket and
starts N worker processes. Each serves the models with an `InferenceService` of its own, whose
``siblings`` is this process's `WorkerGroup`: the link to the other workers, so that what the
API promises about the whole server stays true (statistics and metrics count every process;
a load, an unload or a trace setting applies to every process). In the group's folder:

======================  =========================================================================
``w<K>.sock``           worker K's control socket: a JSON line asked, a JSON line answered
``w<K>.ready``          worker K's pid, written once it serves (the supervisor counts a worker
                        that exits before that as a failed start)
``stats/<pid>.json``    a worker's counters (`.statistics`), written every
                        `SNAPSHOT_INTERVAL` seconds when they changed, and when it exits: a
                        worker that exited still counts (a crashed one as of its last write)
``control.json``        the loads, unloads and trace settings made through the API, which a
                        worker starting later (a restart) applies before it serves
``prometheus/``         prometheus-client's multiprocess files (``PROMETHEUS_MULTIPROC_DIR``)
======================  =========================================================================

Nothing is shared on the path of an inference request: a worker asks the others only when a
client asks for statistics, metrics or traces, or changes the model control or trace settings.
The folder is the user's own (made with mode 0700), so only the same user can reach the sockets.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
from anyio.streams.buffered import BufferedByteReceiveStream

from ..files import write_atomically
from .protocol import ProtocolError
from .service import InferenceService
from .statistics import ProcessSnapshot

__all__ = ["WorkerGroup", "SNAPSHOT_INTERVAL"]

logger = logging.getLogger(__name__)

SNAPSHOT_INTERVAL = 0.25  # seconds between two writes of a worker's counters (when they changed)
PARENT_CHECK_INTERVAL = 1.0  # seconds between two looks at whether the supervisor still runs
ASK_TIMEOUT = 5.0  # seconds a worker waits for another's snapshot or traces (then: its file)
FANOUT_TIMEOUT = 600.0  # seconds a load, unload or trace setting may take in another worker
MAX_MESSAGE = 256 << 20  # bytes of one control message (traces are the large ones)
_TRACE_PID_STRIDE = 1_000_000  # worker K's traced request N is process K * stride + N in the merged trace


class WorkerGroup:
    """Worker ``index`` of ``workers`` sharing ``folder`` (made by the supervisor).

    Args:
        folder: the group's folder (see the module's table).
        index: this worker's number, 0 to ``workers - 1`` (kept by its restarts).
        workers: how many workers the group has.
        parent: the supervisor's pid: when it is gone, this worker shuts down.
    """

    def __init__(self, folder: str | os.PathLike[str], index: int, workers: int, parent: int | None = None):
        self.folder = Path(folder)
        self.index, self.workers = index, workers
        self.parent = parent
        self.multiprocess_dir = str(self.folder / "prometheus")
        self._service: InferenceService | None = None
        self._written = ""  # the snapshot last written

    # -- paths ----------------------------------------------------------------------------------
    def socket_path(self, index: int) -> Path:
        return self.folder / f"w{index}.sock"

    def ready_path(self, index: int) -> Path:
        return self.folder / f"w{index}.ready"

    @property
    def stats_dir(self) -> Path:
        return self.folder / "stats"

    # -- lifecycle (called by the service) ------------------------------------------------------
    async def catch_up(self, service: InferenceService) -> None:
        """Apply what the API changed before this worker started (a restarted worker follows the
        others): loads and unloads in explicit model control, then trace settings. (And name
        this worker's trace files: ``trace.json`` is written as ``trace.w<K>.json``.)"""
        service.tracer.file_tag = f"w{self.index}"
        state = await anyio.to_thread.run_sync(self._read_control)
        if service.model_control_mode == "explicit":
            for name, action in state["models"].items():
                try:
                    if action["op"] == "unload":
                        await service.unload(name, fan_out=False)
                    elif action.get("config") is not None or not _ready(service, name):
                        await service.load(name, action.get("config"), fan_out=False)
                except ProtocolError as exc:  # reported in the index, as a failed load is
                    logger.error("worker %d: catching up with %s %r: %s", self.index, action["op"], name, exc.message)
        trace = state["trace"]
        try:
            if trace["server"]:
                service.tracer.update(trace["server"])
            for model, changes in trace["models"].items():
                service.tracer.update(changes, model)
        except ProtocolError as exc:
            logger.error("worker %d: catching up with the trace settings: %s", self.index, exc.message)

    async def serve(self, service: InferenceService) -> None:
        """Answer the other workers, write this worker's counters now and then, and shut down
        if the supervisor is gone; until cancelled (after the service drained), when the
        counters are written one last time."""
        self._service = service
        path = self.socket_path(self.index)
        await anyio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))  # left by this worker's last process
        try:
            async with await anyio.create_unix_listener(path) as listener, anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, self._handle)
                await anyio.to_thread.run_sync(self.ready_path(self.index).write_text, str(os.getpid()))
                tg.start_soon(self._watch_parent)
                while True:
                    await self._write_snapshot()
                    await anyio.sleep(SNAPSHOT_INTERVAL)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))
                await self._write_snapshot()

    # -- what the service asks ------------------------------------------------------------------
    async def snapshots(self) -> list[ProcessSnapshot]:
        """Every other worker's counters: the live ones asked now, the others (exited, restarted,
        not answering) as they last wrote them."""
        live: dict[int, ProcessSnapshot] = {}
        for index, reply in (await self._ask_others({"op": "snapshot"}, ASK_TIMEOUT)).items():
            if isinstance(reply, dict):
                try:
                    snapshot = ProcessSnapshot.from_json(reply, live=True)
                except ValueError as exc:
                    logger.warning("worker %d sent a bad snapshot: %s", index, exc)
                    continue
                live[snapshot.pid] = snapshot
        stored = await anyio.to_thread.run_sync(self._read_snapshots, {os.getpid(), *live})
        return [*live.values(), *stored]

    async def publish(self, action: dict[str, Any]) -> None:
        """Record ``action`` (a load, unload or trace setting) for the workers that start later."""
        await anyio.to_thread.run_sync(self._update_control, action)

    async def fan_out(self, action: dict[str, Any]) -> list[tuple[int, str]]:
        """Apply ``action`` in every other worker now; ``(status, message)`` of each that failed
        (a worker that is not running is left out: it applies ``action`` when it starts)."""
        failures = []
        for index, reply in sorted((await self._ask_others(action, FANOUT_TIMEOUT)).items()):
            if isinstance(reply, dict):
                if reply.get("status"):
                    failures.append((int(reply["status"]), f"worker {index}: {reply.get('message', '')}"))
            elif reply is not None:
                failures.append((500, f"worker {index} did not answer ({reply})"))
        return failures

    async def traces(self, own: dict[str, Any]) -> dict[str, Any]:
        """``own`` traces merged with every other live worker's (worker K's request N is the
        trace's process K * 1,000,000 + N)."""
        documents = {self.index: own}
        for index, reply in (await self._ask_others({"op": "traces"}, ASK_TIMEOUT)).items():
            if isinstance(reply, dict) and isinstance(reply.get("traceEvents"), list):
                documents[index] = reply
        events: list[dict[str, Any]] = []
        for index, document in sorted(documents.items()):
            for event in document["traceEvents"]:
                event = dict(event)
                if isinstance(event.get("pid"), int):
                    event["pid"] += index * _TRACE_PID_STRIDE
                if event.get("name") == "process_name" and isinstance(event.get("args"), dict):
                    event["args"] = {**event["args"], "name": f"worker {index}, {event['args'].get('name', '')}"}
                events.append(event)
        return {**own, "traceEvents": events}

    # -- the control socket ---------------------------------------------------------------------
    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        async with stream:
            try:
                request = json.loads(await BufferedByteReceiveStream(stream).receive_until(b"\n", MAX_MESSAGE))
                reply = await self._answer(request)
                await stream.send(json.dumps(reply, separators=(",", ":")).encode() + b"\n")
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound, anyio.BrokenResourceError,
                    ValueError) as exc:
                logger.warning("worker %d: a bad control message: %s", self.index, exc)

    async def _answer(self, request: Any) -> Any:
        service = self._service
        assert service is not None
        op = request.get("op") if isinstance(request, dict) else None
        if op == "snapshot":
            return service.snapshot().to_json()
        if op == "traces":
            return service.tracer.traces()
        try:
            if op == "load":
                await service.load(request["name"], request.get("config"), fan_out=False)
            elif op == "unload":
                await service.unload(request["name"], fan_out=False)
            elif op == "trace":
                await service.update_trace(request["changes"], request.get("model"), fan_out=False)
            else:
                return {"status": 400, "message": f"unknown control message {op!r}"}
        except ProtocolError as exc:
            return {"status": exc.status, "message": exc.message}
        except Exception as exc:  # noqa: BLE001 - a bug: logged, reported to the asking worker
            logger.exception("worker %d: applying %s failed", self.index, op)
            return {"status": 500, "message": f"internal server error ({type(exc).__name__})"}
        return {}

    async def _ask_others(self, request: dict[str, Any], timeout: float) -> dict[int, Any]:
        """``{index: reply}`` from every other worker: a dict, None when it is not running, or
        the exception that kept it from answering."""
        replies: dict[int, Any] = {}
        payload = json.dumps(request, separators=(",", ":")).encode() + b"\n"

        async def ask(index: int) -> None:
            try:
                with anyio.fail_after(timeout):
                    async with await anyio.connect_unix(self.socket_path(index)) as stream:
                        await stream.send(payload)
                        replies[index] = json.loads(await BufferedByteReceiveStream(stream).receive_until(
                            b"\n", MAX_MESSAGE))
            except (FileNotFoundError, ConnectionRefusedError):
                replies[index] = None  # not running now (starting, restarting or stopping)
            except (OSError, TimeoutError, ValueError, anyio.EndOfStream, anyio.IncompleteRead,
                    anyio.DelimiterNotFound, anyio.BrokenResourceError) as exc:
                replies[index] = exc

        async with anyio.create_task_group() as tg:
            for index in range(self.workers):
                if index != self.index:
                    tg.start_soon(ask, index)
        return replies

    # -- files ----------------------------------------------------------------------------------
    async def _write_snapshot(self) -> None:
        if self._service is None:
            return
        text = json.dumps(self._service.snapshot().to_json(), separators=(",", ":"))
        if text != self._written:
            await anyio.to_thread.run_sync(write_atomically, self.stats_dir / f"{os.getpid()}.json", text)
            self._written = text

    def _read_snapshots(self, skip: set[int]) -> list[ProcessSnapshot]:
        snapshots = []
        for path in sorted(self.stats_dir.glob("*.json")):
            if not path.stem.isdigit() or int(path.stem) in skip:
                continue
            try:
                snapshots.append(ProcessSnapshot.from_json(json.loads(path.read_text()), live=False))
            except (OSError, ValueError) as exc:
                logger.warning("cannot read the counters of worker process %s: %s", path.stem, exc)
        return snapshots

    def _read_control(self) -> dict[str, Any]:
        try:
            state = json.loads((self.folder / "control.json").read_text())
        except FileNotFoundError:
            state = {}
        except (OSError, ValueError) as exc:
            logger.error("cannot read the group's model control state: %s", exc)
            state = {}
        state.setdefault("models", {})
        state.setdefault("trace", {})
        state["trace"].setdefault("server", {})
        state["trace"].setdefault("models", {})
        return state

    def _update_control(self, action: dict[str, Any]) -> None:
        with _locked(self.folder / "control.lock"):
            state = self._read_control()
            if action["op"] in ("load", "unload"):
                state["models"][action["name"]] = {"op": action["op"], "config": action.get("config")}
            else:  # the latest value of each setting (None: a model's setting reset) replays the same
                model = action.get("model")
                owner = state["trace"]["server"] if model is None else state["trace"]["models"].setdefault(model, {})
                owner.update(action["changes"])
            write_atomically(self.folder / "control.json", json.dumps(state))

    async def _watch_parent(self) -> None:
        """Shut this worker down (as SIGTERM does) once the supervisor is gone."""
        if self.parent is None:
            return
        while os.getppid() == self.parent:
            await anyio.sleep(PARENT_CHECK_INTERVAL)
        logger.error("worker %d: the supervisor (pid %d) is gone; shutting down", self.index, self.parent)
        os.kill(os.getpid(), signal.SIGTERM)


def _ready(service: InferenceService, name: str) -> bool:
    try:
        return service.model_ready(name)
    except ProtocolError:
        return False


class _locked:
    """An exclusive lock on ``path`` between processes (``flock``), as a context manager."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> None:
        import fcntl

        self.file = open(self.path, "a+")  # noqa: SIM115 - closed in __exit__
        fcntl.flock(self.file.fileno(), fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        self.file.close()  # releases the lock


def die_with_parent() -> None:
    """Linux: have the kernel send this process SIGTERM when its parent (the supervisor) dies,
    however it dies; elsewhere `WorkerGroup` polls for it."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
