"""``POST /v1/completions`` on the wire: the request, its choices and the response (a stream's
chunks have the same shape, each with one choice)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from samebits.server.protocol import (
    BaseResponse,
    SamplingFields,
    Usage,
    VllmPromptLogprobs,
    omitted_when_none,
)


class CompletionRequest(SamplingFields):
    """``echo`` puts the prompt (and, with ``logprobs``, its logprobs: the first one null) before
    the generated text (streamed: in each choice's first chunk); ``max_tokens: 0`` generates
    nothing (scoring; any other value is SamplingParams', None: 16). ``prompt_logprobs`` (vLLM)
    returns each prompt token's logprob, rank and top-k in vLLM's per-choice shape (streamed: on
    each choice's first chunk)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None  # extension (as vLLM)


class CompletionLogprobs(BaseModel):
    """With ``echo``, the prompt's first token has no logprob: null in token_logprobs and
    top_logprobs (as vLLM)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    seed: int
    prompt_logprobs: VllmPromptLogprobs | None = None
    # vLLM's return_token_ids (a stream: prompt_token_ids on each choice's first chunk)
    prompt_token_ids: list[int] | None = omitted_when_none()
    token_ids: list[int] | None = omitted_when_none()


class CompletionResponse(BaseResponse):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
