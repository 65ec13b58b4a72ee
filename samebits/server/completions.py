"""``POST /v1/completions``: prompts (text or token ids, one or many) -> n choices each.

Scoring (what eval harnesses send): ``echo`` with ``logprobs`` returns the prompt's logprobs
(the first null) followed by exactly the generated tokens'; ``max_tokens: 0`` generates nothing
(a teacher-forced pass, as ``LLM.score``). Prompt logprobs are bitwise ``LLM.score``'s values."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import StreamingResponse

from samebits.engine.sequence import RequestOutput
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


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request
                            ) -> CompletionResponse | StreamingResponse:
    ctx.check_model(req.model)
    prompts = _prompts(ctx, req.prompt)
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n={req.n} exceeds {MAX_CHOICES} choices "
                       "per request", param="n")
    if req.stream and (req.echo or req.prompt_logprobs is not None):
        param = "echo" if req.echo else "prompt_logprobs"
        raise APIError(400, f"{param} is not supported with stream=true; send it without stream",
                       param=param)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    for ids in prompts:
        ctx.check_length(ids, max_tokens, "prompt")
    params = replace(sampling_params(req, max(max_tokens, 1), req.logprobs),
                     prompt_logprobs=_prompt_k(req))
    response_id = new_id("cmpl")
    group = make_group(response_id, prompts, [params] * len(prompts), req.n, req.stream,
                       score_only=max_tokens == 0)
    seed = await submit(ctx, group)
    header = dict(id=response_id, model=ctx.model_name, system_fingerprint=ctx.fingerprint,
                  seed=seed)
    if req.stream:
        return sse(ctx, group, lambda: _events(ctx, req, group, header))
    outputs = await collect(ctx, group, request)
    texts = _prompt_texts(ctx, req.prompt, prompts) if req.echo else None
    choices = [_choice(ctx, req, i, o, group.seeds[i], texts[i // req.n] if texts else "")
               for i, o in enumerate(outputs)]
    return CompletionResponse(**header, choices=choices, usage=usage(outputs, req.n))


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


def _prompts(ctx: ServingContext, prompt: str | list) -> list[list[int]]:
    if isinstance(prompt, str):
        return [ctx.encode(prompt, "prompt")]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], str):
        return [ctx.encode(p, "prompt") for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _choice(ctx: ServingContext, req: CompletionRequest, index: int, out: RequestOutput,
            seed: int, echo_text: str) -> CompletionChoice:
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(ctx.token_text, out.token_ids, out.logprobs,
                                       out.top_logprobs)
        if req.echo:
            logprobs = echo_logprobs(ctx.token_text, out.prompt_token_ids, out.prompt_logprobs,
                                     req.logprobs, logprobs)
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(out.prompt_logprobs, req.prompt_logprobs)
    return CompletionChoice(index=index, text=echo_text + out.text, logprobs=logprobs,
                            finish_reason=out.finish_reason, seed=seed,
                            prompt_logprobs=prompt_logprobs)


async def _events(ctx: ServingContext, req: CompletionRequest, group: RequestGroup,
                  header: dict) -> AsyncIterator[CompletionResponse]:
    texts = [TextStream(ctx.tokenizer, p.stop_strings) for p in group.params]
    offsets = [0] * len(texts)
    finals: list[RequestOutput] = [None] * len(texts)  # type: ignore[list-item]
    async for d in deltas(group):
        text = texts[d.index].push(d.token_ids)
        if d.output is not None:
            text += texts[d.index].finish(d.output.text)
            finals[d.index] = d.output
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(ctx.token_text, d.token_ids, d.logprobs,
                                           d.top_logprobs, offsets[d.index])
            offsets[d.index] += text_length(ctx.token_text, d.token_ids)
        finish = d.output.finish_reason if d.output is not None else None
        yield CompletionResponse(**header, choices=[CompletionChoice(
            index=d.index, text=text, logprobs=logprobs, finish_reason=finish,
            seed=group.seeds[d.index])])
    if req.stream_options is not None and req.stream_options.include_usage:
        yield CompletionResponse(**header, choices=[], usage=usage(finals, req.n))
