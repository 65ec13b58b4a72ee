"""Connection limits below the ASGI app: uvicorn's HTTP protocol with a header deadline and a cap
on open connections, and a rate limit on accept-error logging.

Invariants (``ServerLimits`` names the settings):

- A connection is *idle* from when it opens, or finishes a response, until its next request's
  headers are complete. An idle connection must complete its headers within
  ``header_timeout_s`` of opening or of its first byte after a response (else it is closed);
  with no byte at all after a response, uvicorn's keep-alive timeout closes it.
- At most ``max_connections`` connections stay open: a new connection past it closes the idle
  connection that has been idle longest (slowloris sockets, idle keep-alives). When none is idle
  (every connection is inside a request), the new connection's request gets 503 with
  Retry-After and the connection is closed after it, except ``GET /health``, always answered.
  So the number of open descriptors stays near ``max_connections`` and ``accept`` never runs
  out of them (``ensure_descriptors`` checks the process limit at startup).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import time
from collections import OrderedDict
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from samebits.server.limits import ServerLimits

try:  # what uvicorn's "auto" would pick
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Base
except ImportError:
    from uvicorn.protocols.http.h11_impl import H11Protocol as _Base  # type: ignore[assignment]

log = logging.getLogger("samebits.server")
DESCRIPTOR_RESERVE = 256  # descriptors kept for the model, logs, threads beyond the connections
BUSY = json.dumps({"error": {"message": "the server is busy: every connection is in use "
                             "(--max-connections); retry later", "type": "server_error",
                             "param": None, "code": "server_busy"}}).encode()


class _Idle:
    """The idle connections of one server, oldest first."""

    def __init__(self) -> None:
        self.order: OrderedDict[Any, None] = OrderedDict()

    def add(self, conn: Any) -> None:
        self.order[conn] = None
        self.order.move_to_end(conn)

    def discard(self, conn: Any) -> None:
        self.order.pop(conn, None)

    def oldest(self, other_than: Any) -> Any | None:
        return next((c for c in self.order if c is not other_than), None)


def protocol_class(limits: ServerLimits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class bounded by ``limits`` (one idle registry per call: one per
    server)."""
    idle = _Idle()

    class BoundedProtocol(_Base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._app, self._deadline, self._armed = self.app, None, None
            if len(self.connections) > limits.max_connections:
                victim = idle.oldest(other_than=self)
                if victim is not None:  # out of the count now: its connection_lost comes later
                    idle.discard(victim)
                    self.connections.discard(victim)
                    victim.transport.abort()
            idle.add(self)
            self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_deadline()
            idle.discard(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
                self._await_headers()  # the first byte of a next request
            over = len(self.connections) > limits.max_connections
            self.app = _health_only(self._app) if over else self._app
            super().data_received(data)
            if self._deadline is not None and self.cycle is not self._armed:
                self._stop_deadline()  # the headers are complete: a request is running
                idle.discard(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                idle.add(self)

        def _await_headers(self) -> None:
            self._armed = self.cycle
            self._deadline = self.loop.call_later(limits.header_timeout_s, self._headers_late)

        def _stop_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_late(self) -> None:
            self._deadline = None
            if self.cycle is self._armed and not self.transport.is_closing():
                self.transport.abort()

    return BoundedProtocol


def _health_only(app: ASGIApp) -> ASGIApp:
    """Past the connection cap: ``/health`` is answered, anything else gets 503."""

    async def busy(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/health":
            return await app(scope, receive, send)
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(BUSY)).encode()),
            (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": BUSY})
    return busy


def ensure_descriptors(max_connections: int) -> None:
    """Raise the soft descriptor limit to what ``max_connections`` needs (within the hard one);
    ``ValueError`` naming ``--max-connections`` when the hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + DESCRIPTOR_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise ValueError(f"--max-connections {max_connections} needs {need} file "
                             f"descriptors; this process may open {hard} (ulimit -n): lower "
                             f"--max-connections to at most {hard - DESCRIPTOR_RESERVE}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


_RESOURCE_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class AcceptErrorFilter(logging.Filter):
    """Lets through at most one accept-error record (a descriptor or memory shortage in
    ``accept``, as asyncio and uvloop log it) per ``interval_s``; the next one let through says
    how many were dropped. Other records pass untouched."""

    def __init__(self, interval_s: float = 10.0) -> None:
        super().__init__()
        self.interval_s, self.last, self.dropped = interval_s, -float("inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not _is_accept_error(record):
            return True
        now = time.monotonic()
        if now - self.last < self.interval_s:
            self.dropped += 1
            return False
        if self.dropped:
            record.msg = f"{record.msg} ({self.dropped} more accept errors not logged)"
        self.last, self.dropped = now, 0
        return True


def _is_accept_error(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if isinstance(exc, OSError) and exc.errno in _RESOURCE_ERRNOS:
        return True
    return "accept" in str(record.msg).lower()


def rate_limit_accept_errors(interval_s: float = 10.0) -> AcceptErrorFilter:
    """Install one ``AcceptErrorFilter`` on the loggers accept errors go to."""
    f = AcceptErrorFilter(interval_s)
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(f)
    return f
