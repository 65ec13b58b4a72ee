"""Whether the server takes work, and how it stops.

``Readiness`` answers /health: 503 while the server drains for shutdown, or once an engine loop
(the generation model's or the embedding model's) cannot go on (its thread died or an engine step
failed: ``AsyncEngine.error``). ``ReadinessGate`` then refuses new work (``/v1/*``, ``/tokenize``,
``/detokenize``) with 503 before any body is read; nothing else changes.

``run`` serves the app with uvicorn under ``ServerLimits``: the bounded connection protocol
(samebits.server.connections) and ``DrainingServer``, whose shutdown (SIGTERM, SIGINT) stops
accepting, lets running requests finish for ``shutdown_grace_s``, then stops the workers: every
request still running ends with an error (a stream: an error event, then ``[DONE]``), and the
process exits at most ``FINAL_EVENTS_S`` later.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from samebits.server.connections import ensure_descriptors, protocol_class, rate_limit_accept_errors
from samebits.server.limits import ServerLimits

log = logging.getLogger("samebits.server")
FINAL_EVENTS_S = 5.0  # after the grace period: time for the last error events to be written
_WORK_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@dataclass
class Readiness:
    """``checks``: each returns why its worker cannot serve, or None; ``stop``: what ends the
    running work when the grace period is over (stops the workers)."""

    checks: Sequence[Callable[[], str | None]] = ()
    stop: Callable[[], None] = lambda: None
    draining: bool = field(default=False)

    def problem(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        return next((p for p in (check() for check in self.checks) if p is not None), None)


class ReadinessGate:
    """Pure ASGI: new work gets 503 (naming why) while ``readiness`` has a problem."""

    def __init__(self, app: ASGIApp, readiness: Readiness) -> None:
        self.app, self.readiness = app, readiness

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        problem = None
        if scope["type"] == "http" and scope["path"].startswith(_WORK_PREFIXES):
            problem = self.readiness.problem()
        if problem is None:
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": f"the server takes no new work: {problem}",
                                     "type": "server_error", "param": None,
                                     "code": "server_unavailable"}}).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown drains: see the module docstring."""

    def __init__(self, config: uvicorn.Config, readiness: Readiness, grace_s: float) -> None:
        super().__init__(config)
        self.readiness, self.grace_s = readiness, grace_s

    async def shutdown(self, sockets=None) -> None:
        self.readiness.draining = True
        expiry = asyncio.create_task(self._end_running_work())
        try:
            await super().shutdown(sockets)
        finally:
            if not expiry.done():
                expiry.cancel()
            else:
                await expiry  # the workers are stopped before the lifespan stops them again

    async def _end_running_work(self) -> None:
        await asyncio.sleep(self.grace_s)
        if self.server_state.tasks:
            log.warning("shutdown grace period (%g s) over: ending %d running request(s) with "
                        "an error", self.grace_s, len(self.server_state.tasks))
        await asyncio.to_thread(self.readiness.stop)


def make_server(app: ASGIApp, readiness: Readiness, limits: ServerLimits, host: str, port: int,
                log_level: str = "info") -> DrainingServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            http=protocol_class(limits),
                            timeout_keep_alive=limits.keep_alive_timeout_s,
                            timeout_graceful_shutdown=limits.shutdown_grace_s + FINAL_EVENTS_S)
    return DrainingServer(config, readiness, limits.shutdown_grace_s)


def run(app: ASGIApp, readiness: Readiness, limits: ServerLimits, host: str, port: int,
        log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT, then drain (blocks)."""
    ensure_descriptors(limits.max_connections)
    rate_limit_accept_errors()
    make_server(app, readiness, limits, host, port, log_level).run()
