"""``POST /v1/chat/completions``: messages -> the model's chat template -> n choices."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from samebits.engine.sequence import CompletionOutput
from samebits.server.async_engine import RequestGroup
from samebits.server.errors import APIError
from samebits.server.logprobs import chat_logprobs
from samebits.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChatMessageOut,
)
from samebits.server.serving import (
    ServingContext,
    best,
    cached_tokens,
    collect,
    deltas,
    hashed_json,
    last_hash,
    make_group,
    new_id,
    sampling_params,
    sse,
    submit,
    usage,
)
from samebits.server.structured import check_constraint, requested_constraint
from samebits.server.tokens import TextStream
from samebits.server.tools import ToolPlan, ToolStream, finish_reason, tool_plan
from samebits.structured_outputs import StructuredOutputsParams
from samebits.text.chat_template import RESERVED_TEMPLATE_KWARGS, render_chat


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 request: Request
                                 ) -> Response:
    ctx.check_model(req.model)
    plan = tool_plan(req)
    spec = await _constraint(ctx, req, plan)
    ids = await ctx.encode(await asyncio.to_thread(_render, ctx, req), "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens or ctx.max_model_len - len(ids)
    ctx.check_length(ids, max_tokens, "messages")
    k = req.top_logprobs or 0
    params = sampling_params(req, max_tokens, k if req.logprobs else None, spec)
    response_id = new_id("chatcmpl")
    k = req.num_candidates()
    group = make_group(response_id, [ids], [params], k, req.stream, req.cache_salt)
    seed = await submit(ctx, group)
    header = dict(id=response_id, model=ctx.model_name, system_fingerprint=ctx.fingerprint,
                  seed=seed)
    if req.stream:
        return sse(ctx, group, lambda: _events(ctx, req, plan, group, header))
    outputs = await collect(ctx, group, request)
    chosen = best(outputs, req.n, k)
    choices = [_choice(ctx, req, plan, o) for o in chosen]
    body = ChatCompletionResponse(**header, choices=choices,
                                  usage=usage([ids], outputs, cached_tokens(group, k)))
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
    messages = [_message(m) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    kwargs = req.chat_template_kwargs or {}
    if reserved := RESERVED_TEMPLATE_KWARGS & set(kwargs):
        raise APIError(400, f"chat_template_kwargs: {sorted(reserved)} are set from the request "
                       "itself", param="chat_template_kwargs")
    try:
        return render_chat(ctx.tokenizer, messages, tools, template_kwargs=kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def _message(m: ChatMessage) -> dict[str, Any]:
    """A message as the chat template sees it (developer -> system; text parts joined)."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": None if m.content is None else m.text()}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _logprobs(ctx: ServingContext, req: ChatCompletionRequest, token_ids: list[int],
              logprobs: list[float], top: list[dict[int, float]]):
    if not req.logprobs:
        return None
    return chat_logprobs(ctx.token_text, token_ids, logprobs, top, req.top_logprobs or 0)


def _choice(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan,
            out: CompletionOutput) -> ChatChoice:
    content, calls = ToolStream(plan).parse(out.text)
    return ChatChoice(index=out.index,
                      message=ChatMessageOut(content=content, tool_calls=calls or None),
                      logprobs=_logprobs(ctx, req, out.token_ids, out.logprobs, out.top_logprobs),
                      finish_reason=finish_reason(out.finish_reason, bool(calls)), seed=out.seed)


async def _events(ctx: ServingContext, req: ChatCompletionRequest, plan: ToolPlan,
                  group: RequestGroup, header: dict) -> AsyncIterator[ChatCompletionChunk]:
    texts = [TextStream(ctx.tokenizer, p.stop_strings) for p in group.params]
    tools = [ToolStream(plan) for _ in group.params]
    for i, seed in enumerate(group.seeds):
        yield ChatCompletionChunk(**header, choices=[ChatChunkChoice(
            index=i, delta=ChatDelta(role="assistant", content=""), seed=seed)])
    finals: list[CompletionOutput] = [None] * len(texts)  # type: ignore[list-item]
    async for d in deltas(group):
        if d.output is not None:  # the final text is the engine's (stop strings / ids cut it)
            text = texts[d.index].finish(d.output.text)
            finals[d.index] = d.output
        else:
            text = texts[d.index].push(d.token_ids)
        content, calls = tools[d.index].push(text)
        finish = None
        if d.output is not None:
            rest, more = tools[d.index].finish()
            content, calls = _join(content, rest), calls + more
            finish = finish_reason(d.output.finish_reason, tools[d.index].calls > 0)
        yield ChatCompletionChunk(**header, choices=[ChatChunkChoice(
            index=d.index, delta=ChatDelta(content=content, tool_calls=calls or None),
            logprobs=_logprobs(ctx, req, d.token_ids, d.logprobs, d.top_logprobs),
            finish_reason=finish, seed=group.seeds[d.index])],
            output_hash=last_hash(d.output, finals))
    if req.stream_options is not None and req.stream_options.include_usage:
        yield ChatCompletionChunk(**header, choices=[], usage=usage(
            group.prompts[:1], finals, cached_tokens(group, len(finals))))


def _join(a: str | None, b: str | None) -> str | None:
    return None if a is None and b is None else (a or "") + (b or "")
