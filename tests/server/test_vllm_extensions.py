"""vLLM's request extensions through the real openai SDK against ``samebits serve``: each one does
what vLLM's does (continuous usage, token ids, masks, truncation, streamed echo, chat echo /
continue_final_message / prompt_logprobs, text parts joined as vLLM joins them, legacy functions,
nested tool schemas, cut tool calls streamed or not), the wire errors name their field, and a
masked request's bits do not depend on its neighbours (negative control: the standard server)."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from samebits.sampling_params import SamplingParams
from samebits.server.protocol_completion import CompletionRequest

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The cat sat on the mat. The cat was happy because the cat"
GREEDY = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0)
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class City(BaseModel):
    name: Literal["Paris", "Rome", "Oslo"]


class Weather(BaseModel):  # pydantic puts City under $defs and refers to it with $ref
    city: City
    sunny: bool


WEATHER_TOOL = openai.pydantic_function_tool(Weather, name="report_weather")


def _detokenize(server, ids: list[int]) -> str:
    return httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=server.headers,
                      timeout=30).json()["prompt"]


def _stream_chunks(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      headers=server.headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]


def test_continuous_usage_stats_put_each_choices_usage_on_every_chunk(server):
    body = dict(GREEDY, stream_options={"include_usage": True, "continuous_usage_stats": True})
    whole = server.client().completions.create(**GREEDY)
    chunks = _stream_chunks(server, "/v1/completions", body)
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    assert [u["completion_tokens"] for u in usages[:-1]] == list(range(1, 7))
    assert {u["prompt_tokens"] for u in usages} == {whole.usage.prompt_tokens}
    assert usages[-1]["completion_tokens"] == whole.usage.completion_tokens
    chat = dict(model=MODEL, messages=ASK, max_tokens=4, temperature=0)
    usages = [c["usage"]["completion_tokens"] for c in _stream_chunks(
        server, "/v1/chat/completions", dict(chat, stream_options={
            "include_usage": True, "continuous_usage_stats": True}))]
    assert usages == [0, 1, 2, 3, 4, 4]  # the role chunk, the tokens, the usage chunk


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", GREEDY),
    ("/v1/chat/completions", dict(model=MODEL, messages=ASK, max_tokens=4, temperature=0))])
def test_continuous_usage_stats_without_include_usage_adds_no_usage(server, path, body):
    """As vLLM: continuous_usage_stats only acts with include_usage (null counts as false)."""
    for options in ({"continuous_usage_stats": True},
                    {"include_usage": None, "continuous_usage_stats": True}):
        chunks = _stream_chunks(server, path, dict(body, stream_options=options))
        assert chunks and all(c.get("usage") is None for c in chunks)


def test_return_token_ids_whole_and_streamed(server):
    client = server.client()
    whole = client.completions.create(**GREEDY, extra_body={"return_token_ids": True}).choices[0]
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT},
                            headers=server.headers, timeout=30).json()["tokens"]
    assert whole.model_extra["prompt_token_ids"] == prompt_ids
    tok = client.completions.create(model=MODEL, prompt=prompt_ids + whole.model_extra[
        "token_ids"], max_tokens=1, temperature=0, echo=True).choices[0]
    assert tok.text.startswith(PROMPT + whole.text)
    chunks = _stream_chunks(server, "/v1/completions", dict(GREEDY, return_token_ids=True))
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole.model_extra[
        "token_ids"]
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                          temperature=0, extra_body={"return_token_ids": True})
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens == 4
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):
    """vLLM's ``return_tokens_as_token_ids``: "token_id:<id>" for every logprob token, whole and
    streamed, completions and chat; the ids are the output's token ids."""
    client = server.client()
    ids = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    whole = client.completions.create(**GREEDY, logprobs=2, extra_body=ids).choices[0]
    tokens = whole.model_extra["token_ids"]
    assert whole.logprobs.tokens == [f"token_id:{t}" for t in tokens]
    assert all(k.startswith("token_id:") for top in whole.logprobs.top_logprobs for k in top)
    chunks = _stream_chunks(server, "/v1/completions", dict(GREEDY, logprobs=2, **ids))
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == \
        whole.logprobs.tokens
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=1, extra_body=ids)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [
        f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert bytes(content[0].bytes).decode() == content[0].token


def test_allowed_token_ids_and_bad_words_mask_the_answer(server):
    client = server.client()
    plain = client.completions.create(**GREEDY, extra_body={"return_token_ids": True})
    ids = plain.choices[0].model_extra["token_ids"]
    allowed = [13, 30, 28, ids[1]]  # not the plain answer's first token
    masked = client.completions.create(**GREEDY, extra_body={
        "allowed_token_ids": allowed, "return_token_ids": True}).choices[0]
    assert set(masked.model_extra["token_ids"]) <= set(allowed)
    assert masked.model_extra["token_ids"] != ids
    first_word = plain.choices[0].text.split()[0]  # "was"
    banned = client.completions.create(**GREEDY, extra_body={"bad_words": [first_word]})
    text = banned.choices[0].text
    assert text != plain.choices[0].text and first_word not in text.split()


def test_truncate_prompt_tokens_keeps_the_last_k_tokens(server):
    client = server.client()
    cut = client.completions.create(**GREEDY, extra_body={"truncate_prompt_tokens": 5,
                                                          "return_token_ids": True}).choices[0]
    full = client.completions.create(**GREEDY, extra_body={"return_token_ids": True}).choices[0]
    assert cut.model_extra["prompt_token_ids"] == full.model_extra["prompt_token_ids"][-5:]
    by_ids = client.completions.create(**{**GREEDY, "prompt": cut.model_extra[
        "prompt_token_ids"]}).choices[0]
    assert cut.text == by_ids.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**GREEDY, extra_body={"truncate_prompt_tokens": 10**6})
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_text_options_reach_the_output_whole_and_streamed(server):
    client = server.client()
    special = dict(GREEDY, max_tokens=2, extra_body={"allowed_token_ids": [1]})  # <|im_start|>
    assert client.completions.create(**special).choices[0].text == ""
    kept = dict(GREEDY, max_tokens=2, extra_body={"allowed_token_ids": [1],
                                                  "skip_special_tokens": False})
    assert client.completions.create(**kept).choices[0].text == "<|im_start|>" * 2
    stop = dict(GREEDY, stop=[" cat"], max_tokens=12)
    cut = client.completions.create(**stop).choices[0]
    kept_stop = client.completions.create(**stop, extra_body={
        "include_stop_str_in_output": True}).choices[0]
    assert cut.finish_reason == kept_stop.finish_reason == "stop"
    assert kept_stop.text == cut.text + " cat"
    streamed = _stream_chunks(server, "/v1/completions", dict(
        model=MODEL, prompt=PROMPT, temperature=0.0, stop=[" cat"], max_tokens=12,
        include_stop_str_in_output=True))
    assert "".join(c["choices"][0]["text"] for c in streamed) == kept_stop.text


