"""What both endpoints share: checking a request against the model, turning it into engine
requests (one per choice, seeds ``S + i``), and getting the results back -- whole, or as a
server-sent-event stream -- while aborting whatever a departed client leaves behind."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from samebits.engine.sequence import RequestOutput
from samebits.sampling_params import SamplingParams
from samebits.server.async_engine import AsyncEngine, Delta, RequestGroup
from samebits.server.errors import APIError, from_value_error
from samebits.server.protocol import ErrorResponse, SamplingFields, Usage
from samebits.server.tokens import TokenText
from samebits.tokenizer import Tokenizer


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_name: str
    tokenizer: Tokenizer | None
    max_model_len: int
    fingerprint: str
    token_text: TokenText

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def encode(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param=param)
        try:
            return self.tokenizer.encode(text)
        except UnicodeError:
            raise APIError(400, f"{param} is not valid UTF-8", param=param) from None

    def check_length(self, ids: list[int], max_tokens: int, param: str) -> None:
        limit = self.max_model_len
        if len(ids) > limit or (len(ids) == limit and max_tokens > 0):
            raise APIError(400, f"{param} has {len(ids)} tokens; this model's context is {limit} "
                           "tokens", param=param, code="context_length_exceeded")
        if len(ids) + max_tokens > limit:
            raise APIError(400, f"max_tokens={max_tokens} plus {len(ids)} prompt tokens exceeds "
                           f"this model's context of {limit} tokens", param="max_tokens",
                           code="context_length_exceeded")


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None
                    ) -> SamplingParams:
    """The request's sampling parameters (choice 0's seed); engine-side checks become 400s."""
    defaults = SamplingParams()
    try:
        return SamplingParams(
            max_tokens=max_tokens, logprobs=logprobs, seed=req.seed, stop=req.stop,
            temperature=_or(req.temperature, defaults.temperature),
            top_p=_or(req.top_p, defaults.top_p), top_k=_or(req.top_k, defaults.top_k),
            min_p=_or(req.min_p, defaults.min_p), stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos)
    except ValueError as e:
        raise from_value_error(e) from None


def _or(value, default):
    return default if value is None else value


def make_group(prefix: str, prompts: list[list[int]], params: list[SamplingParams], n: int,
               stream: bool, score_only: bool = False) -> RequestGroup:
    """n engine requests per prompt; with a seed S, choice i of each prompt uses seed S + i."""
    ids, all_prompts, all_params, offsets = [], [], [], []
    for p, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        for i in range(n):
            ids.append(f"{prefix}-{p}-{i}")
            all_prompts.append(prompt)
            all_params.append(sp if sp.seed is None else replace(sp, seed=sp.seed + i))
            offsets.append(i)
    return RequestGroup(ids, all_prompts, all_params, offsets, stream, score_only)


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


async def submit(ctx: ServingContext, group: RequestGroup) -> int:
    """Admit the group; returns the request's seed (choice 0's, drawn if none was given)."""
    try:
        await ctx.engine.submit(group)
    except ValueError as e:
        raise from_value_error(e) from None
    return group.seeds[0] - group.seed_offsets[0]


async def deltas(group: RequestGroup) -> AsyncIterator[Delta]:
    """Every delta of the group until each request has finished; raises on an engine error."""
    remaining = len(group.request_ids)
    while remaining:
        delta = await group.queue.get()
        if delta.error is not None:
            raise APIError(500, delta.error)
        remaining -= delta.output is not None
        yield delta


async def collect(ctx: ServingContext, group: RequestGroup, request: Request
                  ) -> list[RequestOutput]:
    """Wait for all outputs; a client that disconnects first aborts the group."""
    outputs: list[RequestOutput | None] = [None] * len(group.request_ids)
    watcher = asyncio.create_task(_wait_disconnect(request))
    waiter = asyncio.ensure_future(_gather(group, outputs))
    try:
        done, _ = await asyncio.wait({watcher, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            raise APIError(499, "client disconnected")
        return waiter.result()
    finally:
        watcher.cancel()
        waiter.cancel()
        if any(o is None for o in outputs):
            ctx.engine.abort(group.request_ids)


async def _gather(group: RequestGroup, outputs: list) -> list[RequestOutput]:
    async for delta in deltas(group):
        if delta.output is not None:
            outputs[delta.index] = delta.output
    return outputs


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage(outputs: list[RequestOutput], n: int) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::n])  # each prompt counted once
    completion = sum(len(o.token_ids) for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion)


def sse(ctx: ServingContext, group: RequestGroup,
        events: Callable[[], AsyncIterator[BaseModel]]) -> StreamingResponse:
    """Stream ``events`` as server-sent events, then ``[DONE]``; abort the group when the client
    leaves (the generator is cancelled, or never started) and after the stream."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events():
                yield f"data: {event.model_dump_json()}\n\n"
        except APIError as e:
            yield f"data: {ErrorResponse(error=e.info()).model_dump_json()}\n\n"
        finally:
            ctx.engine.abort(group.request_ids)
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(ctx.engine.abort, group.request_ids))
