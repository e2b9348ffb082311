"""Connections dealt by the supervisor of ``serve --workers N`` to its workers, in turn.

The supervisor (`.supervisor`) accepts the HTTP connections and sends each one's socket to the
next worker over that worker's channel (a Unix socket pair, the file descriptor travelling as
``SCM_RIGHTS`` ancillary data: POSIX, Linux and macOS alike). The worker's uvicorn server
(`dealt_server`) listens on nothing itself: it serves the connections it is sent, with
uvicorn's own HTTP protocol, so everything after the accept (keep-alive, limits, graceful
shutdown) is uvicorn's. Why deal rather than let every worker accept from the shared socket:
a client opens a few keep-alive connections and keeps them (perf_analyzer at concurrency 8
opens 8); accepting workers race for them and often split them 7:1 or 6:2, so one worker
saturates while the other idles. Dealt in turn, they split 4:4.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Callable
from typing import Any

__all__ = ["send_connection", "dealt_server"]

logger = logging.getLogger(__name__)

_BATCH = 64  # connections taken from the channel at most per read


def send_connection(channel: socket.socket, connection: socket.socket) -> None:
    """Send ``connection`` over a worker's ``channel`` (non-blocking: ``OSError`` when the
    worker is gone or not reading, then the caller deals it to another)."""
    socket.send_fds(channel, [b"c"], [connection.fileno()])


class _Receiver:
    """Takes the sockets arriving on ``channel`` and serves each with ``serve``."""

    def __init__(self, channel: socket.socket, serve: Callable[[socket.socket], Any]):
        self.channel, self.serve = channel, serve
        self.loop = asyncio.get_running_loop()
        channel.setblocking(False)
        self.loop.add_reader(channel.fileno(), self._readable)

    def _readable(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self.channel, _BATCH, _BATCH)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.error("the supervisor's channel failed: %s", exc)
                self.stop()
                return
            if not data and not fds:  # the supervisor closed it
                self.stop()
                return
            for fd in fds:
                self.serve(socket.socket(fileno=fd))

    def stop(self) -> None:
        with contextlib.suppress(ValueError, OSError):  # already stopped
            self.loop.remove_reader(self.channel.fileno())
        self.channel.close()


def dealt_server(config: Any, channel: socket.socket) -> Any:
    """A uvicorn server (``config``: a ``uvicorn.Config``) serving the connections the
    supervisor sends over ``channel``, until it shuts down (then it takes no more: the
    supervisor deals them to the other workers)."""
    import uvicorn

    class DealtServer(uvicorn.Server):
        receiver: _Receiver | None = None

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=[])  # the lifespan, and no listener of its own
            if not self.started:
                return
            # What uvicorn's own listener makes for each connection it accepts.
            protocol = functools.partial(self.config.http_protocol_class, config=self.config,
                                         server_state=self.server_state, app_state=self.lifespan.state)
            loop = asyncio.get_running_loop()
            connecting: set[asyncio.Task[None]] = set()  # referenced until done: the loop keeps weak ones

            def serve(connection: socket.socket) -> None:
                task = loop.create_task(_connect(loop, protocol, connection))
                connecting.add(task)
                task.add_done_callback(connecting.discard)

            self.receiver = _Receiver(channel, serve)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            if self.receiver is not None:
                self.receiver.stop()
            await super().shutdown(sockets=None)

    return DealtServer(config)


async def _connect(loop: asyncio.AbstractEventLoop, protocol: Callable[[], asyncio.Protocol],
                   connection: socket.socket) -> None:
    try:
        await loop.connect_accepted_socket(protocol, connection)
    except OSError as exc:  # the client left while the connection travelled
        logger.debug("a dealt connection was lost: %s", exc)
        connection.close()
