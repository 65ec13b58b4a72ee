"""``POST /v1/completions``: prompts (text or token ids, one or many) -> n choices each.

Scoring (what eval harnesses send): ``echo`` with ``logprobs`` returns the prompt's logprobs
(the first null) followed by exactly the generated tokens'; ``max_tokens: 0`` generates nothing
(a teacher-forced pass, as ``LLM.score``). Prompt logprobs are bitwise ``LLM.score``'s values."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response

from samebits.engine.sequence import CompletionOutput, PromptLogprobs
from samebits.server.async_engine import RequestGroup
from samebits.server.errors import APIError
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
    sampling_params,
    sse,
    submit,
    usage,
)
from samebits.server.structured import check_constraint, requested_constraint
from samebits.server.tokens import TextStream


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request
                            ) -> Response:
    ctx.check_model(req.model)
    k, count = req.num_candidates(), _count(req.prompt)
    if count * k > MAX_CHOICES:  # before any tokenizing: the work is bounded by the count
        name = "n" if req.best_of is None else "best_of"
        raise APIError(400, f"{count} prompts x {name}={k} exceeds {MAX_CHOICES} choices "
                       "per request", param=name)
    prompts = await _prompts(ctx, req.prompt)
    if req.stream and (req.echo or req.prompt_logprobs is not None):
        param = "echo" if req.echo else "prompt_logprobs"
        raise APIError(400, f"{param} is not supported with stream=true; send it without stream",
                       param=param)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    for ids in prompts:
        ctx.check_length(ids, max_tokens, "prompt")
    spec, field = requested_constraint(req)
    await check_constraint(ctx, spec, field)
    params = replace(sampling_params(req, max(max_tokens, 1), req.logprobs, spec),
                     prompt_logprobs=_prompt_k(req))
    response_id = new_id("cmpl")
    group = make_group(response_id, prompts, [params] * len(prompts), k, req.stream,
                       req.cache_salt, score_only=max_tokens == 0)
    seed = await submit(ctx, group)
    header = dict(id=response_id, model=ctx.model_name, system_fingerprint=ctx.fingerprint,
                  seed=seed)
    if req.stream:
        return sse(ctx, group, lambda: _events(ctx, req, group, header))
    outputs = await collect(ctx, group, request)
    chosen = best(outputs, req.n, k)
    texts = _prompt_texts(ctx, req.prompt, prompts) if req.echo else None
    choices = [_choice(ctx, req, o, prompts[o.index // req.n],
                       group.prompt_logprobs[(o.index // req.n) * k],
                       texts[o.index // req.n] if texts else "") for o in chosen]
    body = CompletionResponse(**header, choices=choices,
                              usage=usage(prompts, outputs, cached_tokens(group, k)))
    return hashed_json(body, chosen)


def _prompt_k(req: CompletionRequest) -> int | None:
    """Top-k the engine collects per prompt position: for ``prompt_logprobs`` and, with
    ``echo``, for ``logprobs`` (None: no prompt logprobs needed)."""
    ks = [req.prompt_logprobs, req.logprobs if req.echo else None]
    ks = [k for k in ks if k is not None]
    return max(ks) if ks else None


def _prompt_texts(ctx: ServingContext, prompt: str | list, ids: list[list[int]]) -> list[str]:
    """What ``echo`` repeats: each prompt as sent, or its token ids decoded."""
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
        logprobs = completion_logprobs(ctx.token_text, out.token_ids, out.logprobs,
                                       out.top_logprobs)
        if req.echo:
            logprobs = echo_logprobs(ctx.token_text, prompt_ids, prompt_lps, req.logprobs, logprobs)
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(prompt_lps, req.prompt_logprobs)
    return CompletionChoice(index=out.index, text=echo_text + out.text, logprobs=logprobs,
                            finish_reason=out.finish_reason, seed=out.seed,
                            prompt_logprobs=prompt_logprobs)


async def _events(ctx: ServingContext, req: CompletionRequest, group: RequestGroup,
                  header: dict) -> AsyncIterator[CompletionResponse]:
    texts = [TextStream(ctx.tokenizer, p.stop_strings) for p in group.params]
    offsets = [0] * len(texts)
    finals: list[CompletionOutput] = [None] * len(texts)  # type: ignore[list-item]
    async for d in deltas(group):
        if d.output is not None:  # the final text is the engine's (stop strings / ids cut it)
            text = texts[d.index].finish(d.output.text)
            finals[d.index] = d.output
        else:
            text = texts[d.index].push(d.token_ids)
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(ctx.token_text, d.token_ids, d.logprobs,
                                           d.top_logprobs, offsets[d.index])
            offsets[d.index] += text_length(ctx.token_text, d.token_ids)
        finish = d.output.finish_reason if d.output is not None else None
        yield CompletionResponse(**header, choices=[CompletionChoice(
            index=d.index, text=text, logprobs=logprobs, finish_reason=finish,
            seed=group.seeds[d.index])], output_hash=last_hash(d.output, finals))
    if req.stream_options is not None and req.stream_options.include_usage:
        yield CompletionResponse(**header, choices=[], usage=usage(
            group.prompts[::req.n], finals, cached_tokens(group, req.n)))
