"""A streamed ``/v1/chat/completions`` answer, in vLLM's order: per choice, a first chunk with the
role (and an empty content), then ``echo``'s text when asked, then one chunk per engine delta.

The first chunk of the stream carries what belongs to the prompt: ``prompt_token_ids``
(``return_token_ids``) and ``prompt_logprobs`` (vLLM's shape, as on a non-streamed response;
vLLM itself refuses them on a stream). The engine sends a request's prompt logprobs with its first
delta (the prompt is scored before the first token is sampled), so when they are asked for the
opening chunks wait for that delta, as vLLM's wait for the engine's first output; otherwise they
go out at once. Tool calls are sent whole when a choice is complete, or as content when it was cut
by ``max_tokens`` (samebits.server.tools), so a choice's deltas add up to its non-streamed message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from samebits.outputs import CompletionOutput
from samebits.server.async_engine import Delta, RequestGroup
from samebits.server.extensions import chunk_usage, continuous, include_usage
from samebits.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from samebits.server.protocol import VllmPromptLogprobs
from samebits.server.protocol_chat import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
)
from samebits.server.protocol_tools import DeltaFunctionCall, DeltaToolCall
from samebits.server.serving import ServingContext, cached_tokens, deltas, last_hash, usage
from samebits.server.tools import ToolPlan, ToolStream, finish_reason


@dataclass(frozen=True)
class ChatReply:
    """What every choice of one chat request shares, streamed or not."""

    req: ChatCompletionRequest
    plan: ToolPlan
    prompt: list[int]
    echo: str  # the text each choice starts with (``echo``), else ""
    legacy: bool  # the request gave ``functions``: calls in the legacy shape


def reply_logprobs(ctx: ServingContext, req: ChatCompletionRequest, token_ids: list[int],
                   logprobs: list[float], top: list[dict[int, float]]) -> ChatLogprobs | None:
    """The tokens' logprobs in the chat shape, when the request asked for them."""
    if not req.logprobs:
        return None
    return chat_logprobs(ctx.shown_tokens(req.return_tokens_as_token_ids), token_ids, logprobs,
                         top, req.top_logprobs or 0)


async def chat_events(ctx: ServingContext, reply: ChatReply, group: RequestGroup, header: dict
                      ) -> AsyncIterator[ChatCompletionChunk]:
    """The stream's chunks, then the usage chunk when ``stream_options.include_usage`` asks."""
    req, incoming = reply.req, deltas(ctx, group)
    first: Delta | None = None
    prompt_lps = None
    if req.prompt_logprobs is not None:  # the first delta carries them
        first = await anext(incoming)
        prompt_lps = vllm_prompt_logprobs(first.prompt_logprobs, req.prompt_logprobs)
    for chunk in _opening(reply, group, header, prompt_lps):
        yield chunk
    choices = _Choices(ctx, reply, group, header)
    if first is not None:
        yield choices.chunk(first)
    async for d in incoming:
        yield choices.chunk(d)
    if include_usage(req.stream_options):
        yield ChatCompletionChunk(**header, choices=[], usage=usage(
            ctx, group.prompts[:1], choices.finals, cached_tokens(group, len(choices.finals))))


def _opening(reply: ChatReply, group: RequestGroup, header: dict,
             prompt_lps: VllmPromptLogprobs | None) -> list[ChatCompletionChunk]:
    """Per choice, the role chunk and ``echo``'s chunk; the prompt's parts on the very first."""
    req, n_prompt = reply.req, len(reply.prompt)
    live = chunk_usage(n_prompt, 0) if continuous(req.stream_options) else None
    chunks = []
    for i, seed in enumerate(group.seeds):
        chunks.append(ChatCompletionChunk(
            **header, choices=[ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                        content=""), seed=seed)],
            prompt_token_ids=reply.prompt if req.return_token_ids and i == 0 else None,
            prompt_logprobs=prompt_lps if i == 0 else None, usage=live))
        if reply.echo:
            chunks.append(ChatCompletionChunk(**header, choices=[ChatChunkChoice(
                index=i, delta=ChatDelta(content=reply.echo), seed=seed)], usage=live))
    return chunks


class _Choices:
    """Each choice's tool parsing and token count; ``chunk`` turns a delta into its chunk."""

    def __init__(self, ctx: ServingContext, reply: ChatReply, group: RequestGroup,
                 header: dict) -> None:
        self.ctx, self.reply, self.group, self.header = ctx, reply, group, header
        self.tools = [ToolStream(reply.plan) for _ in group.params]
        self.counts = [0] * len(group.params)
        self.finals: list[CompletionOutput] = [None] * len(group.params)  # type: ignore[list-item]

    def chunk(self, d: Delta) -> ChatCompletionChunk:
        req, tools = self.reply.req, self.tools[d.index]
        content, calls = tools.push(d.text)  # the engine's text, streamed
        finish = None
        if d.output is not None:
            self.finals[d.index] = d.output
            rest, more = tools.finish(cut=d.output.finish_reason == "length")
            content, calls = _join(content, rest), calls + more
            finish = finish_reason(d.output.finish_reason, tools.calls > 0)
        self.counts[d.index] += len(d.token_ids)
        delta = ChatDelta(content=content, tool_calls=calls or None)
        if self.reply.legacy:
            delta, finish = _legacy_delta(delta, finish)
        live = continuous(req.stream_options)
        return ChatCompletionChunk(**self.header, choices=[ChatChunkChoice(
            index=d.index, delta=delta,
            logprobs=reply_logprobs(self.ctx, req, d.token_ids, d.logprobs, d.top_logprobs),
            finish_reason=finish, seed=self.group.seeds[d.index],
            token_ids=d.token_ids if req.return_token_ids else None)],
            output_hash=last_hash(d.output, self.finals),
            usage=chunk_usage(len(self.reply.prompt), self.counts[d.index]) if live else None)


def _legacy_delta(delta: ChatDelta, finish: str | None) -> tuple[ChatDelta, str | None]:
    """A tool-call delta in the legacy shape: the first call as ``function_call``."""
    first: list[DeltaToolCall] = [c for c in delta.tool_calls or () if c.index == 0]
    if first:
        f = first[0].function
        delta = ChatDelta(content=delta.content,
                          function_call=DeltaFunctionCall(name=f.name, arguments=f.arguments))
    return delta, "function_call" if finish == "tool_calls" else finish


def _join(a: str | None, b: str | None) -> str | None:
    return None if a is None and b is None else (a or "") + (b or "")
