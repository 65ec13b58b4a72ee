"""Forced tool calls with nested schemas: the ``required`` array schema keeps every function's local
``$ref`` resolvable (``$defs``, ``definitions``, ``#``, JSON pointers), xgrammar compiles it and it
accepts exactly the calls the functions' own schemas accept; and a call cut by max_tokens is
text, never a call."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel

from samebits.server.protocol_tools import FunctionDef, NamedFunction, NamedToolChoice, Tool
from samebits.server.tools import ToolStream, tool_plan

xgr = pytest.importorskip("xgrammar")


class City(BaseModel):
    name: Literal["Paris", "Rome"]


class Weather(BaseModel):
    city: City
    sunny: bool


TREE = {"type": "object", "required": ["v"], "properties": {  # recursive: refers to its root
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}}}
OLD = {"type": "object", "required": ["a", "b"], "definitions": {"N": {"type": "integer"}},
       "properties": {"a": {"$ref": "#/definitions/N"}, "b": {"$ref": "#/properties/a"}}}
FUNCTIONS = {"weather": Weather.model_json_schema(), "tree": TREE, "old": OLD, "bare": None}


def _tools() -> list[Tool]:
    return [Tool(type="function", function=FunctionDef(name=n, parameters=p))
            for n, p in FUNCTIONS.items()]


def _compiles(schema: dict) -> None:
    xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)


def test_required_schema_with_nested_refs_compiles_and_accepts_the_functions_calls():
    schema = tool_plan(_tools(), "required").constraint.json
    _compiles(schema)
    calls = [{"name": "weather", "arguments": {"city": {"name": "Rome"}, "sunny": True}},
             {"name": "tree", "arguments": {"v": 1, "kids": [{"v": 2, "kids": []}]}},
             {"name": "old", "arguments": {"a": 1, "b": 2}},
             {"name": "bare", "arguments": {}}]
    jsonschema.validate(calls, schema)
    for bad in ({"name": "weather", "arguments": {"city": {"name": "Oslo"}, "sunny": True}},
                {"name": "tree", "arguments": {"v": 1, "kids": [{"kids": []}]}},
                {"name": "old", "arguments": {"a": 1, "b": "x"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([bad], schema)


def test_negative_control_functions_inlined_as_they_are_do_not_compile():
    """What the re-rooting avoids: a function's ``#/$defs/...`` refs inside the array schema
    point at a root that has no ``$defs``."""
    params = Weather.model_json_schema()
    inlined = {"type": "array", "items": {"anyOf": [{"type": "object", "properties": {
        "name": {"const": "weather"}, "arguments": params}}]}}
    with pytest.raises(RuntimeError, match=r"\$defs"):
        _compiles(inlined)


def test_named_choice_constrains_to_the_functions_own_schema():
    choice = NamedToolChoice(type="function", function=NamedFunction(name="weather"))
    plan = tool_plan(_tools(), choice)
    assert plan.constraint.json == Weather.model_json_schema()
    _compiles(plan.constraint.json)


@pytest.mark.parametrize("mode", ["required", "auto"])
def test_a_cut_call_is_text_whole_and_streamed(mode):
    plan = tool_plan(_tools(), mode)
    text = ('[{"name": "weather", "arguments": {"city": {"name": "Ro' if mode == "required"
            else 'Sure. <tool_call>{"name": "weather", "arguments": {"sunny": tr')
    assert ToolStream(plan).parse(text, cut=True) == (text, [])
    stream = ToolStream(plan)
    content, calls = stream.push(text)
    rest, more = stream.finish(cut=True)
    assert (content or "") + (rest or "") == text and calls == more == []
    whole = text + ('me"}, "sunny": true}}]' if mode == "required" else 'ue}}</tool_call>')
    assert len(ToolStream(plan).parse(whole)[1]) == 1  # complete: a call
