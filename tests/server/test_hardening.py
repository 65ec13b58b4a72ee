"""The server facing the open network: only JSON bodies (415), bounded bodies (413), /health
responsive while a maximal prompt is handled (tokenization off the event loop, early refusal),
memory given back, non-finite numbers refused, 405 with Allow, no redirects, documented bodies,
seeds that always replay, cache_salt isolation with cached_tokens, API keys checked at startup,
a queue limit that answers 503 with Retry-After while every accepted request completes, and error
messages that never echo more than a few dozen characters of the input."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from urllib.parse import urlparse

import httpx
import pytest

from samebits.server.errors import MESSAGE_LIMIT, QUOTE_LIMIT
from tests.server.conftest import MAX_MODEL_LEN, SECOND_API_KEY, start_server

MODEL = "SmolLM2-135M-Instruct"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MAX_REQUEST_BYTES = 16 * 1024 * 1024


def _post(server, path: str, body: bytes | dict, content_type: str = "application/json",
          **kw) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**server.headers, "Content-Type": content_type}
    return httpx.post(server.url + path, content=raw, headers=headers, timeout=120, **kw)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "", "application/xml",
                                          "application/jsonx"])
def test_non_json_content_type_gets_415_before_parsing(server, content_type):
    r = _post(server, CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 1}, content_type)
    assert r.status_code == 415
    assert r.json()["error"]["code"] == "unsupported_media_type"


def test_json_content_type_with_parameters_is_accepted(server):
    r = _post(server, CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 1},
              "Application/JSON ; charset=utf-8")
    assert r.status_code == 200, r.text


def _raw_request(server, head: str, body: bytes = b"") -> str:
    """Send a raw HTTP/1.1 request (no body beyond ``body``) and return the response text."""
    u = urlparse(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return data.decode("latin-1")


def test_declared_oversized_body_gets_413_without_being_sent(server):
    head = (f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {MAX_REQUEST_BYTES + 1}\r\n")
    response = _raw_request(server, head)  # not one byte of the body is sent
    assert response.startswith("HTTP/1.1 413"), response[:200]
    assert '"request_too_large"' in response


def test_streamed_oversized_body_gets_413(server):
    def chunks():
        for _ in range(17):
            yield b" " * (1024 * 1024)

    r = httpx.post(server.url + CMPL, content=chunks(), timeout=120,
                   headers={**server.headers, "Content-Type": "application/json"})
    assert r.status_code == 413


def _rss_mb(server) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def _health_latencies(server, stop: threading.Event, out: list[float], polls: int = 10**9
                      ) -> None:
    while not stop.is_set() and len(out) < polls:
        t = time.monotonic()
        httpx.get(f"{server.url}/health", timeout=30).raise_for_status()
        out.append(time.monotonic() - t)
        time.sleep(0.05)


def test_health_answers_while_maximal_prompts_are_handled_and_memory_returns(server):
    rss_before = _rss_mb(server)
    maximal = "hello world " * ((MAX_REQUEST_BYTES - 1000) // 12)  # refused by the cheap bound
    tokenized = "hello world " * 6000  # fits the bound, so it is tokenized (off the loop)
    bodies = []  # encoded up front: this process's own JSON work must not delay its polls
    for prompt in (maximal, tokenized, maximal):
        bodies.append((CMPL, json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})))
        bodies.append((CHAT, json.dumps({"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": prompt}]})))
    bodies = [(path, body.encode()) for path, body in bodies]
    baseline: list[float] = []
    _health_latencies(server, threading.Event(), baseline, polls=5)
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=_health_latencies, args=(server, stop, latencies))
    poller.start()
    try:
        for path, body in bodies:
            r = _post(server, path, body)
            assert r.status_code == 400 and b'"context_length_exceeded"' in r.content
    finally:
        stop.set()
        poller.join()
    print(json.dumps({"health_max_s": max(latencies), "health_polls": len(latencies),
                      "health_idle_max_s": max(baseline), "rss_before_mb": rss_before,
                      "rss_after_mb": _rss_mb(server)}))
    # the target is 0.25 s on an otherwise idle machine (benchmarks/RESULTS.md); loosely here:
    assert len(latencies) >= 3 and max(latencies) < 1.0 + max(baseline)
    assert _rss_mb(server) - rss_before < 300


@pytest.mark.parametrize("raw", [b'{"prompt": "hi", "max_tokens": 1, "temperature": NaN}',
                                 b'{"prompt": "hi", "max_tokens": 1, "temperature": Infinity}',
                                 b'{"prompt": "hi", "max_tokens": 1, "top_p": -Infinity}',
                                 b'{"prompt": "hi", "max_tokens": 1, "unknown": [1, NaN]}'])
def test_non_finite_numbers_get_400(server, raw):
    r = _post(server, CMPL, raw)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_nan_inside_a_string_is_fine(server):
    r = _post(server, CMPL, {"prompt": "NaN Infinity", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_wrong_method_gets_405_with_allow(server):
    r = httpx.get(server.url + CMPL, headers=server.headers, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.url}/health", timeout=30, headers={"Content-Type": "application/json"})
    assert r.status_code == 405 and "GET" in r.headers["allow"]


def test_trailing_slash_is_not_redirected(server):
    for method, path in (("POST", CMPL + "/"), ("GET", "/v1/models/"), ("GET", "/health/")):
        r = httpx.request(method, server.url + path, json={"prompt": "hi"}, timeout=30,
                          headers={**server.headers, "Host": "evil.example"})
        assert r.status_code == 404 and "location" not in r.headers


def test_openapi_documents_every_request_body(server):
    spec = httpx.get(f"{server.url}/openapi.json", headers=server.headers, timeout=30).json()
    schemas = spec["components"]["schemas"]
    for path, name in ((CMPL, "CompletionRequest"), (CHAT, "ChatCompletionRequest"),
                       ("/v1/embeddings", "EmbeddingRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"] == f"#/components/schemas/{name}"
        assert "properties" in schemas[name]
    assert {"prompt", "seed", "cache_salt"} <= set(schemas["CompletionRequest"]["properties"])
    assert "ChatMessage" in schemas  # nested models are resolvable
    posts = [p for p, ops in spec["paths"].items() if "post" in ops]
    assert all("requestBody" in spec["paths"][p]["post"] for p in posts), posts


# ---- seeds ----------------------------------------------------------------------------------
def _seeded(server, seed: int, n: int) -> dict:
    r = _post(server, CMPL, {"model": MODEL, "prompt": "Seeds:", "max_tokens": 6, "n": n,
                             "temperature": 1.0, "seed": seed, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_seed_at_the_top_wraps_and_every_reported_seed_replays(server):
    top = 2**63 - 1
    both = _seeded(server, top, n=2)
    assert both["seed"] == top and [c["seed"] for c in both["choices"]] == [top, 0]
    for choice in both["choices"]:
        alone = _seeded(server, choice["seed"], n=1)["choices"][0]
        assert alone["text"] == choice["text"]
        assert alone["logprobs"]["token_logprobs"] == choice["logprobs"]["token_logprobs"]
    drawn = _post(server, CMPL, {"prompt": "x", "max_tokens": 1, "n": 3}).json()
    assert all(0 <= c["seed"] <= top for c in drawn["choices"])


# ---- cache_salt -----------------------------------------------------------------------------
PROMPT = "The prefix cache is keyed by block hashes. " * 8  # several full 16-token blocks


def _cmpl(server, salt: str | None) -> dict:
    body = {"model": MODEL, "prompt": PROMPT + "Salt test.", "max_tokens": 4, "logprobs": 0,
            "seed": 7, "temperature": 0.8}
    if salt is not None:
        body["cache_salt"] = salt
    r = _post(server, CMPL, body)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_isolates_prefix_cache_and_never_changes_bits(server):
    a, b = f"tenant-a-{uuid.uuid4()}", f"tenant-b-{uuid.uuid4()}"
    first_a, again_a, first_b = _cmpl(server, a), _cmpl(server, a), _cmpl(server, b)
    assert _cached(first_a) == 0 and _cached(first_b) == 0  # salts share nothing
    assert _cached(again_a) >= 16 * 4  # the same salt hits
    unsalted = _cmpl(server, None)
    for other in (again_a, first_b, unsalted):
        assert other["choices"][0]["text"] == first_a["choices"][0]["text"]
        assert (other["choices"][0]["logprobs"]["token_logprobs"]
                == first_a["choices"][0]["logprobs"]["token_logprobs"])
    chat = _post(server, CHAT, {"model": MODEL, "max_tokens": 1, "cache_salt": a,
                                "messages": [{"role": "user", "content": "hi"}]}).json()
    assert _cached(chat) == 0  # present (0 included) in chat usage too


def test_empty_cache_salt_is_refused(server):
    r = _post(server, CMPL, {"prompt": "hi", "max_tokens": 1, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


# ---- API keys -------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["flag", "env", "env-item"])
def test_empty_api_key_fails_at_startup_naming_it(how):
    env = {k: v for k, v in os.environ.items() if k != "SAMEBITS_API_KEY"}
    args = [sys.executable, "-m", "samebits.cli", "serve", "--port", "1"]
    if how == "flag":
        args += ["--api-key", ""]
    else:
        env["SAMEBITS_API_KEY"] = "" if how == "env" else "good-key,"
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "API key" in proc.stderr, proc.stderr[-2000:]


def test_several_api_keys_are_each_accepted(server):
    for key, status in ((server.api_key, 200), (SECOND_API_KEY, 200), ("nope", 401)):
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"},
                      timeout=30)
        assert r.status_code == status


# ---- admission control ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def queue_server():
    yield from start_server("--max-queued-requests", "2", "--max-num-seqs", "1",
                            max_model_len=MAX_MODEL_LEN)


def test_past_the_queue_limit_503_with_retry_after_and_accepted_requests_complete(queue_server):
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        return await client.post(f"{queue_server.url}{CMPL}", timeout=600, json={
            "model": MODEL, "prompt": f"Count {i}:", "max_tokens": 8, "ignore_eos": True})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, i) for i in range(10)))

    responses = asyncio.run(burst())
    ok = [r for r in responses if r.status_code == 200]
    busy = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(busy) == 10 and busy and len(ok) >= 2  # at least the queue limit
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in ok)
    for r in busy:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "server_busy"
    queue_server.wait_idle(timeout=120)
    assert _post(queue_server, CMPL, {"prompt": "again", "max_tokens": 1}).status_code == 200


# ---- error messages -------------------------------------------------------------------------
LONG_INPUTS = [  # (body, a piece of the input that must not come back whole)
    ({"model": "x" * 100_000, "prompt": [1]}, "x" * (QUOTE_LIMIT + 1)),
    ({"prompt": [1], "stop_token_ids": [-1] * 50_000}, "-1, " * 12),
    ({"prompt": [1], "n" * 1000: 1}, "n" * (QUOTE_LIMIT + 1)),
]


@pytest.mark.parametrize("body, piece", LONG_INPUTS)
def test_error_messages_quote_at_most_a_few_dozen_characters_of_input(tmp_path, body, piece):
    from fastapi.testclient import TestClient

    from samebits.server.app import build_app
    from tests.server.live import tiny_engine
    with TestClient(build_app(tiny_engine(tmp_path), "tiny", None)) as client:
        r = client.post(CMPL, json=body)
    assert 400 <= r.status_code < 500
    error = r.json()["error"]
    assert len(error["message"]) <= MESSAGE_LIMIT and piece not in error["message"]
    assert error["param"] is None or piece not in error["param"]
