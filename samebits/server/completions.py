"""``POST /v1/completions``: prompts (text or token ids, one or many) -> n choices each.

Scoring (what eval harnesses send): ``echo`` with ``logprobs`` returns the prompt's logprobs
(the first null) followed by exactly the generated tokens'; ``max_tokens: 0`` generates nothing
(a teacher-forced pass, as ``LLM.score``). Prompt logprobs are bitwise ``LLM.score``'s values.
Streamed (samebits.server.streaming_completion), each choice's first chunk carries its prompt's
parts: ``echo``'s text and logprobs, ``prompt_logprobs``. vLLM's ``return_token_ids`` adds
``prompt_token_ids`` and each choice's ``token_ids``; ``truncate_prompt_tokens`` keeps each
prompt's last k tokens (``echo`` then repeats what is left)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from samebits.outputs import CompletionOutput, PromptLogprobs
from samebits.server.errors import APIError
from samebits.server.extensions import (
    check_logprobs,
    truncated,
)
from samebits.server.logprobs import (
    completion_logprobs,
    echo_logprobs,
    vllm_prompt_logprobs,
)
from samebits.server.protocol import MAX_CHOICES
from samebits.server.protocol_completion import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
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
from samebits.server.streaming_completion import completion_events
from samebits.server.structured import check_constraint, requested_constraint


async def create_completion(ctx: ServingContext, req: CompletionRequest, request: Request
                            ) -> Response:
    ctx.check_model(req.model)
    check_logprobs(ctx, req.logprobs, "logprobs")
    check_logprobs(ctx, req.prompt_logprobs, "prompt_logprobs")
    _check_shape(req, _count(req.prompt))  # before any tokenizing: the work is bounded by the count
    spec, field = requested_constraint(req)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # 0: score only
    params = sampling_params(req, max_tokens or 1, req.logprobs, spec,
                             prompt_logprobs=_prompt_k(req))
    prompts = [truncated(ctx, p, req.truncate_prompt_tokens) for p in await _prompts(ctx, req.prompt)]
    k = req.num_candidates()
    for ids in prompts:
        ctx.check_length(ids, max_tokens, "prompt")
    await check_constraint(ctx, spec, field)
    response_id = new_id("cmpl")
    group = make_group(response_id, prompts, [params] * len(prompts), k, req.stream,
                       req.cache_salt, score_only=max_tokens == 0)
    seed = await submit(ctx, group)
    header = dict(id=response_id, model=req.model or ctx.model_name,
                  system_fingerprint=ctx.fingerprint, seed=seed)
    texts = _prompt_texts(ctx, req, prompts) if req.echo else None
    if req.stream:
        return sse(ctx, group, lambda: completion_events(ctx, req, group, header, texts))
    outputs = await collect(ctx, group, request)
    chosen = best(outputs, req.n, k)
    choices = [_choice(ctx, req, o, prompts[o.index // req.n],
                       group.prompt_logprobs[(o.index // req.n) * k],
                       texts[o.index // req.n] if texts else "") for o in chosen]
    body = CompletionResponse(**header, choices=choices,
                              usage=usage(ctx, prompts, outputs, cached_tokens(group, k)))
    return hashed_json(body, chosen)


def _check_shape(req: CompletionRequest, num_prompts: int) -> None:
    """A 400 for too many choices."""
    k = req.num_candidates()
    if num_prompts * k > MAX_CHOICES:
        name = "n" if req.best_of is None else "best_of"
        raise APIError(400, f"{num_prompts} prompts x {name}={k} exceeds {MAX_CHOICES} choices "
                       "per request", param=name)


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
        tt = ctx.shown_tokens(req.return_tokens_as_token_ids)
        logprobs = completion_logprobs(tt, out.token_ids, out.token_logprobs, out.top_logprobs)
        if req.echo:
            logprobs = echo_logprobs(tt, prompt_ids, prompt_lps, req.logprobs, logprobs)
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(prompt_lps, req.prompt_logprobs)
    return CompletionChoice(index=out.index, text=echo_text + out.text, logprobs=logprobs,
                            finish_reason=out.finish_reason, seed=out.seed,
                            prompt_logprobs=prompt_logprobs,
                            prompt_token_ids=prompt_ids if req.return_token_ids else None,
                            token_ids=out.token_ids if req.return_token_ids else None)
