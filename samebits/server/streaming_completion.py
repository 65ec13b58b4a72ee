"""A streamed ``/v1/completions`` answer: one chunk per engine delta, each carrying one choice.

A choice's first chunk carries what belongs to its prompt, as vLLM streams it: with ``echo``, the
prompt's text before the first generated text and, with ``logprobs``, the prompt tokens' logprobs
(the first null) before the generated tokens'; with ``return_token_ids``, ``prompt_token_ids``;
with ``prompt_logprobs``, vLLM's per-choice ``prompt_logprobs`` (vLLM itself refuses them on a
stream). The engine sends a request's prompt logprobs with its first delta (the prompt is scored
before the first token is sampled), so nothing waits for the end. The chunks of a choice,
concatenated, are its non-streamed choice: the same text, the same logprobs bit for bit, the same
text offsets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from samebits.outputs import CompletionOutput
from samebits.server.async_engine import Delta, RequestGroup
from samebits.server.extensions import chunk_usage, continuous, include_usage
from samebits.server.logprobs import (
    completion_logprobs,
    echo_logprobs,
    text_length,
    vllm_prompt_logprobs,
)
from samebits.server.protocol_completion import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from samebits.server.serving import (
    ServingContext,
    cached_tokens,
    deltas,
    last_hash,
    usage,
)


@dataclass
class _Choice:
    """What one choice's stream has sent so far."""

    started: bool = False
    offset: int = 0  # the next token's text_offset
    tokens: int = 0  # generated tokens sent


async def completion_events(ctx: ServingContext, req: CompletionRequest, group: RequestGroup,
                            header: dict, echo: list[str] | None
                            ) -> AsyncIterator[CompletionResponse]:
    """The stream's chunks (``echo``: each prompt's text, per prompt), then the usage chunk when
    ``stream_options.include_usage`` asks for it."""
    choices = [_Choice() for _ in group.params]
    finals: list[CompletionOutput] = [None] * len(group.params)  # type: ignore[list-item]
    live = continuous(req.stream_options)
    async for d in deltas(ctx, group):
        if d.output is not None:
            finals[d.index] = d.output
        state, prompt = choices[d.index], group.prompts[d.index]
        first, state.started = not state.started, True
        echo_text = echo[d.index // req.n] if echo is not None and first else ""
        choice = _chunk_choice(ctx, req, d, state, prompt, first, echo_text,
                               group.seeds[d.index])
        yield CompletionResponse(**header, choices=[choice],
                                 output_hash=last_hash(d.output, finals),
                                 usage=chunk_usage(len(prompt), state.tokens) if live else None)
    if include_usage(req.stream_options):
        yield CompletionResponse(**header, choices=[], usage=usage(
            ctx, group.prompts[::req.n], finals, cached_tokens(group, req.n)))


def _chunk_choice(ctx: ServingContext, req: CompletionRequest, d: Delta, state: _Choice,
                  prompt: list[int], first: bool, echo_text: str, seed: int) -> CompletionChoice:
    """The delta as its choice's next chunk (``first``: the choice's first, with its prompt's
    parts); advances ``state``."""
    state.tokens += len(d.token_ids)
    ids = req.return_token_ids
    prompt_logprobs = None
    if first and req.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(d.prompt_logprobs, req.prompt_logprobs)
    return CompletionChoice(
        index=d.index, text=echo_text + d.text, seed=seed,
        logprobs=_logprobs(ctx, req, d, state, prompt if first and req.echo else None),
        finish_reason=d.output.finish_reason if d.output is not None else None,
        prompt_logprobs=prompt_logprobs, prompt_token_ids=prompt if ids and first else None,
        token_ids=d.token_ids if ids else None)


def _logprobs(ctx: ServingContext, req: CompletionRequest, d: Delta, state: _Choice,
              echoed: list[int] | None) -> CompletionLogprobs | None:
    """The delta's logprobs from ``state.offset`` on, after the ``echoed`` prompt's (its first
    chunk, with ``echo``: their text offsets start at 0, as the non-streamed choice's)."""
    if req.logprobs is None:
        return None
    tt = ctx.shown_tokens(req.return_tokens_as_token_ids)
    if echoed is None:
        out = completion_logprobs(tt, d.token_ids, d.logprobs, d.top_logprobs, state.offset)
        state.offset += text_length(tt, d.token_ids)
        return out
    generated = completion_logprobs(tt, d.token_ids, d.logprobs, d.top_logprobs)
    state.offset = text_length(tt, echoed) + text_length(tt, d.token_ids)
    return echo_logprobs(tt, echoed, d.prompt_logprobs, req.logprobs, generated)
