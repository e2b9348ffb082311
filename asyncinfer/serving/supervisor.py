"""``asyncinfer serve --workers N``: N server processes behind one address, and their supervisor.

One Python process serves from one core at a time (the event loop, request decoding and the
batcher hold the GIL): on a machine with more cores, N processes serve more. The supervisor

- binds the HTTP socket once, accepts the connections and deals them to the workers in turn
  (`.handoff`: the socket travels over a Unix socket pair), which works alike on Linux and
  macOS and splits a client's few keep-alive connections evenly. Workers that shared the
  listening socket instead would race to accept and often split 8 connections 7:1 (measured:
  3 runs of 5 uneven); ``SO_REUSEPORT`` would hash them over per-worker queues (as uneven for
  a few connections, a dying worker drops those queued to it, and macOS does not spread them
  at all). While no worker serves (a restart of the only one), connections wait in the listen
  queue, none refused. gRPC (``--grpc-port``) is bound by grpcio in each worker with
  ``SO_REUSEPORT`` (grpcio cannot take a socket), so there the kernel spreads the connections
  (Linux); the supervisor holds the port, bound but not listening, so that it stays the group's;
- makes a private folder for the group (`.multiprocess`: the workers' control sockets, counters,
  model control state and prometheus-client's multiprocess files) and removes it at the end;
- gives each worker ``cores // N`` CPU threads (``--threads``) and as many BLAS threads
  (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``) unless set, so that N
  workers do not oversubscribe the cores;
- starts the workers, restarts one that dies (and logs it), and gives up (exit status 1) when
  a worker exits before serving at the first start (a bad model or option: every worker would
  fail alike), or, once the group served, `MAX_FAILED_STARTS` times in a row;
- on SIGTERM or SIGINT sends every worker SIGTERM, so each drains (``--drain-timeout``), waits
  for them, kills those still running `STOP_GRACE` seconds after the drain timeout, and exits
  0 (a second SIGINT kills the workers at once).

POSIX only (it passes sockets to child processes and the workers talk over Unix sockets).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import pickle
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .handoff import send_connection

__all__ = ["run_supervisor", "Supervisor", "worker_threads"]

logger = logging.getLogger("asyncinfer.serving.supervisor")

MAX_FAILED_STARTS = 3  # a worker exiting this many times in a row before it serves: give up
STOP_GRACE = 10.0  # seconds past the drain timeout before the workers still running are killed
POLL_INTERVAL = 0.2  # seconds between two looks at the workers (a signal wakes the loop at once)
RESTART_DELAYS = (0.0, 0.5, 1.0, 2.0, 5.0)  # seconds before restarting a worker that keeps dying
RAN_LONG_ENOUGH = 30.0  # a worker that served this long before dying is restarted at once
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
ACCEPT_BATCH = 64  # connections accepted at most before the workers are looked at again
# A worker: `python -c WORKER_CODE FOLDER INDEX WORKERS CHANNEL_FD SUPERVISOR_PID`.
WORKER_CODE = "import sys; from asyncinfer.serving.cli import serve_worker; sys.exit(serve_worker(*sys.argv[1:]))"


def worker_threads(workers: int, cores: int | None = None) -> int:
    """CPU threads per worker so that ``workers`` processes share the cores: at least one."""
    return max(1, (cores or os.cpu_count() or 1) // workers)


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    channel: socket.socket | None = None  # the supervisor's end: connections go to the worker through it
    started_at: float = 0.0
    failed_starts: int = 0  # in a row, before serving
    crashes: int = 0  # in a row, soon after starting
    restart_at: float = 0.0  # when it is to be started again (0: now)
    served: bool = False


@dataclass
class Supervisor:
    """Start ``workers`` worker processes serving ``args`` (the ``serve`` options) on the HTTP
    socket ``http``, watch them until told to stop, then stop them.

    Args:
        args: the parsed ``serve`` options (each worker gets a copy, ``port`` and
            ``grpc_port`` set to the bound ones).
        workers: how many worker processes.
        http: the bound, listening HTTP socket (its connections are dealt to the workers).
        grpc_port: the gRPC port (0: none); ``grpc_hold``: the socket holding it.
    """

    args: argparse.Namespace
    workers: int
    http: socket.socket
    grpc_port: int = 0
    grpc_hold: socket.socket | None = None
    folder: Path = field(default_factory=lambda: _make_folder())
    _workers: list[_Worker] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _kill: bool = False
    _ever_served: bool = False
    _env: dict[str, str] = field(default_factory=dict)
    _selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    _accepting: bool = False
    _turn: int = 0  # the worker the next connection goes to (when it serves)

    def run(self) -> int:
        """Serve until SIGTERM or SIGINT (or until a worker cannot start); the exit status."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        wake_read, wake_write = socket.socketpair()  # a signal wakes the loop at once
        for end in (wake_read, wake_write):
            end.setblocking(False)
        previous_wakeup = signal.set_wakeup_fd(wake_write.fileno())
        try:
            self._selector.register(wake_read, selectors.EVENT_READ)
            self.http.setblocking(False)
            self._prepare()
            self._workers = [_Worker(index) for index in range(self.workers)]
            for worker in self._workers:
                self._start(worker)
            status = self._watch(wake_read)
        finally:
            self._listen(False)
            self.http.close()  # new connections are refused while the workers drain
            self._stop_all()
            signal.set_wakeup_fd(previous_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for worker in self._workers:
                if worker.channel is not None:
                    worker.channel.close()
            self._selector.close()
            wake_read.close()
            wake_write.close()
            if self.grpc_hold is not None:
                self.grpc_hold.close()
            shutil.rmtree(self.folder, ignore_errors=True)
        return status

    # -- setup ----------------------------------------------------------------------------------
    def _prepare(self) -> None:
        os.chmod(self.folder, 0o700)
        for sub in ("stats", "prometheus"):
            (self.folder / sub).mkdir()
        args = copy.copy(self.args)
        args.port = self.http.getsockname()[1]
        args.grpc_port = self.grpc_port
        args.workers = 1
        if args.threads is None:
            args.threads = worker_threads(self.workers)
        with open(self.folder / "args.pickle", "wb") as f:
            pickle.dump(args, f)
        import asyncinfer

        package_root = str(Path(asyncinfer.__file__).resolve().parent.parent)
        env = dict(os.environ)
        # The workers import this asyncinfer, wherever the supervisor was started from.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        env["PROMETHEUS_MULTIPROC_DIR"] = str(self.folder / "prometheus")
        for name in BLAS_THREAD_VARIABLES:
            env.setdefault(name, str(args.threads))
        self._env = env

    def _start(self, worker: _Worker) -> None:
        self.ready_path(worker.index).unlink(missing_ok=True)
        if worker.channel is not None:
            worker.channel.close()
        mine, theirs = socket.socketpair()
        mine.setblocking(False)
        argv = [sys.executable, "-c", WORKER_CODE, str(self.folder), str(worker.index), str(self.workers),
                str(theirs.fileno()), str(os.getpid())]
        try:
            # Its own session: a Ctrl-C in the terminal reaches the supervisor, which stops the workers in order.
            worker.proc = subprocess.Popen(argv, env=self._env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                           start_new_session=True)
        finally:
            theirs.close()
        worker.channel = mine
        worker.started_at = time.monotonic()
        worker.served = False
        logger.info("started worker %d (pid %d)", worker.index, worker.proc.pid)

    def ready_path(self, index: int) -> Path:
        return self.folder / f"w{index}.ready"

    # -- watching -------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop.is_set() and signum == signal.SIGINT:
            self._kill = True  # a second Ctrl-C: no more waiting
        self._stop.set()

    def _watch(self, wake: socket.socket) -> int:
        while not self._stop.is_set():
            for key, _ in self._selector.select(POLL_INTERVAL):
                if key.fileobj is self.http:
                    self._accept()
                else:
                    with contextlib.suppress(OSError):
                        wake.recv(4096)  # the signal's byte; its handler has run
            if self._stop.is_set():
                break
            now = time.monotonic()
            for worker in self._workers:
                proc = worker.proc
                if proc is None:
                    if now >= worker.restart_at:
                        self._start(worker)
                    continue
                if not worker.served and self.ready_path(worker.index).exists():
                    worker.served, worker.failed_starts, self._ever_served = True, 0, True
                    self._listen(True)
                status = proc.poll()
                if status is None:
                    continue
                if self._stop.is_set():
                    break
                served = worker.served
                self._exited(worker, status)
                self._listen(any(w.served and w.proc is not None for w in self._workers))
                if not served and not self._ever_served:  # the first start: every worker would fail alike
                    logger.error("worker %d could not start; stopping", worker.index)
                    return 1
                if worker.failed_starts >= MAX_FAILED_STARTS:
                    logger.error("worker %d failed to start %d times in a row (last exit status %s); giving up",
                                 worker.index, worker.failed_starts, status)
                    return 1
        return 0

    # -- dealing connections ------------------------------------------------------------------
    def _listen(self, on: bool) -> None:
        """Accept connections (while a worker serves), or leave them in the listen queue."""
        if on and not self._accepting and not self._stop.is_set():
            self._selector.register(self.http, selectors.EVENT_READ)
        elif not on and self._accepting:
            self._selector.unregister(self.http)
        else:
            return
        self._accepting = on

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                connection, _ = self.http.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: the connection waits in the queue
                logger.error("accepting a connection failed: %s", exc)
                return
            with connection:  # the worker has its own copy once sent
                self._deal(connection)

    def _deal(self, connection: socket.socket) -> None:
        """Send ``connection`` to the next serving worker (the one after, if that one fails)."""
        for _ in range(len(self._workers)):
            worker = self._workers[self._turn]
            self._turn = (self._turn + 1) % len(self._workers)
            if not worker.served or worker.channel is None or worker.proc is None:
                continue
            try:
                send_connection(worker.channel, connection)
                return
            except OSError:  # the worker is stopping or stuck: another takes it
                continue
        logger.error("no worker could take a connection; it was closed")

    def _exited(self, worker: _Worker, status: int) -> None:
        """Log a worker that died, and plan its restart."""
        assert worker.proc is not None
        pid = worker.proc.pid
        ran = time.monotonic() - worker.started_at
        _mark_dead(pid, self.folder / "prometheus")
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        if not worker.served:
            worker.failed_starts += 1
            logger.error("worker %d (pid %d) %s before serving", worker.index, pid, how)
        else:
            logger.error("worker %d (pid %d) %s after %.1f s; restarting it", worker.index, pid, how, ran)
        if worker.channel is not None:
            worker.channel.close()
            worker.channel = None
        worker.served = False
        worker.crashes = worker.crashes + 1 if ran < RAN_LONG_ENOUGH else 0
        delay = RESTART_DELAYS[min(worker.crashes, len(RESTART_DELAYS) - 1)]
        worker.proc, worker.restart_at = None, time.monotonic() + delay

    # -- stopping -------------------------------------------------------------------------------
    def _stop_all(self) -> None:
        """SIGTERM to every worker (each drains), then wait; kill those left after the drain
        timeout and `STOP_GRACE`, or at once on a second SIGINT."""
        running = [w.proc for w in self._workers if w.proc is not None and w.proc.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + float(getattr(self.args, "drain_timeout", 30.0)) + STOP_GRACE
        for proc in running:
            while proc.poll() is None and not self._kill and time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(POLL_INTERVAL)
            if proc.poll() is None:
                logger.error("worker pid %d did not stop in time; killing it", proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()


FOLDER_PREFIX = "asyncinfer-workers-"
#: The longest path of a Unix socket (``sun_path``: 108 bytes on Linux, 104 on macOS, with its NUL).
SOCKET_PATH_MAX = 103
#: What a worker's control socket adds to the temporary folder's path: ``/<prefix><pid>-<8
#: letters>/w<K>.sock`` (a pid of up to 7 digits, up to 9999 workers).
_SOCKET_TAIL = len(FOLDER_PREFIX) + 1 + 7 + 1 + 8 + 1 + len("w9999.sock")


def _make_folder() -> Path:
    """The group's private folder, named after the supervisor's pid, in the temporary folder, or
    in ``/tmp`` where that one's path is too long for the workers' sockets (a test runner's or
    a CI job's own TMPDIR: "AF_UNIX path too long"); the folders of supervisors that were killed
    (no clean-up) are removed first."""
    temporary = root = Path(tempfile.gettempdir())
    if len(str(root)) + _SOCKET_TAIL > SOCKET_PATH_MAX and os.access("/tmp", os.W_OK):
        root = Path("/tmp")
    for stale in {*temporary.glob(f"{FOLDER_PREFIX}*-*"), *root.glob(f"{FOLDER_PREFIX}*-*")}:
        pid = stale.name[len(FOLDER_PREFIX):].split("-", 1)[0]
        with contextlib.suppress(OSError, ValueError):
            if stale.stat().st_uid == os.getuid() and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=root))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mark_dead(pid: int, folder: Path) -> None:
    """prometheus-client's clean-up for a dead process's live gauges (none today; future ones)."""
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(folder))
    except (ImportError, OSError):
        pass