def test_echo_streams_the_prompt_first(server):
    whole = server.client().completions.create(**GREEDY, echo=True).choices[0]
    chunks = _stream_chunks(server, "/v1/completions", dict(GREEDY, echo=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.text
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)


def test_chat_continue_final_message_echo_and_prompt_logprobs(server):
    client = server.client()
    history = [{"role": "user", "content": "Count to five."},
               {"role": "assistant", "content": "One, two,"}]
    body = {"add_generation_prompt": False, "continue_final_message": True,
            "return_token_ids": True, "prompt_logprobs": 0}
    out = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4,
                                         temperature=0, extra_body=body)
    echoed = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4,
                                            temperature=0, extra_body={**body, "echo": True})
    assert echoed.choices[0].message.content == "One, two," + out.choices[0].message.content
    prompt = out.model_extra["prompt_token_ids"]
    assert _detokenize(server, prompt).endswith("<|im_start|>assistant\nOne, two,")  # left open
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 0}).choices[0]
    assert out.model_extra["prompt_logprobs"] == scored.model_extra["prompt_logprobs"]
    streamed = _stream_chunks(server, "/v1/chat/completions", dict(
        model=MODEL, messages=history, max_tokens=4, temperature=0,
        add_generation_prompt=False, continue_final_message=True, echo=True))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed
                   if c["choices"]) == echoed.choices[0].message.content


