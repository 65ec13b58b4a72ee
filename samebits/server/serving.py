"""What both endpoints share: checking a request against the model, turning it into engine
requests (one per choice, or per best_of candidate; the seeds and the choice of the best are
samebits.engine.fanout's, as offline), and getting the results back -- whole, or as a
server-sent-event stream -- while aborting whatever a departed client leaves behind."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from samebits.engine import fanout
from samebits.engine.context_length import ContextLengthError, check_context_length
from samebits.engine.grammar import GrammarCompiler
from samebits.outputs import CompletionOutput
from samebits.sampling_params import SamplingParams
from samebits.server.async_engine import (
    RETRY_AFTER_S,
    AsyncEngine,
    Delta,
    QueueFull,
    RequestGroup,
)
from samebits.server.errors import APIError, from_value_error
from samebits.server.output_hash import HEADER, output_hash
from samebits.server.protocol import ErrorResponse, PromptTokensDetails, SamplingFields, Usage
from samebits.server.tokens import TokenIds, TokenText
from samebits.structured_outputs import StructuredOutputsParams
from samebits.text.tokenizer import Tokenizer

log = logging.getLogger("samebits.server")


@dataclass
class ServingContext:
    engine: AsyncEngine
    model_name: str
    tokenizer: Tokenizer | None
    max_model_len: int
    fingerprint: str
    token_text: TokenText
    grammars: GrammarCompiler | None = None  # structured output (the engine's compiler)
    max_logprobs: int = 20  # the most logprobs a request may ask for (--max-logprobs)
    aliases: tuple[str, ...] = ()  # other names clients may send for this model
    prompt_tokens_details: bool = False  # usage reports cached prompt tokens (vLLM's flag)

    def shown_tokens(self, as_ids: bool) -> TokenText | TokenIds:
        """How logprobs name tokens: by text, or by id (``return_tokens_as_token_ids``)."""
        return TokenIds() if as_ids else self.token_text

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name and name not in self.aliases:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    async def encode(self, text: str, param: str) -> list[int]:
        """Token ids of ``text``, tokenized in a worker thread (the event loop keeps serving);
        a text that certainly cannot fit the context is refused before tokenizing."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param=param)
        at_least = self.tokenizer.min_num_tokens(text)
        if at_least >= self.max_model_len:
            raise APIError(400, f"{param} has at least {at_least} tokens ({len(text)} characters); "
                           f"this model's context is {self.max_model_len} tokens", param=param,
                           code="context_length_exceeded")
        try:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        except UnicodeError:
            raise APIError(400, f"{param} is not valid UTF-8", param=param) from None

    def check_length(self, ids: list[int], max_tokens: int | None, param: str,
                     max_tokens_field: str = "max_tokens") -> None:
        """The one context-length check (engine.context_length), OpenAI's rule: prompt +
        ``max_tokens`` must fit (None: the prompt leaves room to generate). The error names
        ``param`` (the prompt's field) or ``max_tokens_field`` (the wire name of max_tokens)."""
        try:
            check_context_length(len(ids), max_tokens, self.max_model_len, param,
                                 fits_max_tokens=True, max_tokens_field=max_tokens_field)
        except ContextLengthError as e:
            raise APIError(400, str(e), param=e.param, code="context_length_exceeded") from None


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    structured: StructuredOutputsParams | None, max_tokens_field: str = "max_tokens",
                    **extra: Any) -> SamplingParams:
    """The request's ``SamplingParams`` (``req.to_sampling_params``): a bad value is a 400 naming
    its field, ``max_tokens`` by the wire name the request gave it (``max_tokens_field``)."""
    try:
        return req.to_sampling_params(max_tokens, logprobs, structured, **extra)
    except ValueError as e:
        error = from_value_error(e)
    if error.param == "max_tokens" and max_tokens_field != "max_tokens":
        raise APIError(400, max_tokens_field + error.message.removeprefix("max_tokens"),
                       param=max_tokens_field)
    raise error


def make_group(prefix: str, prompts: list[list[int]], params: list[SamplingParams], n: int,
               stream: bool, cache_salt: str | None = None, score_only: bool = False
               ) -> RequestGroup:
    """n engine requests per prompt (its candidates), request j candidate ``seed_offsets[j]`` of
    its prompt; the engine thread seeds them at admission (``fanout.seed_requests``: one request
    seed S, given or drawn, candidate i of every prompt S + i). ``score_only``: teacher-forced
    prompt logprobs, nothing generated."""
    ids, all_prompts, all_params, offsets = [], [], [], []
    for p, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        for i in range(n):
            ids.append(f"{prefix}-{p}-{i}")
            all_prompts.append(prompt)
            all_params.append(sp)
            offsets.append(i)
    return RequestGroup(ids, all_prompts, all_params, offsets, stream, cache_salt, score_only)


