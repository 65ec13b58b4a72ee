"""``POST /v1/chat/completions``: messages -> the model's chat template -> n choices.

vLLM's chat extensions: ``add_generation_prompt`` / ``continue_final_message`` (render the
conversation and continue its last message: samebits.text.chat_template), ``echo``
(the reply starts with the last message's content when that message has the reply's role, as
vLLM), ``prompt_logprobs`` (top level, vLLM's shape), ``return_token_ids``; streamed by
samebits.server.streaming_chat. Legacy
``functions`` / ``function_call`` run as tools; their calls come back in the legacy shape
(``message.function_call``, finish reason ``function_call``)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from samebits.outputs import CompletionOutput
from samebits.server.errors import APIError
from samebits.server.extensions import (
    check_logprobs,
    truncated,
)
from samebits.server.logprobs import vllm_prompt_logprobs
from samebits.server.protocol_chat import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatMessageOut,
)
from samebits.server.protocol_tools import ToolCall
from samebits.server.serving import (
    ServingContext,
    best,
    cached_tokens,
    collect,
    hashed_json,
    make_group,
    new_id,
    sampling_params,
    sse,
    submit,
    usage,
)
from samebits.server.streaming_chat import ChatReply, chat_events, reply_logprobs
from samebits.server.structured import check_constraint, requested_constraint
from samebits.server.tools import ToolPlan, ToolStream, finish_reason, tool_plan
from samebits.structured_outputs import StructuredOutputsParams
from samebits.text.chat_template import RESERVED_TEMPLATE_KWARGS, render_chat


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 request: Request) -> Response:
    ctx.check_model(req.model)
    check_logprobs(ctx, req.top_logprobs, "top_logprobs")
    check_logprobs(ctx, req.prompt_logprobs, "prompt_logprobs")
    plan = tool_plan(req.tool_list(), req.tool_choice_value())
    spec = await _constraint(ctx, req, plan)
    text = await asyncio.to_thread(_render, ctx, req)
    ids = truncated(ctx, await ctx.encode(text, "messages"), req.truncate_prompt_tokens)
    asked, field = req.requested_max_tokens()
    ctx.check_length(ids, asked, "messages", field)
    max_tokens = asked if asked is not None else ctx.max_model_len - len(ids)
    params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                             spec, field, prompt_logprobs=req.prompt_logprobs)
    reply = ChatReply(req, plan, ids, _echo(req), req.functions is not None)
    response_id = new_id("chatcmpl")
    k = req.num_candidates()
    group = make_group(response_id, [ids], [params], k, req.stream, req.cache_salt)
    seed = await submit(ctx, group)
    header = dict(id=response_id, model=req.model or ctx.model_name,
                  system_fingerprint=ctx.fingerprint, seed=seed)
    if req.stream:
        return sse(ctx, group, lambda: chat_events(ctx, reply, group, header))
    outputs = await collect(ctx, group, request)
    chosen = best(outputs, req.n, k)
    prompt_lps = None
    if req.prompt_logprobs is not None:
        prompt_lps = vllm_prompt_logprobs(group.prompt_logprobs[0], req.prompt_logprobs)
    body = ChatCompletionResponse(
        **header, choices=[_choice(ctx, reply, o) for o in chosen],
        usage=usage(ctx, [ids], outputs, cached_tokens(group, k)), prompt_logprobs=prompt_lps,
        prompt_token_ids=ids if req.return_token_ids else None)
    return hashed_json(body, chosen)


async def _constraint(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan
                      ) -> StructuredOutputsParams | None:
    """The output constraint: a forced tool call's, or the request's own; compiled (400s)."""
    spec, field = requested_constraint(req)
    if plan.constraint is not None:
        if spec is not None:
            raise APIError(400, f"tool_choice: {plan.mode!r} constrains the output, so {field} "
                           "cannot be given too", param="tool_choice")
        spec, field = plan.constraint, "tools"
    await check_constraint(ctx, spec, field)
    return spec


def _render(ctx: ServingContext, req: ChatCompletionRequest) -> str:
    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template", param="messages")
    messages = [template_message(m) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tool_list()]
    kwargs = req.chat_template_kwargs or {}
    if reserved := RESERVED_TEMPLATE_KWARGS & set(kwargs):
        raise APIError(400, f"chat_template_kwargs: {sorted(reserved)} are set from the request "
                       "itself", param="chat_template_kwargs")
    try:
        return render_chat(ctx.tokenizer, messages, tools, template_kwargs=kwargs,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it (developer -> system, function -> tool, text parts
    joined, a legacy function_call -> tool_calls)."""
    role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
    out: dict[str, Any] = {"role": role, "content": None if m.content is None else m.text()}
    calls = m.tool_calls or ([ToolCall(id=f"call_{m.function_call.name}", function=m.function_call)]
                             if m.function_call else None)
    if calls:
        out["tool_calls"] = [c.model_dump() for c in calls]
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when its role is the reply's."""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    return last.text() if req.echo and last.role == role else ""


def _choice(ctx: ServingContext, reply: ChatReply, out: CompletionOutput) -> ChatChoice:
    cut = out.finish_reason == "length"
    content, calls = ToolStream(reply.plan).parse(out.text, cut)
    reason = finish_reason(out.finish_reason, bool(calls))
    message = ChatMessageOut(content=reply.echo + (content or "") if reply.echo else content,
                             tool_calls=calls or None)
    if reply.legacy and calls:
        message = ChatMessageOut(content=message.content, function_call=calls[0].function)
        reason = "function_call"
    return ChatChoice(index=out.index, message=message,
                      logprobs=reply_logprobs(ctx, reply.req, out.token_ids,
                                              out.token_logprobs, out.top_logprobs),
                      finish_reason=reason, seed=out.seed,
                      token_ids=out.token_ids if reply.req.return_token_ids else None)
