"""``POST /v1/responses`` (OpenAI's Responses API) for text models, stateless.

The input (a string, or message / function_call / function_call_output items, after
``instructions`` as a system message) goes through the chat template like a chat request; one
answer is generated with the same engine, tools, structured output (``text.format``) and bits as
``/v1/chat/completions``. The output is a list of items: a message with the text, and one
``function_call`` item per tool call. An answer cut by ``max_output_tokens`` is ``incomplete``
(``incomplete_details.reason: "max_output_tokens"``) and carries no tool calls: its raw text is the
message. Streaming sends the Responses events (``samebits.server.responses_stream``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from samebits.sampling_params import SamplingParams
from samebits.server.errors import APIError, from_value_error
from samebits.server.extensions import check_logprobs
from samebits.server.protocol_tools import FunctionDef, NamedFunction, NamedToolChoice, Tool
from samebits.server.responses_output import finished, item_id, output_items
from samebits.server.responses_protocol import (
    LOGPROBS,
    FunctionCallItem,
    FunctionCallOutput,
    Message,
    ResponseObject,
    ResponsesRequest,
)
from samebits.server.responses_stream import stream_response
from samebits.server.serving import ServingContext, collect, hashed_json, make_group, submit
from samebits.server.structured import check_constraint
from samebits.server.tools import ToolPlan, tool_plan
from samebits.structured_outputs import StructuredOutputsParams
from samebits.text.chat_template import render_chat


async def create_response(ctx: ServingContext, req: ResponsesRequest, request: Request
                          ) -> Response:
    ctx.check_model(req.model)
    check_logprobs(ctx, req.top_logprobs, "top_logprobs")
    tools = [Tool(type="function", function=FunctionDef(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in req.tools or ()]
    plan = tool_plan(tools, _tool_choice(req))
    spec = await _constraint(ctx, req, plan)
    text = await asyncio.to_thread(_render, ctx, req, tools)
    ids = await ctx.encode(text, "input")
    max_tokens = req.max_output_tokens
    if max_tokens is None:
        max_tokens = ctx.max_model_len - len(ids)
    ctx.check_length(ids, max_tokens, "input")
    params = _sampling_params(req, max_tokens, spec)
    response_id = item_id("resp")
    group = make_group(response_id, [ids], [params], 1, req.stream, req.cache_salt)
    seed = await submit(ctx, group)
    head = ResponseObject(id=response_id, status="in_progress",
                          model=req.model or ctx.model_name, system_fingerprint=ctx.fingerprint,
                          seed=seed, **_echoed(req, tools))
    if req.stream:
        return stream_response(ctx, req, plan, group, head)
    out = (await collect(ctx, group, request))[0]
    body = finished(head, output_items(ctx, req, plan, out), out, len(ids),
                    group.cached_tokens[0])
    return hashed_json(body, [out])


def _tool_choice(req: ResponsesRequest) -> str | NamedToolChoice | None:
    choice = req.tool_choice
    if isinstance(choice, str) or choice is None:
        return choice
    return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


async def _constraint(ctx: ServingContext, req: ResponsesRequest, plan: ToolPlan
                      ) -> StructuredOutputsParams | None:
    """The output constraint: a forced tool call's, or ``text.format``'s; compiled (400s)."""
    fmt = req.text.format if req.text is not None else None
    spec, field = None, None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(400, "text.format.schema is required for type 'json_schema'",
                           param="text")
        spec = StructuredOutputsParams(json=fmt.schema_) if fmt.type == "json_schema" else \
            StructuredOutputsParams(json_object=True)
        field = "text"
    if plan.constraint is not None:
        if spec is not None:
            raise APIError(400, f"tool_choice: {plan.mode!r} constrains the output, so "
                           "text.format cannot be given too", param="tool_choice")
        spec, field = plan.constraint, "tools"
    await check_constraint(ctx, spec, field)
    return spec


def _render(ctx: ServingContext, req: ResponsesRequest, tools: list[Tool]) -> str:
    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template", param="input")
    try:
        return render_chat(ctx.tokenizer, conversation(req),
                           [t.model_dump(exclude_none=True) for t in tools])
    except ValueError as e:
        raise APIError(400, str(e), param="input") from None


def conversation(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input as chat-template messages: ``instructions`` first (system), developer ->
    system, function_call items -> an assistant's tool_calls, their outputs -> tool messages."""
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    items = [Message(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for item in items:
        if isinstance(item, Message):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            assert isinstance(item, FunctionCallOutput)
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.text()})
    return messages


def _sampling_params(req: ResponsesRequest, max_tokens: int,
                     spec: StructuredOutputsParams | None) -> SamplingParams:
    given = {name: getattr(req, name) for name in _SAMPLING_FIELDS
             if getattr(req, name) is not None}
    logprobs = (req.top_logprobs or 0) if LOGPROBS in (req.include or ()) else None
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=spec,
                              **given)
    except ValueError as e:
        error = from_value_error(e)
    if error.param == "max_tokens":  # the wire name of SamplingParams.max_tokens
        raise APIError(400, "max_output_tokens" + error.message.removeprefix("max_tokens"),
                       param="max_output_tokens")
    raise error


_SAMPLING_FIELDS = (  # request fields that are SamplingParams fields of the same name
    "temperature", "top_p", "top_k", "seed", "repetition_penalty", "logit_bias", "stop",
    "ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def _echoed(req: ResponsesRequest, tools: list[Tool]) -> dict[str, Any]:
    """The request's settings as the response object repeats them."""
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    out: dict[str, Any] = dict(
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, top_logprobs=req.top_logprobs,
        metadata=req.metadata, user=req.user, tools=req.tools or [],
        tool_choice=choice if isinstance(choice, str) else choice.model_dump(),
        parallel_tool_calls=req.parallel_tool_calls is not False)
    if req.text is not None and req.text.format is not None:
        out["text"] = {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
    return out