def best(outputs: list[CompletionOutput], n: int, candidates: int) -> list[CompletionOutput]:
    """Per prompt (``candidates`` consecutive outputs), its choices (``fanout.best``), numbered
    in order over all prompts."""
    chosen = []
    for start in range(0, len(outputs), candidates):
        chosen.extend(fanout.best(outputs[start:start + candidates], n))
    return [o if o.index == i else dataclasses.replace(o, index=i) for i, o in enumerate(chosen)]


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


async def submit(ctx: ServingContext, group: RequestGroup) -> int:
    """Admit the group; returns the request's seed (the one given, or the one drawn)."""
    try:
        await ctx.engine.submit(group)
    except ValueError as e:
        raise from_value_error(e) from None
    except QueueFull as e:
        raise APIError(503, str(e), code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except RuntimeError as e:  # the engine takes no work (it stopped, or a step failed)
        raise APIError(503, str(e), code="server_unavailable") from None
    return group.seed


async def deltas(ctx: ServingContext, group: RequestGroup) -> AsyncIterator[Delta]:
    """Every delta of the group until each request has finished; raises on an engine error.
    Each finished request's token counts go to the per-request metrics."""
    remaining = len(group.request_ids)
    while remaining:
        delta = await group.queue.get()
        if delta.error is not None:
            raise APIError(delta.error_status, delta.error)
        if delta.output is not None:
            remaining -= 1
            _record_finished(ctx, group, delta)
        yield delta


def _record_finished(ctx: ServingContext, group: RequestGroup, delta: Delta) -> None:
    j, metrics = delta.index, ctx.engine.metrics
    metrics.request_finished(len(group.prompts[j]), len(delta.output.token_ids),
                             delta.cached_tokens)
    if group.seed_offsets[j] == 0:  # once per prompt: its first candidate
        metrics.request_params(group.params[j].n, group.params[j].max_tokens)


async def collect(ctx: ServingContext, group: RequestGroup, request: Request
                  ) -> list[CompletionOutput]:
    """Wait for all outputs; a client that disconnects first aborts the group."""
    outputs: list[CompletionOutput | None] = [None] * len(group.request_ids)
    watcher = asyncio.create_task(_wait_disconnect(request))
    waiter = asyncio.ensure_future(_gather(ctx, group, outputs))
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


async def _gather(ctx: ServingContext, group: RequestGroup, outputs: list) -> list[CompletionOutput]:
    async for delta in deltas(ctx, group):
        if delta.output is not None:
            outputs[delta.index] = delta.output
    return outputs


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage(ctx: ServingContext, prompts: list[list[int]], outputs: list[CompletionOutput],
          cached: int) -> Usage:
    """Each prompt counted once; every generated token counted (best_of's unchosen too);
    ``cached``: prompt tokens read from the prefix cache, reported as
    ``prompt_tokens_details.cached_tokens`` when the server was asked to (as vLLM)."""
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(o.token_ids) for o in outputs)
    details = PromptTokensDetails(cached_tokens=cached) if ctx.prompt_tokens_details else None
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion, prompt_tokens_details=details)


def cached_tokens(group: RequestGroup, candidates: int) -> int:
    """Prompt tokens the group's prompts read from the prefix cache (each prompt counted once,
    as its first candidate found it)."""
    return sum(group.cached_tokens[::candidates])


def hash_outputs(outputs: list[CompletionOutput]) -> str:
    """samebits.server.output_hash of a response's choices, in choice order."""
    return output_hash((o.token_ids, o.token_logprobs) for o in outputs)


def hashed_json(body: BaseModel, outputs: list[CompletionOutput]) -> Response:
    """A JSON response carrying the choices' output hash in ``X-Samebits-Output-Hash``."""
    return Response(body.model_dump_json(), media_type="application/json",
                    headers={HEADER: hash_outputs(outputs)})


def last_hash(output: CompletionOutput | None, finals: list[CompletionOutput | None]
              ) -> str | None:
    """A stream's output hash, set on the chunk that finishes its last choice (else None)."""
    if output is None or any(f is None for f in finals):
        return None
    return hash_outputs(finals)


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
        except Exception as e:  # this stream's own failure (its tool parsing, its text): it ends
            log.exception("stream failed")  # with an error event, alone
            info = APIError(500, f"internal error: {type(e).__name__}").info()
            yield f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"
        finally:
            ctx.engine.abort(group.request_ids)
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(ctx.engine.abort, group.request_ids))