# -- the command ----------------------------------------------------------------------------------
def bind_http(host: str, port: int) -> socket.socket:
    """The listening HTTP socket every worker inherits (``OSError`` when it cannot be bound)."""
    sock = _bound(host, port, socket.SO_REUSEADDR)
    try:
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def hold_grpc_port(host: str, port: int) -> socket.socket:
    """Bind (without listening) ``host:port`` with ``SO_REUSEPORT``: the workers' gRPC servers
    join it, a process without that option cannot take it; port 0 picks a free one."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("--grpc-port with --workers needs SO_REUSEPORT, which this system lacks")
    return _bound(host, port, socket.SO_REUSEPORT)


def _bound(host: str, port: int, option: int) -> socket.socket:
    """A TCP socket with the socket ``option`` set, bound to ``host:port`` (closed on failure)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, option, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run_supervisor(args: argparse.Namespace, workers: int) -> int:
    """``asyncinfer serve --workers N`` (``args`` checked by the caller); the exit status."""
    if sys.platform == "win32":
        print("asyncinfer: error: --workers is not available on Windows", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="asyncinfer supervisor: %(message)s")
    try:
        http = bind_http(args.host, args.port)
    except OSError as exc:
        print(f"asyncinfer: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    hold = None
    grpc_port = getattr(args, "grpc_port", 0)
    if grpc_port:
        try:
            hold = hold_grpc_port(args.host, grpc_port)
        except OSError as exc:
            http.close()
            print(f"asyncinfer: error: cannot serve gRPC on {args.host}:{grpc_port}: {exc}", file=sys.stderr)
            return 1
        grpc_port = hold.getsockname()[1]
    port = http.getsockname()[1]
    print(f"serving at http://{args.host}:{port}/v2" + (f" and gRPC at {args.host}:{grpc_port}" if grpc_port else "")
          + f" from {workers} worker processes", file=sys.stderr, flush=True)
    return Supervisor(args, workers, http, grpc_port, hold).run()
