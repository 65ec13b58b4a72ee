"""Sampling controls and strict request parsing through the real openai SDK: an unknown field is a
400 naming it, no-op fields are accepted, penalties / logit_bias / min_tokens / best_of change the
answer as offline, and a controlled request's bits do not depend on its concurrent neighbours."""

from __future__ import annotations

import asyncio

import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The cat sat on the mat. The cat was happy because the cat"
CHAT = [{"role": "user", "content": "Name a colour and say why you like it."}]
GREEDY = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0.0)


def _text(client, **kw) -> str:
    return client.completions.create(**{**GREEDY, **kw}).choices[0].text


@pytest.mark.parametrize("field", ["suffix", "guided_nonsense", "frequency_penalties"])
def test_unknown_completion_field_is_a_400_naming_it(server, field):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(**GREEDY, extra_body={field: 1})
    assert e.value.body["param"] == field and field in e.value.body["message"]


def test_unknown_chat_field_and_unknown_message_field_are_400s_naming_them(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                       extra_body={"mirostat": 2})
    assert e.value.body["param"] == "mirostat"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hi", "weight": 0.5}])
    assert e.value.body["param"] == "messages" and "weight" in e.value.body["message"]


def test_no_op_fields_are_accepted_and_change_nothing(server):
    client = server.client()
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0.8, seed=3, logprobs=True)
    plain = client.chat.completions.create(**kw).choices[0]
    noted = client.chat.completions.create(
        **kw, user="u-1", metadata={"run": "a"}, store=False, service_tier="auto",
        parallel_tool_calls=True).choices[0]
    assert noted.model_dump() == plain.model_dump()
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}) if c.choices)
    assert streamed == plain.message.content
    cmpl = client.completions.create(**GREEDY, user="u-2", extra_body={
        "metadata": {"k": "v"}, "store": False, "service_tier": "auto"})
    assert cmpl.choices[0].text == _text(client)


def test_penalties_and_logit_bias_through_the_sdk_change_the_answer(server):
    client = server.client()
    plain = _text(client)
    changed = {
        "presence": _text(client, presence_penalty=2.0),
        "frequency": _text(client, frequency_penalty=2.0),
        "bias": _text(client, logit_bias={"260": 8}),
        "repetition": _text(client, extra_body={"repetition_penalty": 1.3}),
    }
    assert [k for k, v in changed.items() if v == plain] == []


def test_min_tokens_and_stop_token_ids_through_the_sdk(server):
    client = server.client()
    stop = client.completions.create(**GREEDY, extra_body={"stop_token_ids": [436]}).choices[0]
    held = client.completions.create(**GREEDY, extra_body={"stop_token_ids": [436],
                                                           "min_tokens": 10}).choices[0]
    assert (stop.text, stop.finish_reason) == ("", "stop")
    assert held.finish_reason == "length" and len(held.text) > 10


def test_best_of_returns_the_most_likely_of_its_candidates(server):
    client = server.client()
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=21, logprobs=0)
    every = client.completions.create(**kw, n=3).choices
    best = client.completions.create(**kw, n=1, best_of=3).choices
    top = max(every, key=lambda c: (sum(c.logprobs.token_logprobs), -c.index))
    assert len(best) == 1 and best[0].index == 0
    assert (best[0].text, best[0].model_extra["seed"]) == (top.text, top.model_extra["seed"])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, n=1, best_of=2, stream=True)
    assert e.value.body["param"] == "best_of"


MIXED = [  # (kind, extra request fields): plain, biased and penalised neighbours
    ("plain", {}),
    ("sampled", dict(temperature=0.9, seed=7)),
    ("bias", dict(logit_bias={"260": 6, "436": -3})),
    ("presence", dict(presence_penalty=1.5, temperature=0.7, seed=8)),
    ("frequency", dict(frequency_penalty=1.2)),
    ("repetition", dict(extra_body={"repetition_penalty": 1.25})),
    ("all", dict(temperature=1.1, seed=9, logit_bias={"13": 2}, presence_penalty=-0.5,
                 frequency_penalty=0.5, extra_body={"repetition_penalty": 0.9, "min_tokens": 4})),
]


def _mixed_bits(server) -> tuple[list, list]:
    async def one(client, extra):
        c = (await client.completions.create(**{**GREEDY, "logprobs": 0, **extra})).choices[0]
        return c.text, c.logprobs.token_logprobs

    async def run():
        client = server.async_client()
        concurrent = await asyncio.gather(*(one(client, e) for _, e in MIXED * 2))
        alone = [await one(client, e) for _, e in MIXED]
        return concurrent, alone
    return asyncio.run(run())


def test_controlled_requests_same_bits_alone_and_beside_concurrent_mixed_neighbours(server):
    concurrent, alone = _mixed_bits(server)
    assert concurrent == alone * 2


def test_negative_control_standard_server_differs_under_concurrency(standard_server):
    concurrent, alone = _mixed_bits(standard_server)
    assert concurrent != alone * 2, "standard mode should show batch variance"