def test_text_parts_are_joined_with_newlines_as_vllm_and_offline_chat(server, offline_llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three"},
                                          {"type": "text", "text": "colors."}]}]
    joined = [{"role": "user", "content": "Name three\ncolors."}]
    client = server.client()
    served = [client.chat.completions.create(
        model=MODEL, messages=m, max_tokens=1, temperature=0,
        extra_body={"return_token_ids": True}).model_extra["prompt_token_ids"]
        for m in (parts, joined)]
    offline = offline_llm.chat(parts, SamplingParams(max_tokens=1, temperature=0),
                               use_tqdm=False)[0].prompt_token_ids
    assert served[0] == served[1] == offline
    assert "Name three\ncolors." in _detokenize(server, served[0])


@pytest.mark.slow
def test_nested_tool_schemas_with_defs_in_required_named_and_response_format(server):
    client = server.client()
    schema = WEATHER_TOOL["function"]["parameters"]
    assert "$defs" in schema
    for choice in ("required", {"type": "function", "function": {"name": "report_weather"}}):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL],
                                             tool_choice=choice, max_tokens=40, temperature=0)
        call = out.choices[0].message.tool_calls[0]
        assert out.choices[0].finish_reason == "tool_calls" and call.function.name == \
            "report_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema)
    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=40,
                                                temperature=0, response_format=Weather)
    assert isinstance(parsed.choices[0].message.parsed, Weather)


@pytest.mark.parametrize("choice", ["required", "auto", "named"])
def test_a_tool_call_cut_by_max_tokens_is_returned_as_text(server, choice):
    tool_choice = {"required": "required", "auto": "auto",
                   "named": {"type": "function", "function": {"name": "report_weather"}}}[choice]
    messages = ASK if choice != "auto" else [{"role": "user", "content": (
        'Reply exactly: <tool_call>{"name": "report_weather", "arguments": {"city": ')}]
    out = server.client().chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice=tool_choice,
        max_tokens=4, temperature=0, extra_body={"return_token_ids": True}).choices[0]
    assert out.finish_reason == "length" and out.message.tool_calls is None
    assert out.message.content == _detokenize(server, out.model_extra["token_ids"])
    streamed = _stream_chunks(server, "/v1/chat/completions", dict(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], tool_choice=tool_choice,
        max_tokens=4, temperature=0))
    deltas = [c["choices"][0]["delta"] for c in streamed]
    assert not any(d.get("tool_calls") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == out.message.content
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_legacy_functions_run_as_tools_and_answer_in_the_legacy_shape(server):
    out = server.client().chat.completions.create(
        model=MODEL, messages=ASK, functions=[WEATHER_TOOL["function"]],
        function_call={"name": "report_weather"}, max_tokens=40, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.function_call.name == "report_weather"
    Weather.model_validate_json(choice.message.function_call.arguments)


BAD = [  # (path, body, param, words in the message)
    ("/v1/completions", dict(prompt="hi", stream_options={"include_usage": True}),
     "stream_options", "stream"),
    ("/v1/completions", dict(prompt="hi", logit_bias={"abc": 1}), "logit_bias", "'abc'"),
    ("/v1/chat/completions", dict(messages=ASK, logit_bias={"bad1": 1, "7": 1, "bad2": 2}),
     "logit_bias", "keys 'bad1', 'bad2' are not token ids"),
    ("/v1/completions", dict(prompt="hi", logit_bias={"5": 500}), "logit_bias", "[-100, 100]"),
    ("/v1/completions", dict(prompt="hi", allowed_token_ids=[10**9]), "allowed_token_ids",
     "vocabulary"),
    ("/v1/completions", dict(prompt="hi", bad_words=[""]), "bad_words", "bad_words"),
    ("/v1/completions", dict(prompt="hi", truncate_prompt_tokens=0), "truncate_prompt_tokens",
     "truncate_prompt_tokens"),
    ("/v1/completions", dict(prompt="hi", logprobs=21), "logprobs", "--max-logprobs"),
    ("/v1/completions", dict(prompt="hi", mirostat_tau=1), "mirostat_tau", "unknown field"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]), "messages",
     "text only"),
    ("/v1/chat/completions", dict(messages=ASK, continue_final_message=True),
     "continue_final_message", "add_generation_prompt"),
    ("/v1/chat/completions", dict(messages=ASK, tools=[WEATHER_TOOL],
                                  functions=[WEATHER_TOOL["function"]]), "functions", "tools"),
    ("/v1/chat/completions", dict(messages=ASK, max_completion_tokens=0),
     "max_completion_tokens", "max_completion_tokens must be a positive integer"),
    ("/v1/chat/completions", dict(messages=ASK, max_tokens=-1), "max_tokens",
     "max_tokens must be a positive integer"),
    ("/v1/chat/completions", dict(messages=ASK, max_completion_tokens=10**6),
     "max_completion_tokens", "exceeds this model's context"),
    ("/v1/completions", dict(prompt="hi", max_tokens=-3), "max_tokens",
     "max_tokens must be a positive integer"),
    ("/v1/completions", dict(prompt="hi", temperature=-0.5), "temperature", ">= 0"),
]


