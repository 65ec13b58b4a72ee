"""Connection limits on the real socket stack (samebits.server.connections, RequestGuard): slowloris
sockets are closed by the header deadline, idle sockets past --max-connections are evicted, busy
connections past it get 503 while /health is answered, slow bodies get 408, bodies held at once
stay within --max-buffered-bytes, accept errors are logged at a bounded rate; and /health answers
within 250 ms under each of these."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import socket
import statistics
import time

import httpx
import pytest

from samebits.server.connections import AcceptErrorFilter
from samebits.server.limits import ServerLimits
from tests.server.live import AUTH, KEY, closed_by_peer, live, tiny_engine

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
HEALTH_BUDGET_S = 0.25
SLOWLORIS = 200


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True, scope="module")
def descriptors():
    """Both ends of every socket live in this process: room for a few thousand."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 8192) if hard != resource.RLIM_INFINITY else 8192
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _health_s(srv) -> float:
    """Seconds from connecting to the end of the answer of a GET /health (which must be 200)."""
    start = time.monotonic()
    with socket.create_connection((srv.host, srv.port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = _reply(s, 5.0)
    took = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    return took


def _health_typical_s(srv) -> float:
    """The median of five ``_health_s``: a server the held sockets block answers every one
    late; one scheduling hiccup of a shared machine delays one."""
    return statistics.median(_health_s(srv) for _ in range(5))


def _slowloris(srv, n: int) -> list[socket.socket]:
    """n connections, each with an unfinished request head."""
    socks = []
    for _ in range(n):
        s = srv.connect()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(s)
    return socks


def _reply(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout``)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def _close(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def test_slowloris_sockets_are_closed_by_the_header_deadline_and_health_stays_fast(engine):
    limits = ServerLimits(header_timeout_s=HEADER_TIMEOUT_S)
    with live(engine, limits) as srv:
        socks = _slowloris(srv, SLOWLORIS)
        try:
            time.sleep(0.2)
            assert _health_typical_s(srv) < HEALTH_BUDGET_S
            start = time.monotonic()
            assert all(closed_by_peer(s, HEADER_TIMEOUT_S + 2.0) for s in socks)
            assert time.monotonic() - start < HEADER_TIMEOUT_S + 2.0
        finally:
            _close(socks)


def test_a_trickled_second_request_on_a_kept_alive_connection_is_closed(engine):
    limits = ServerLimits(header_timeout_s=HEADER_TIMEOUT_S)
    with live(engine, limits) as srv, srv.connect() as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        for _ in range(3):  # each byte cancels uvicorn's keep-alive timer, never the deadline
            s.sendall(b"G")
            time.sleep(HEADER_TIMEOUT_S / 3)
        assert closed_by_peer(s, HEADER_TIMEOUT_S + 1.0)


def test_idle_connections_past_the_cap_are_evicted_oldest_first(engine):
    limits = ServerLimits(max_connections=16, header_timeout_s=30.0)
    with live(engine, limits) as srv:
        socks = _slowloris(srv, 40)
        try:
            assert _health_typical_s(srv) < HEALTH_BUDGET_S
            assert all(closed_by_peer(s, 2.0) for s in socks[:20])  # the oldest went first
            assert not any(closed_by_peer(s, 0.05) for s in socks[-10:])
        finally:
            _close(socks)


def test_past_the_cap_with_every_connection_busy_work_gets_503_and_health_200(engine):
    limits = ServerLimits(max_connections=8, body_timeout_s=30.0)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode()
    with live(engine, limits) as srv:
        busy = [srv.connect() for _ in range(8)]
        try:
            for s in busy:  # inside a request: the body never completes
                s.sendall(head)
            time.sleep(0.3)
            r = httpx.post(f"{srv.url}/v1/completions", headers=AUTH, timeout=5,
                           json={"prompt": [1, 2], "max_tokens": 1})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
            assert int(r.headers["retry-after"]) >= 1
            assert _health_typical_s(srv) < HEALTH_BUDGET_S
        finally:
            _close(busy)


def test_a_body_slower_than_the_deadline_gets_408_and_is_closed(engine):
    limits = ServerLimits(body_timeout_s=BODY_TIMEOUT_S)
    with live(engine, limits) as srv, srv.connect() as s:
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                   "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{").encode())
        start = time.monotonic()
        reply = _reply(s, BODY_TIMEOUT_S + 3)  # returns once the server closes the connection
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        assert time.monotonic() - start < BODY_TIMEOUT_S + 1.0


def test_bodies_held_at_once_stay_within_the_budget(engine):
    mib = 1024 * 1024
    limits = ServerLimits(max_request_bytes=mib, max_buffered_bytes=2 * mib, body_timeout_s=30.0)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {mib}\r\n\r\n").encode()
    with live(engine, limits) as srv:
        uploads = [srv.connect() for _ in range(3)]
        try:
            for s in uploads[:2]:  # 2 x 0.9 MiB held: the budget is nearly spent
                s.sendall(head + b" " * (9 * mib // 10))
            time.sleep(0.5)
            uploads[2].sendall(head + b" " * (mib // 2))
            reply = _reply(uploads[2], 5.0)
            assert reply.startswith(b"HTTP/1.1 503") and b"max-buffered-bytes" in reply
            assert _health_typical_s(srv) < HEALTH_BUDGET_S
        finally:
            _close(uploads)
        time.sleep(0.3)  # the refused and closed uploads gave their bytes back
        r = httpx.post(f"{srv.url}/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 200, r.text


def _accept_error() -> logging.LogRecord:
    """A record as asyncio's default exception handler logs a failed accept."""
    exc = OSError(errno.EMFILE, "Too many open files")
    return logging.LogRecord("asyncio", logging.ERROR, __file__, 0,
                             "socket.accept() out of system resource\nsocket: <socket>",
                             None, (OSError, exc, None))


def test_accept_errors_are_logged_at_most_once_per_interval():
    f = AcceptErrorFilter(interval_s=60.0)
    passed = [f.filter(_accept_error()) for _ in range(10_000)]
    assert passed[0] and sum(passed) == 1
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 0, "something else", None,
                              None)
    assert f.filter(other)
    f.last -= 61.0  # the interval has passed: the next one says how many were dropped
    record = _accept_error()
    assert f.filter(record) and "9999 more accept errors" in record.getMessage()


@pytest.mark.slow
def test_two_thousand_slowloris_sockets_are_closed_and_health_stays_fast(engine):
    limits = ServerLimits(header_timeout_s=3.0, max_connections=1000)
    with live(engine, limits) as srv:
        socks = _slowloris(srv, 2000)
        try:
            time.sleep(0.5)  # this process made the burst; the server takes it in meanwhile
            assert max(_health_s(srv) for _ in range(10)) < HEALTH_BUDGET_S
            assert all(closed_by_peer(s, 3.0 + 5.0) for s in socks)
        finally:
            _close(socks)


@pytest.mark.slow
def test_idle_sockets_cannot_exhaust_the_descriptors_of_samebits_serve(tmp_path):
    """The real command: 3,000 idle sockets against --max-connections 200; /health stays fast
    and the server's open descriptors stay near the cap."""
    from tests.server.conftest import start_server
    from tests.server.live import CONFIG
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    servers = start_server("--model", str(tmp_path / "config.json"), "--load-format", "dummy",
                           "--max-connections", "200", api_key=KEY, max_model_len=None)
    server = next(servers)
    url = httpx.URL(server.url)
    socks = []
    try:
        for _ in range(3000):
            socks.append(socket.create_connection((url.host, url.port), timeout=10))
        time.sleep(1.0)
        assert max(_health_s(url) for _ in range(10)) < HEALTH_BUDGET_S
        assert len(os.listdir(f"/proc/{server.proc.pid}/fd")) < 200 + 256
    finally:
        _close(socks)
        servers.close()
