"""The OpenAI surface: streaming equals non-streaming, n choices with seeds S + i, replayable
unseeded answers, the HTTP server equals the offline API, models / health / metrics."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from samebits import SamplingParams
from tests.server.conftest import MAX_MODEL_LEN

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Three facts about owls:"
CHAT = [{"role": "user", "content": "Name a colour and say why you like it."}]


def _stream_completion(client, **kw) -> dict[str, Any]:
    """Concatenate a completion stream of one choice into the non-streaming shape."""
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    finish = seed = None
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            for key in lp:
                lp[key] += getattr(c.logprobs, key) if c.logprobs else []
            finish = c.finish_reason or finish
            seed = c.model_extra["seed"]
    return {"text": text, "logprobs": lp, "finish_reason": finish, "seed": seed}


def _stream_chat(client, **kw) -> dict[str, Any]:
    text, content, finish, seed = "", [], None, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            content += [t.model_dump() for t in c.logprobs.content] if c.logprobs else []
            finish = c.finish_reason or finish
            seed = c.model_extra["seed"]
    return {"text": text, "content": content, "finish_reason": finish, "seed": seed}


@pytest.mark.parametrize("stop", [None, ["\n", " is"]])
def test_completion_stream_equals_non_stream(server, stop):
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.8, seed=5, logprobs=2,
              stop=stop)
    whole = client.completions.create(**kw).choices[0]
    streamed = _stream_completion(client, **kw)
    assert streamed == {"text": whole.text, "logprobs": whole.logprobs.model_dump(),
                        "finish_reason": whole.finish_reason, "seed": 5}


def test_chat_stream_equals_non_stream(server):
    client = server.client()
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0.8, seed=9,
              logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = _stream_chat(client, **kw)
    assert streamed == {"text": whole.message.content,
                        "content": [t.model_dump() for t in whole.logprobs.content],
                        "finish_reason": whole.finish_reason, "seed": 9}
    assert all(bytes(t["bytes"]).decode("utf-8", "replace") == t["token"]
               for t in streamed["content"])


def test_n4_with_seed_is_reproducible_and_choice_i_uses_seed_plus_i(server):
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=100, n=4,
              logprobs=1)
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.model_dump() for c in first.choices] == [c.model_dump() for c in second.choices]
    assert [c.model_extra["seed"] for c in first.choices] == [100, 101, 102, 103]
    assert first.model_extra["seed"] == 100
    assert len({c.text for c in first.choices}) > 1, "four samples should not all agree"
    single = client.completions.create(**{**kw, "n": 1, "seed": 102}).choices[0]
    assert single.model_dump() == {**first.choices[2].model_dump(), "index": 0}


def test_unseeded_answer_is_replayed_by_its_reported_seed(server):
    client = server.client()
    kw = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, n=2)
    drawn = client.chat.completions.create(**kw)
    seed = drawn.model_extra["seed"]
    assert [c.model_extra["seed"] for c in drawn.choices] == [seed, seed + 1]
    replay = client.chat.completions.create(**kw, seed=seed)
    assert [c.model_dump() for c in replay.choices] == [c.model_dump() for c in drawn.choices]


def test_every_response_carries_the_fingerprint(server):
    health = httpx.get(f"{server.url}/health", timeout=30).json()
    fp = health["system_fingerprint"]
    assert fp.startswith("fp_")
    client = server.client()
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.system_fingerprint == fp
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                                 stream=True))
    assert {c.system_fingerprint for c in chunks} == {fp}


def test_http_server_equals_offline_api(server, offline_llm):
    client = server.client()
    web = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.8,
                                    seed=77, logprobs=0, n=2).choices
    web_chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                              temperature=0.8, seed=78, logprobs=True
                                              ).choices[0]
    llm = offline_llm
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=77, n=2)
    offline = llm.generate(PROMPT, params)[0].outputs
    offline_chat = llm.chat(CHAT, SamplingParams(max_tokens=6, temperature=0.8, seed=78)
                            )[0].outputs[0]
    assert [(c.text, c.logprobs.token_logprobs, c.model_extra["seed"]) for c in web] == [
        (o.text, o.token_logprobs, o.seed) for o in offline]
    assert web_chat.message.content == offline_chat.text
    assert [t.logprob for t in web_chat.logprobs.content] == offline_chat.token_logprobs


def test_metrics(server, standard_server):
    client = server.client()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, seed=1)
    assert server.metric("samebits_batch_invariant") == 1
    assert standard_server.metric("samebits_batch_invariant") == 0
    assert server.metric("samebits_requests_total", status="200") >= 1
    assert server.metric("samebits_prompt_tokens_total") > 0
    assert server.metric("samebits_generation_tokens_total") >= 8
    assert server.metric("samebits_batch_size_count") > 0
    assert server.metric("samebits_time_to_first_token_seconds_count") >= 2
    assert server.metric("samebits_inter_token_latency_seconds_count") >= 6
    assert server.metric("samebits_kv_blocks_total") > 0
    server.wait_idle()
