"""Structured output and tool calling through the real openai SDK against ``samebits serve``:
constrained outputs satisfy their constraint on both endpoints, forced tool calls come back in
OpenAI's shape (whole and streamed), a tool-call history round-trips, bad constraints are 400s
naming their field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"
CITY_SCHEMA = {"type": "object",
               "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                              "sunny": {"type": "boolean"}},
               "required": ["city", "sunny"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_json_schema_response_format_validates(server):
    out = server.client().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=24, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "weather", "schema": CITY_SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), CITY_SCHEMA)
    assert out.choices[0].finish_reason == "stop"


def test_json_object_response_format_parses_as_an_object(server):
    out = server.client().chat.completions.create(
        model=MODEL, max_tokens=48, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true} only.'}])
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_completions_regex_and_guided_choice_alias(server):
    client = server.client()
    regex = client.completions.create(model=MODEL, prompt="Call extension", max_tokens=10,
                                      temperature=0.7, seed=3,
                                      extra_body={"structured_outputs": {"regex": r"\d{3}-\d{2}"}})
    text = regex.choices[0].text
    assert len(text) == 6 and text[3] == "-" and text.replace("-", "").isdigit()
    choice = client.completions.create(model=MODEL, prompt="Is the sky green? Answer:",
                                       max_tokens=5, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"


def test_named_tool_choice_returns_a_parseable_call_then_history_round_trips(server):
    client = server.client()
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                         tool_choice=NAMED, max_tokens=16, temperature=0)
    choice = out.choices[0]
    call = choice.message.tool_calls[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
    history = ASK + [choice.message.model_dump(), {"role": "tool", "tool_call_id": call.id,
                                                   "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(server, choice):
    client = server.client()
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=24, temperature=0,
              tool_choice=NAMED if choice == "named" else choice)
    whole = client.chat.completions.create(**kw).choices[0]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for d in c.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert list(calls.values()) == [{"name": c.function.name, "arguments": c.function.arguments}
                                    for c in whole.message.tool_calls]


@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs")])
def test_invalid_constraint_is_a_400_naming_the_field(server, body, field):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                                extra_body=body)
    assert e.value.body["param"] == field and field in e.value.body["message"]


def test_chat_template_kwargs_are_accepted_but_may_not_replace_messages(server):
    client = server.client()
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0,
                                        extra_body={"chat_template_kwargs": {"unused": 1}})
    assert ok.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"] == "chat_template_kwargs"
