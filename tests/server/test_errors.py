"""Bad input gets a 4xx with an OpenAI-style error body, the server stays up and leaks no KV
blocks; clients that leave abort their requests; the API key guards /v1/* but not /health."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN

MODEL = "SmolLM2-135M-Instruct"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _j(**body) -> bytes:
    return json.dumps(body).encode()


BAD = [  # (id, path, raw body, status, param)
    ("malformed-json", CMPL, b'{"prompt": "hi", ', 400, None),
    ("empty-body", CMPL, b"", 400, None),
    ("json-array", CMPL, b"[1, 2]", 400, None),
    ("invalid-utf8", CMPL, b'{"prompt": "\xff\xfe hi"}', 400, None),
    ("lone-surrogate", CMPL, b'{"prompt": "\\ud800"}', 400, None),
    ("prompt-wrong-type", CMPL, _j(prompt=123), 400, "prompt"),
    ("max-tokens-string", CMPL, _j(prompt="hi", max_tokens="5"), 400, "max_tokens"),
    ("temperature-string", CMPL, _j(prompt="hi", temperature="hot"), 400, "temperature"),
    ("stream-string", CMPL, _j(prompt="hi", stream="yes"), 400, "stream"),
    ("n-float", CMPL, _j(prompt="hi", n=1.5), 400, "n"),
    ("missing-prompt", CMPL, _j(max_tokens=4), 400, "prompt"),
    ("unknown-model", CMPL, _j(model="gpt-4", prompt="hi"), 404, "model"),
    ("max-tokens-negative", CMPL, _j(prompt="hi", max_tokens=-3), 400, "max_tokens"),
    ("max-tokens-beyond-context", CMPL, _j(prompt="hi", max_tokens=MAX_MODEL_LEN + 1), 400,
     "max_tokens"),
    ("prompt-longer-than-context", CMPL, _j(prompt="word " * (MAX_MODEL_LEN + 50),
                                            max_tokens=4), 400, "prompt"),
    ("prompt-ids-longer-than-context", CMPL, _j(prompt=[1] * MAX_MODEL_LEN, max_tokens=1), 400,
     "prompt"),
    ("token-id-out-of-vocab", CMPL, _j(prompt=[10**9], max_tokens=1), 400, "prompt"),
    ("empty-prompt-list", CMPL, _j(prompt=[]), 400, "prompt"),
    ("n-too-large", CMPL, _j(prompt="hi", n=1000), 400, "n"),
    ("n-zero", CMPL, _j(prompt="hi", n=0), 400, "n"),
    ("too-many-choices", CMPL, _j(prompt=["a"] * 10, n=30), 400, "n"),
    ("top-p-zero", CMPL, _j(prompt="hi", top_p=0), 400, "top_p"),
    ("negative-seed", CMPL, _j(prompt="hi", seed=-1), 400, "seed"),
    ("logprobs-too-many", CMPL, _j(prompt="hi", logprobs=50), 400, "logprobs"),
    ("prompt-logprobs-too-many", CMPL, _j(prompt="hi", prompt_logprobs=21), 400,
     "prompt_logprobs"),
    ("message-without-content", CHAT, _j(messages=[{"role": "user"}]), 400, "messages"),
    ("message-null-content", CHAT, _j(messages=[{"role": "user", "content": None}]), 400,
     "messages"),
    ("no-messages", CHAT, _j(messages=[]), 400, "messages"),
    ("messages-string", CHAT, _j(messages="hi"), 400, "messages"),
    ("unknown-role", CHAT, _j(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages"),
    ("image-part", CHAT, _j(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages"),
    ("chat-prompt-longer-than-context", CHAT, _j(messages=[
        {"role": "user", "content": "word " * (MAX_MODEL_LEN + 50)}]), 400, "messages"),
    ("chat-max-tokens-beyond-context", CHAT, _j(messages=USER, max_tokens=10**6), 400,
     "max_tokens"),
    ("top-logprobs-without-logprobs", CHAT, _j(messages=USER, top_logprobs=2), 400,
     "top_logprobs"),
    ("chat-unknown-model", CHAT, _j(model="nope", messages=USER), 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error(server, path, body, status, param):
    headers = {**server.headers, "Content-Type": "application/json"}
    r = httpx.post(server.url + path, content=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_server_survives_bad_input_and_frees_blocks(server):
    for _, path, body, _, _ in BAD:
        httpx.post(server.url + path, content=body, headers=server.headers, timeout=60)
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    server.wait_idle(timeout=60)
    out = server.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_openai_client_sees_bad_request(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=USER)


def _aborted(server) -> float:
    return server.metric("samebits_engine_requests_finished_total", reason="abort")


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    before = _aborted(server)
    body = dict(model=MODEL, prompt="Tell me a long story.", max_tokens=400, ignore_eos=True,
                stream=True, n=2)
    with httpx.stream("POST", server.url + CMPL, json=body, headers=server.headers,
                      timeout=120) as r:
        assert r.status_code == 200
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines >= 3:
                break
    server.wait_idle(timeout=60)
    assert _aborted(server) >= before + 2


def test_client_disconnect_while_waiting_aborts_non_streaming(server):
    before = _aborted(server)
    body = dict(model=MODEL, messages=USER, max_tokens=400, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + CHAT, json=body, headers=server.headers, timeout=3)
    deadline = time.monotonic() + 60
    while _aborted(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _aborted(server) >= before + 1
    server.wait_idle(timeout=60)


def test_api_key_guards_v1_but_not_health(server):
    body = dict(model=MODEL, prompt="hi", max_tokens=1)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
        r = httpx.post(server.url + CMPL, json=body, headers=headers, timeout=30)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0
                      ).models.list()
    assert server.client().models.list().data[0].id == MODEL


def test_no_key_needed_without_api_key(standard_server):
    r = httpx.get(f"{standard_server.url}/v1/models", timeout=30)
    assert r.status_code == 200
