"""``POST /v1/responses`` through the openai SDK's own helpers (``responses.create``,
``responses.stream``, ``responses.parse``) against ``samebits serve``: the answer is the chat
endpoint's, bit for bit; the stream's events are OpenAI's and add up to the whole response;
structured output, function tools and a tool-result turn work; a cut answer is ``incomplete``
with no tool call; what samebits does not do is a 400 that says so."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from samebits.server.output_hash import HEADER

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "Answer in one short sentence."
QUESTION = "Why is the sky blue?"
SAMPLED = dict(model=MODEL, max_output_tokens=6, temperature=0.8, extra_body={"seed": 5})
TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}}
ASK = "What is the weather in Paris?"


class City(BaseModel):
    name: Literal["Paris", "Rome", "Oslo"]


class Weather(BaseModel):  # nested: City is a $defs entry of its schema
    city: City
    sunny: bool


def _chat(server, **kw):
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=120,
                   json={**dict(model=MODEL, max_tokens=6, temperature=0.8, seed=5, logprobs=True,
                                messages=[{"role": "system", "content": INSTRUCTIONS},
                                          {"role": "user", "content": QUESTION}]), **kw})
    assert r.status_code == 200, r.text
    return r


def test_create_answers_as_chat_bit_for_bit(server):
    client = server.client()
    raw = client.responses.with_raw_response.create(
        input=QUESTION, instructions=INSTRUCTIONS, include=["message.output_text.logprobs"],
        **SAMPLED)
    out = raw.parse()
    chat = _chat(server)
    body = chat.json()
    assert out.output_text == body["choices"][0]["message"]["content"]
    assert [t.logprob for t in out.output[0].content[0].logprobs] == [
        t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]
    assert raw.headers[HEADER] == chat.headers[HEADER]
    assert out.model_extra["seed"] == 5 and out.object == "response" and out.id.startswith("resp")
    assert (out.usage.input_tokens, out.usage.output_tokens) == (
        body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.model_extra["system_fingerprint"] == body["system_fingerprint"]


def test_vllm_sampling_extensions_act_as_on_chat(server):
    """vLLM's extensions of the Responses body (what guidellm's responses mode sends: stop,
    ignore_eos) act as the same chat fields do."""
    client = server.client()
    greedy = dict(model=MODEL, max_output_tokens=12, temperature=0.0)
    free = client.responses.create(input=QUESTION, instructions=INSTRUCTIONS, **greedy)
    stop = free.output_text.split()[2]  # a word the answer reaches
    for extra in ({"stop": [stop]}, {"stop": stop, "include_stop_str_in_output": True},
                  {"logit_bias": {"28": 100.0}}, {"skip_special_tokens": False},
                  {"ignore_eos": True, "top_k": 5, "repetition_penalty": 1.1}):
        out = client.responses.create(input=QUESTION, instructions=INSTRUCTIONS, **greedy,
                                      extra_body=extra)
        chat = _chat(server, max_tokens=12, temperature=0.0, **extra).json()["choices"][0]
        assert out.output_text == chat["message"]["content"], extra
        assert "logit_bias" not in extra or out.output_text != free.output_text  # it acts
    assert out.usage.output_tokens == 12
    bad = httpx.post(f"{server.url}/v1/responses", headers=server.headers, timeout=60,
                     json=dict(model=MODEL, input="hi", logit_bias={"x": 1}))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


def test_stream_sends_openais_events_and_adds_up_to_the_whole_response(server):
    client = server.client()
    whole = client.responses.create(input=QUESTION, instructions=INSTRUCTIONS, **SAMPLED)
    with client.responses.stream(input=QUESTION, instructions=INSTRUCTIONS, **SAMPLED) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.model_extra["output_hash"] == _chat(server).headers[HEADER]


@pytest.mark.slow
def test_parse_returns_the_nested_model(server):
    out = server.client().responses.parse(model=MODEL, input=ASK, text_format=Weather,
                                          max_output_tokens=40, temperature=0)
    assert out.status == "completed" and isinstance(out.output_parsed, Weather)


@pytest.mark.slow
def test_function_tools_required_named_and_a_tool_result_turn(server):
    client = server.client()
    nested = {"type": "function", "name": "report", "strict": True,
              "parameters": Weather.model_json_schema()}
    out = client.responses.create(model=MODEL, input=ASK, tools=[TOOL, nested],
                                  tool_choice="required", max_output_tokens=40, temperature=0)
    calls = [o for o in out.output if o.type == "function_call"]
    assert calls and out.status == "completed"
    schemas = {"get_weather": TOOL["parameters"], "report": nested["parameters"]}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    with client.responses.stream(model=MODEL, input=ASK, tools=[TOOL], max_output_tokens=20,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 temperature=0) as s:
        types = [e.type for e in s]
        final = s.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert "response.function_call_arguments.done" in types
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome", "Oslo")
    turn = [{"role": "user", "content": ASK},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}]
    reply = client.responses.create(model=MODEL, input=turn, tools=[TOOL], tool_choice="none",
                                    max_output_tokens=6, temperature=0)
    assert reply.output[0].type == "message" and reply.output_text


def test_a_cut_tool_call_is_an_incomplete_message(server):
    out = server.client().responses.create(model=MODEL, input=ASK, tools=[TOOL],
                                           tool_choice="required", max_output_tokens=3,
                                           temperature=0)
    assert out.status == "incomplete" and [o.type for o in out.output] == ["message"]
    assert out.output_text.startswith("[")


BAD = [  # (body, param, words in the message)
    (dict(input="hi", previous_response_id="resp_1"), "previous_response_id", "stores no"),
    (dict(input="hi", reasoning={"effort": "low"}), "reasoning", "does not reason"),
    (dict(input="hi", tools=[{"type": "web_search"}]), "tools", "built-in tools"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input", "text only"),
    (dict(input=[{"type": "reasoning", "summary": []}]), "input", "not supported"),
    (dict(input="hi", truncation="auto"), "truncation", "disabled"),
    (dict(input="hi", stream_options={}), "stream_options", "stream"),
    (dict(input="hi", top_logprobs=21), "top_logprobs", "--max-logprobs"),
    (dict(input="hi", max_output_tokens=0), "max_output_tokens",
     "max_output_tokens must be a positive integer"),
    (dict(input="hi", conversation="conv_1"), "conversation", "unknown field"),
    (dict(input="hi", text={"format": {"type": "json_schema", "name": "x"}}), "text", "schema"),
    (dict(input="hi", model="gpt-4o"), "model", "does not exist"),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_what_samebits_does_not_do_is_a_400_naming_it(server, body, param, words):
    r = httpx.post(f"{server.url}/v1/responses", json=body, headers=server.headers, timeout=30)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_openai_sdk_sees_the_stateless_refusal(server):
    with pytest.raises(openai.BadRequestError, match="stores no responses"):
        server.client().responses.create(model=MODEL, input="hi", previous_response_id="resp_1")


def test_openapi_documents_the_responses_body_beside_the_chat_one(server):
    spec = httpx.get(f"{server.url}/openapi.json", headers=server.headers, timeout=30).json()
    schemas = spec["components"]["schemas"]
    body = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/ResponsesRequest"
    assert {"input", "instructions", "text", "tools"} <= set(schemas["ResponsesRequest"][
        "properties"])
    assert "continuous_usage_stats" in schemas["StreamOptions"]["properties"]  # chat's, intact
    assert "/v1/models/{model_id}" in spec["paths"]