@pytest.mark.parametrize("path,body,param,words", BAD, ids=[f"{b[2]}-{i}" for i, b in
                                                            enumerate(BAD)])
def test_wire_errors_are_400s_naming_the_field(server, path, body, param, words):
    r = httpx.post(server.url + path, json={"max_tokens": 2, **body}, headers=server.headers,
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_wire_fields_map_onto_sampling_params_of_the_same_names():
    req = CompletionRequest.model_validate_json(json.dumps(dict(
        prompt="x", include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False, truncate_prompt_tokens=7, allowed_token_ids=[3],
        bad_words=["no"], seed=4, top_k=5)))
    p = req.to_sampling_params(16, None)
    assert (p.include_stop_str_in_output, p.skip_special_tokens, p.spaces_between_special_tokens,
            p.truncate_prompt_tokens, p.allowed_token_ids, p.bad_words, p.seed, p.top_k) == (
        True, False, False, 7, [3], ["no"], 4, 5)


MIXED = [  # extra fields of each request: masked, plain and penalised neighbours
    {},
    {"allowed_token_ids": [13, 30, 28, 5587, 3047]},
    {"bad_words": ["was", "happy"]},
    {"temperature": 0.9, "seed": 11, "bad_words": ["the cat"]},
    {"temperature": 0.8, "seed": 12, "allowed_token_ids": list(range(200, 3000))},
    {"frequency_penalty": 1.0, "bad_words": ["mat"]},
    {"temperature": 1.0, "seed": 13},
]


def _mixed_bits(server) -> tuple[list, list]:
    async def one(client, extra):
        c = (await client.completions.create(**{**GREEDY, "logprobs": 0},
                                             extra_body=extra)).choices[0]
        return c.text, c.logprobs.token_logprobs

    async def run():
        client = server.async_client()
        concurrent = await asyncio.gather(*(one(client, e) for e in MIXED * 2))
        alone = [await one(client, e) for e in MIXED]
        return concurrent, alone
    return asyncio.run(run())


def test_masked_requests_same_bits_alone_and_beside_concurrent_neighbours(server):
    concurrent, alone = _mixed_bits(server)
    assert concurrent == alone * 2


def test_negative_control_masked_requests_differ_on_the_standard_server(standard_server):
    concurrent, alone = _mixed_bits(standard_server)
    assert concurrent != alone * 2, "standard mode should show batch variance"
