"""Tool calling on chat: what ``tool_choice`` asks for, and tool calls out of generated text.

``tool_choice`` (default ``auto`` with tools, ``none`` without):
- ``none``: plain text; the tools are still shown to the model (as vLLM does by default).
- a named function: the output is constrained (grammar) to a JSON object valid against that
  function's ``parameters``, and becomes the arguments of one call to it.
- ``required``: the output is constrained to a JSON array of one or more
  ``{"name": ..., "arguments": {...}}`` objects naming the given functions. Each function's schema
  moves under the array schema's ``$defs`` with its local ``$ref`` s (``#/$defs/...``, ``#``)
  re-rooted, so nested models (pydantic's ``$defs``) keep resolving.
- ``auto``: unconstrained; Hermes/Qwen ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  blocks in the text become calls (text before them stays the content). Text that does not parse
  stays content.
A choice with calls finishes with ``tool_calls``. A choice cut by ``max_tokens`` (``length``) has no
calls: its raw text is the content (a call cut short has no valid arguments). Streaming sends the
content as it comes and each call when the choice is complete (one delta with its index, id, name
and arguments), or the held text as content when the choice was cut -- in every mode, the named
one included -- so a stream's deltas add up to the non-streamed message.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from samebits.server.errors import APIError
from samebits.server.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    Tool,
    ToolCall,
)
from samebits.structured_outputs import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the named function
    constraint: StructuredOutputsParams | None = None


def tool_plan(tool_list: list[Tool], tool_choice: str | NamedToolChoice | None) -> ToolPlan:
    """The request's tool mode; a choice that names no given tool is a 400 naming tool_choice."""
    tools = {t.function.name: t.function for t in tool_list}
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan("none")
    if not tools:
        raise APIError(400, "tool_choice: needs tools", param="tool_choice")
    if choice == "auto":
        return ToolPlan("auto")
    if choice == "required":
        return ToolPlan("required", None, StructuredOutputsParams(json=_calls_schema(tools)))
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in tools:
        raise APIError(400, f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    return ToolPlan("named", name, StructuredOutputsParams(json=_schema(tools[name])))


def _schema(function: Any) -> dict[str, Any]:
    return function.parameters or {"type": "object", "properties": {}}


def _calls_schema(tools: dict[str, Any]) -> dict[str, Any]:
    """A JSON array of one or more calls; function i's schema is ``$defs/tool_i`` of it."""
    defs, calls = {}, []
    for i, (name, function) in enumerate(tools.items()):
        key = f"tool_{i}"
        defs[key] = _rerooted(_schema(function), f"#/$defs/{key}")
        calls.append({"type": "object", "properties": {"name": {"const": name},
                                                       "arguments": {"$ref": f"#/$defs/{key}"}},
                      "required": ["name", "arguments"]})
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": defs}


def _rerooted(node: Any, root: str) -> Any:
    """``node`` with every local ``$ref`` (``#`` or ``#/...``) pointing below ``root`` instead."""
    if isinstance(node, list):
        return [_rerooted(x, root) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rerooted(v, root) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolStream:
    """One choice's text -> (content delta, tool-call deltas), chunk by chunk (``push``), then
    ``finish``. ``parse`` does both at once for a whole text."""

    plan: ToolPlan
    held: str = ""  # text not yet sent: a possible start of a call, or the calls themselves
    in_calls: bool = False
    calls: int = 0  # tool calls sent so far

    def push(self, text: str) -> tuple[str | None, list[DeltaToolCall]]:
        mode = self.plan.mode
        if mode == "none":
            return text, []
        self.held += text
        if mode in ("named", "required") or self.in_calls:
            return None, []
        at = self.held.find(OPEN)
        if at >= 0:
            content, self.held, self.in_calls = self.held[:at], self.held[at:], True
            return content or None, []
        keep = _partial_open(self.held)
        content, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return content or None, []

    def finish(self, cut: bool = False) -> tuple[str | None, list[DeltaToolCall]]:
        """The held text, as calls or as content (``cut``: the output was cut by max_tokens,
        so any call in it may be incomplete: content)."""
        if self.plan.mode == "none" or not self.held:
            return None, []
        held, self.held = self.held, ""
        found = None if cut else self._found(held)
        if found is None:
            return held, []  # cut short, or not calls after all: it was content
        deltas = [DeltaToolCall(index=self.calls + i, id=new_call_id(), type="function",
                                function=DeltaFunctionCall(name=n, arguments=a))
                  for i, (n, a) in enumerate(found)]
        self.calls += len(deltas)
        return None, deltas

    def _found(self, held: str) -> list[tuple[str, str]] | None:
        """The calls (name, arguments) in a complete choice's held text; None: not calls. A
        named call's arguments are the text itself (the grammar made it that function's JSON)."""
        if self.plan.mode == "named":
            return [(self.plan.name or "", held)]
        return _parse_required(held) if self.plan.mode == "required" else _parse_tagged(held)

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """A whole text -> (content, tool calls); a ``cut`` text (max_tokens) has no calls."""
        content, deltas = self.push(text)
        rest, more = self.finish(cut)
        joined = (content or "") + (rest or "")
        calls = [ToolCall(id=d.id or new_call_id(), function=FunctionCall(
            name=d.function.name or "", arguments=d.function.arguments or ""))
            for d in deltas + more]
        if calls:  # the text around the calls, if any, is the content
            return joined.strip() or None, calls
        return joined, []


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def _partial_open(text: str) -> int:
    """Length of the longest suffix of ``text`` that could begin ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _call(obj: Any) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _parse_tagged(text: str) -> list[tuple[str, str]] | None:
    found = []
    for body in _CALL.findall(text):
        try:
            call = _call(json.loads(body))
        except (ValueError, RecursionError):  # not JSON, or nested too deep to read: content
            return None
        if call is None:
            return None
        found.append(call)
    return found or None


def _parse_required(text: str) -> list[tuple[str, str]] | None:
    try:
        items = json.loads(text)
        calls = [_call(x) for x in items] if isinstance(items, list) else [None]
    except (ValueError, RecursionError):  # not JSON, or nested too deep to read: content
        return None
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]
