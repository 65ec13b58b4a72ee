"""The API key comes first, everywhere: with a key set, every endpoint but /health (and /metrics
with --metrics-public) is a 401 without it -- the tokenizer endpoints, the docs and unknown paths
included -- and the key is checked from the headers alone, before one body byte is read."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from samebits.server.app import build_app
from samebits.server.limits import ServerLimits
from tests.server.live import AUTH, KEY, live, tiny_engine

GUARDED = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
           ("POST", "/v1/embeddings"), ("POST", "/tokenize"), ("POST", "/detokenize"),
           ("GET", "/tokenizer_info"), ("GET", "/version"), ("GET", "/docs"), ("GET", "/redoc"),
           ("GET", "/docs/oauth2-redirect"), ("GET", "/openapi.json"), ("GET", "/metrics"),
           ("GET", "/no-such-path"), ("POST", "/v1/update_weights"), ("POST", "/v1/responses"),
           ("GET", "/v1/models/{model_id}")]
BAD_KEYS = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
            {"Authorization": KEY}, {"Authorization": f"Bearer {KEY}x"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def srv(engine, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("weights"))
    with live(engine, ServerLimits(enable_weight_updates=True, weight_update_root=root)) as s:
        yield s


def test_the_guarded_list_names_every_route_but_health(engine):
    app = build_app(engine, "tiny", KEY, limits=ServerLimits(
        enable_weight_updates=True, weight_update_root="/"))
    paths = set(app.openapi()["paths"]) | {r.path for r in app.routes if hasattr(r, "path")}
    assert paths - {path for _, path in GUARDED} == {"/health"}


@pytest.mark.parametrize("method, path", GUARDED)
def test_every_endpoint_but_health_needs_the_key(srv, method, path):
    r = httpx.request(method, srv.url + path, json={}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.request(method, srv.url + path, headers=AUTH, json={}, timeout=30)
    assert r.status_code != 401, r.text


@pytest.mark.parametrize("headers", BAD_KEYS)
def test_a_wrong_key_or_scheme_is_a_401(srv, headers):
    r = httpx.post(f"{srv.url}/tokenize", headers=headers, json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


def test_health_is_open(srv):
    assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200


def test_metrics_public_opens_metrics_and_nothing_else(engine):
    with live(engine, ServerLimits(metrics_public=True)) as s:
        assert httpx.get(f"{s.url}/metrics", timeout=30).status_code == 200
        assert httpx.get(f"{s.url}/openapi.json", timeout=30).status_code == 401


def test_a_wrong_key_with_a_10_mb_body_declared_is_a_401_at_once(srv):
    head = ("POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
            f"Content-Type: application/json\r\nContent-Length: {10 * 1024 * 1024}\r\n\r\n")
    with srv.connect() as s:
        start = time.monotonic()
        s.sendall(head.encode())  # not one byte of the body follows
        s.settimeout(5)
        reply = b""
        while chunk := s.recv(65536):  # the server answers and closes
            reply += chunk
        assert time.monotonic() - start < 1.0
    assert reply.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in reply


def test_the_key_is_checked_before_any_body_byte_is_read(engine):
    app = build_app(engine, "tiny", KEY)
    sent = []

    async def receive():
        raise AssertionError("the body was read before the key was checked")

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"",
             "query_string": b"", "root_path": "", "client": ("1.2.3.4", 5), "server": None,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", b"10485760"), (b"authorization", b"Bearer no")]}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 401
