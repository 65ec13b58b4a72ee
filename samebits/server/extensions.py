"""vLLM's request extensions that act at the HTTP layer, shared by the generation endpoints:
``truncate_prompt_tokens`` (the prompt's last k tokens), the server's ``--max-logprobs`` limit,
and the per-chunk usage of ``stream_options.continuous_usage_stats``. (The extensions that change
sampling or the output's text are ``SamplingParams`` fields, honoured by the engine.)"""

from __future__ import annotations

from samebits.server.errors import APIError
from samebits.server.protocol import StreamOptions, Usage
from samebits.server.serving import ServingContext


def truncated(ctx: ServingContext, ids: list[int], k: int | None) -> list[int]:
    """The prompt's last ``k`` tokens (-1: the last ``max_model_len``); None: all of it.
    A ``k`` above the context length is a 400 (it could never fit)."""
    if k is None:
        return ids
    if k > ctx.max_model_len:
        raise APIError(400, f"truncate_prompt_tokens={k} is above this model's context of "
                       f"{ctx.max_model_len} tokens", param="truncate_prompt_tokens")
    if k == -1 or k >= 1:  # other values: SamplingParams' range check names the field
        return ids[-(ctx.max_model_len if k == -1 else k):]
    return ids


def check_logprobs(ctx: ServingContext, value: int | None, param: str) -> None:
    """A 400 naming ``param`` when more logprobs are asked for than the server returns
    (``--max-logprobs``)."""
    if value is not None and not 0 <= value <= ctx.max_logprobs:
        raise APIError(400, f"{param} must be an integer from 0 to {ctx.max_logprobs} (this "
                       f"server's --max-logprobs), got {value}", param=param)


def continuous(options: StreamOptions | None) -> bool:
    """Whether every chunk carries its choice's usage so far: ``continuous_usage_stats`` with
    ``include_usage`` (as vLLM: without it, no chunk carries usage)."""
    return include_usage(options) and bool(options.continuous_usage_stats)


def include_usage(options: StreamOptions | None) -> bool:
    """Whether the stream ends with a chunk carrying the request's usage."""
    return options is not None and bool(options.include_usage)


def chunk_usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    """One choice's usage so far (``continuous_usage_stats``)."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
