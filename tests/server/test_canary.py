"""The determinism canary on a loaded server: every finished request (rate 1.0) is replayed alone
when the server is idle. Invariant numerics: no mismatch. Standard numerics (the negative control):
the same concurrent load makes the canary find mismatches, logged with the request id."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.server.conftest import Server, start_server
from tests.server.workload import mixed_requests, send_all_at_once

LOAD = 12  # concurrent requests; every seventh asks for n=2


def _engine_requests(reqs) -> int:
    return sum(kw.get("n", 1) for _, kw in reqs)


def _wait_checks(server: Server, count: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while server.metric("samebits_canary_checks_total") < count:
        assert time.monotonic() < deadline, f"canary checked fewer than {count} requests"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def canary_server() -> Iterator[Server]:
    yield from start_server("--canary-rate", "1.0")


@pytest.fixture(scope="module")
def standard_canary_server() -> Iterator[Server]:
    yield from start_server("--canary-rate", "1.0", "--standard")


def _load_and_check(server: Server) -> float:
    reqs = mixed_requests(LOAD, seed=77)
    send_all_at_once(server.async_client(), reqs, timeout=900)
    _wait_checks(server, _engine_requests(reqs))
    return server.metric("samebits_canary_mismatches_total")


def test_canary_replays_every_request_of_a_concurrent_load_without_mismatch(canary_server):
    assert _load_and_check(canary_server) == 0
    assert canary_server.metric("samebits_canary_checks_total") == _engine_requests(
        mixed_requests(LOAD, seed=77))
    canary_server.wait_idle()


def test_negative_control_canary_finds_mismatches_in_standard_mode(standard_canary_server):
    assert _load_and_check(standard_canary_server) > 0
    assert "determinism canary: request cmpl-" in standard_canary_server.log_tail(20000) or \
        "determinism canary: request chatcmpl-" in standard_canary_server.log_tail(20000)
