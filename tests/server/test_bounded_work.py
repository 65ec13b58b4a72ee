"""Bounded work on a real ``samebits serve``: /tokenize, /detokenize, chat templating, many-prompt
completions and embeddings refuse what is over their token limit (a 400 naming the field) without
doing the work, keep /health answering while they handle a maximal body (tokenizing and
templating off the event loop), and give the memory back: the server's resident memory returns
to within 50 MB of its level before the oversize requests."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from samebits.server.tokenization import TOKENIZE_LIMIT_FACTOR
from tests.server.conftest import MAX_MODEL_LEN, start_server

BIG = "hello world " * 1_300_000  # 15.6 MB: under --max-request-bytes (16 MiB)
OVERSIZE = [  # (path, body, the field named)
    ("/tokenize", {"prompt": BIG}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": BIG}]}, "messages"),
    ("/tokenize", {"prompt": "hello world " * (TOKENIZE_LIMIT_FACTOR * MAX_MODEL_LEN // 2)},
     "prompt"),  # tokenized, then over the limit
    ("/detokenize", {"tokens": [1] * 3_000_000}, "tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}], "max_tokens": 1},
     "messages"),
    ("/v1/completions", {"prompt": ["hello world " * 100] * 10_000, "max_tokens": 1}, "n"),
]
RSS_SLACK_MB = 50


def _rss_mb(server) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _settled_rss(server, below: float, timeout: float = 10.0) -> float:
    """RSS once it is below ``below`` (memory is given back just after the response), or at
    the timeout."""
    deadline = time.monotonic() + timeout
    while (rss := _rss_mb(server)) >= below and time.monotonic() < deadline:
        time.sleep(0.2)
    return rss


def _post(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(server.url + path, content=body, timeout=300,
                      headers={**server.headers, "Content-Type": "application/json"})


def _poll_health(server, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.monotonic()
        httpx.get(f"{server.url}/health", timeout=30).raise_for_status()
        out.append(time.monotonic() - t)
        time.sleep(0.05)


def _send_oversize(server, requests) -> list[float]:
    """Each request, with /health polled meanwhile; the /health latencies."""
    bodies = [(path, json.dumps(body).encode(), param) for path, body, param in requests]
    _post(server, "/tokenize", b'{"prompt": "warm up"}').raise_for_status()
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=_poll_health, args=(server, stop, latencies))
    poller.start()
    try:
        for path, body, param in bodies:
            r = _post(server, path, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    finally:
        stop.set()
        poller.join()
    return latencies


def test_oversize_requests_are_refused_health_answers_and_memory_returns(server):
    idle: list[float] = []
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    _poll_health(server, stop, idle)
    before = _rss_mb(server)
    latencies = _send_oversize(server, OVERSIZE)
    after = _settled_rss(server, before + RSS_SLACK_MB)
    print(json.dumps({"rss_before_mb": before, "rss_after_mb": after,
                      "health_max_s": max(latencies), "health_idle_max_s": max(idle)}))
    assert after - before < RSS_SLACK_MB
    assert len(latencies) >= 3 and max(latencies) < 1.0 + max(idle)


@pytest.fixture(scope="module")
def embed_server():
    yield from start_server("--task", "embed", max_model_len=None)


@pytest.mark.slow
def test_oversize_embeddings_are_refused_or_truncated_and_memory_returns(embed_server):
    warm = {"input": ["hello world " * 200] * 8, "truncate": True}  # first-use allocations
    _post(embed_server, "/v1/embeddings", json.dumps(warm).encode()).raise_for_status()
    before = _rss_mb(embed_server)
    r = _post(embed_server, "/v1/embeddings", json.dumps({"input": BIG}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    r = _post(embed_server, "/v1/embeddings", json.dumps({"input": BIG, "truncate": True}).encode())
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 256, r.text[:300]
    after = _settled_rss(embed_server, before + RSS_SLACK_MB)
    print(json.dumps({"rss_before_mb": before, "rss_after_mb": after}))
    assert after - before < RSS_SLACK_MB
