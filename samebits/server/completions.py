"""``POST /v1/completions``: prompts (text or token ids, one or many) -> n choices each.

Scoring (what eval harnesses send): ``echo`` with ``logprobs`` returns the prompt's logprobs
(the first null) followed by exactly the generated tokens'; ``max_tokens: 0`` generates nothing
(a teacher-forced pass, as ``LLM.score``). Prompt logprobs are bitwise ``LLM.score``'s values.
Streamed, ``echo`` sends each choice's prompt in its first chunk (the prompt's logprobs are known
only at the end: ``echo`` with ``logprobs`` is not streamed). vLLM's ``return_token_ids`` adds
``prompt_token_ids`` and each choice's ``token_ids``; ``truncate_prompt_tokens`` keeps each
prompt's last k tokens (``echo`` then repeats what is left)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from samebits.outputs import CompletionOutput, PromptLogprobs
from samebits.server.async_engine import RequestGroup
from samebits.server.errors import APIError, from_value_error
from samebits.server.extensions import (
    check_logprobs,
    chunk_usage,
    continuous,
    include_usage,
    truncated,
)
from samebits.server.logprobs import (
    completion_logprobs,
    echo_logprobs,
    text_length,
    vllm_prompt_logprobs,
)
from samebits.server.protocol import (
    MAX_CHOICES,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
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
    sse,
    submit,
    usage,
)
from samebits.server.structured import check_constraint, requested_constraint


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request
                            ) -> Response:
    ctx.check_model(req.model)
    check_logprobs(ctx, req.logprobs, "logprobs")
    check_logprobs(ctx, req.prompt_logprobs, "prompt_logprobs")
    _check_shape(req, _count(req.prompt))  # before any tokenizing: the work is bounded by the count
    prompts = [truncated(ctx, p, req.truncate_prompt_tokens) for p in await _prompts(ctx, req.prompt)]
    k = req.num_candidates()
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    for ids in prompts:
        ctx.check_length(ids, max_tokens, "prompt")
    spec, field = requested_constraint(req)
    await check_constraint(ctx, spec, field)
    try:
        params = req.to_sampling_params(max(max_tokens, 1), req.logprobs, spec,
                                        prompt_logprobs=_prompt_k(req))
    except ValueError as e:
        raise from_value_error(e) from None
    response_id = new_id("cmpl")
    group = make_group(response_id, prompts, [params] * len(prompts), k, req.stream,
                       req.cache_salt, score_only=max_tokens == 0)
    seed = await submit(ctx, group)
    header = dict(id=response_id, model=req.model or ctx.model_name,
                  system_fingerprint=ctx.fingerprint, seed=seed)
    texts = _prompt_texts(ctx, req, prompts) if req.echo else None
    if req.stream:
        return sse(ctx, group, lambda: _events(ctx, req, group, header, texts))
    outputs = await collect(ctx, group, request)
    chosen = best(outputs, req.n, k)
    choices = [_choice(ctx, req, o, prompts[o.index // req.n],
                       group.prompt_logprobs[(o.index // req.n) * k],
                       texts[o.index // req.n] if texts else "") for o in chosen]
    body = CompletionResponse(**header, choices=choices,
                              usage=usage(prompts, outputs, cached_tokens(group, k)))
    return hashed_json(body, chosen)


def _check_shape(req: CompletionRequest, num_prompts: int) -> None:
    """A 400 for too many choices, and for prompt logprobs asked of a stream."""
    k = req.num_candidates()
    if num_prompts * k > MAX_CHOICES:
        name = "n" if req.best_of is None else "best_of"
        raise APIError(400, f"{num_prompts} prompts x {name}={k} exceeds {MAX_CHOICES} choices "
                       "per request", param=name)
    if req.stream and (req.prompt_logprobs is not None or (req.echo and req.logprobs is not None)):
        param = "prompt_logprobs" if req.prompt_logprobs is not None else "logprobs"
        raise APIError(400, f"{param} of the prompt (prompt_logprobs, or echo with logprobs) "
                       "cannot be streamed; send it without stream", param=param)


def _prompt_k(req: CompletionRequest) -> int | None:
    """Top-k the engine collects per prompt position: for ``prompt_logprobs`` and, with
    ``echo``, for ``logprobs`` (None: no prompt logprobs needed)."""
    ks = [req.prompt_logprobs, req.logprobs if req.echo else None]
    ks = [k for k in ks if k is not None]
    return max(ks) if ks else None


def _prompt_texts(ctx: ServingContext, req: CompletionRequest, ids: list[list[int]]
                  ) -> list[str]:
    """What ``echo`` repeats: each prompt as sent (truncated: what is left of it), or its token
    ids decoded."""
    prompt = req.prompt
    if req.truncate_prompt_tokens is not None and ctx.tokenizer is not None:
        return [ctx.tokenizer.decode(p, skip_special_tokens=False) for p in ids]
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return list(prompt)
    if ctx.tokenizer is None:
        return ["" for _ in ids]
    return [ctx.tokenizer.decode(p, skip_special_tokens=False) for p in ids]


def _count(prompt: str | list) -> int:
    """How many prompts the field holds (a flat id list is one)."""
    return 1 if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int) else len(prompt)


async def _prompts(ctx: ServingContext, prompt: str | list) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await ctx.encode(prompt, "prompt")]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], str):
        return [await ctx.encode(p, "prompt") for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _choice(ctx: ServingContext, req: CompletionRequest, out: CompletionOutput,
            prompt_ids: list[int], prompt_lps: PromptLogprobs | None, echo_text: str
            ) -> CompletionChoice:
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(ctx.token_text, out.token_ids, out.token_logprobs,
                                       out.top_logprobs)
        if req.echo:
            logprobs = echo_logprobs(ctx.token_text, prompt_ids, prompt_lps, req.logprobs, logprobs)
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(prompt_lps, req.prompt_logprobs)
    return CompletionChoice(index=out.index, text=echo_text + out.text, logprobs=logprobs,
                            finish_reason=out.finish_reason, seed=out.seed,
                            prompt_logprobs=prompt_logprobs,
                            prompt_token_ids=prompt_ids if req.return_token_ids else None,
                            token_ids=out.token_ids if req.return_token_ids else None)


async def _events(ctx: ServingContext, req: CompletionRequest, group: RequestGroup,
                  header: dict, echo: list[str] | None) -> AsyncIterator[CompletionResponse]:
    offsets, counts = [0] * len(group.params), [0] * len(group.params)
    started = [False] * len(group.params)
    finals: list[CompletionOutput] = [None] * len(group.params)  # type: ignore[list-item]
    live = continuous(req.stream_options)
    async for d in deltas(group):
        prompt = group.prompts[d.index]
        text = d.text  # the engine's output text, streamed (engine.output_processor)
        if d.output is not None:
            finals[d.index] = d.output
        first, started[d.index] = not started[d.index], True
        if first and echo is not None:  # each choice's first chunk starts with its prompt
            text = echo[d.index // req.n] + text
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(ctx.token_text, d.token_ids, d.logprobs,
                                           d.top_logprobs, offsets[d.index])
            offsets[d.index] += text_length(ctx.token_text, d.token_ids)
        counts[d.index] += len(d.token_ids)
        finish = d.output.finish_reason if d.output is not None else None
        ids = req.return_token_ids
        yield CompletionResponse(**header, choices=[CompletionChoice(
            index=d.index, text=text, logprobs=logprobs, finish_reason=finish,
            seed=group.seeds[d.index], prompt_token_ids=prompt if ids and first else None,
            token_ids=d.token_ids if ids else None)], output_hash=last_hash(d.output, finals),
            usage=chunk_usage(len(prompt), counts[d.index]) if live else None)
    if include_usage(req.stream_options):
        yield CompletionResponse(**header, choices=[], usage=usage(
            group.prompts[::req.n], finals, cached_tokens(group, req.n)))
