"""Tools on the wire: function definitions, ``tool_choice``, and the calls a reply makes (whole,
and as stream deltas). The logic: samebits.server.tools."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from samebits.server.protocol import _Request


class FunctionDef(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Request):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
