"""``POST /v1/chat/completions``: messages -> the model's chat template -> n choices."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

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
    ChatMessageOut,
)
from samebits.server.serving import (
    ServingContext,
    best,
    collect,
    deltas,
    make_group,
    new_id,
    sampling_params,
    sse,
    submit,
    usage,
)
from samebits.server.tokens import TextStream


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 request: Request
                                 ) -> ChatCompletionResponse | StreamingResponse:
    ctx.check_model(req.model)
    ids = ctx.encode(_render(ctx, req), "messages")
    max_tokens = req.max_completion_tokens or req.max_tokens or ctx.max_model_len - len(ids)
    ctx.check_length(ids, max_tokens, "messages")
    k = req.top_logprobs or 0
    params = sampling_params(req, max_tokens, k if req.logprobs else None)
    response_id = new_id("chatcmpl")
    group = make_group(response_id, [ids], [params], req.num_candidates(), req.stream)
    seed = await submit(ctx, group)
    header = dict(id=response_id, model=ctx.model_name, system_fingerprint=ctx.fingerprint,
                  seed=seed)
    if req.stream:
        return sse(ctx, group, lambda: _events(ctx, req, group, header))
    outputs = await collect(ctx, group, request)
    choices = [_choice(ctx, req, o) for o in best(outputs, req.n, req.num_candidates())]
    return ChatCompletionResponse(**header, choices=choices, usage=usage([ids], outputs))


def _render(ctx: ServingContext, req: ChatCompletionRequest) -> str:
    if ctx.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template", param="messages")
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in req.messages]
    try:
        return ctx.tokenizer.apply_chat_template(messages)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


def _logprobs(ctx: ServingContext, req: ChatCompletionRequest, token_ids: list[int],
              logprobs: list[float], top: list[dict[int, float]]):
    if not req.logprobs:
        return None
    return chat_logprobs(ctx.token_text, token_ids, logprobs, top, req.top_logprobs or 0)


def _choice(ctx: ServingContext, req: ChatCompletionRequest, out: CompletionOutput
            ) -> ChatChoice:
    return ChatChoice(index=out.index, message=ChatMessageOut(content=out.text),
                      logprobs=_logprobs(ctx, req, out.token_ids, out.logprobs, out.top_logprobs),
                      finish_reason=out.finish_reason, seed=out.seed)


async def _events(ctx: ServingContext, req: ChatCompletionRequest, group: RequestGroup,
                  header: dict) -> AsyncIterator[ChatCompletionChunk]:
    texts = [TextStream(ctx.tokenizer, p.stop_strings) for p in group.params]
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
        yield ChatCompletionChunk(**header, choices=[ChatChunkChoice(
            index=d.index, delta=ChatDelta(content=text),
            logprobs=_logprobs(ctx, req, d.token_ids, d.logprobs, d.top_logprobs),
            finish_reason=d.output.finish_reason if d.output is not None else None,
            seed=group.seeds[d.index])])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield ChatCompletionChunk(**header, choices=[], usage=usage(group.prompts[:1], finals))
