"""The OpenAI wire format: request and response bodies as pydantic models.

Requests are parsed strictly (``"16"`` is not an integer), unknown fields are ignored, and every
range the engine does not check itself is checked here, so a bad request fails before it reaches
the engine. samebits adds ``seed`` to each choice and to the response: the seed a choice was
sampled with, drawn by the engine when the request gave none, so any answer can be replayed.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

MAX_N = 64  # choices per prompt; each choice is one engine request
MAX_CHOICES = 256  # choices per request, over all prompts of a completion request
MAX_TOP_LOGPROBS = 20
MAX_EMBEDDING_INPUTS = 2048  # inputs per embedding request, as OpenAI


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields both endpoints share. ``None`` means the default."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension (as vLLM): 0 or -1 is off
    min_p: float | None = Field(None, ge=0, le=1)  # extension
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float | None) -> float | None:
        if value not in (None, 0):
            raise ValueError("penalties are not supported (only 0)")
        return value


class CompletionRequest(SamplingFields):
    """``echo`` puts the prompt (and, with ``logprobs``, its logprobs: the first one null) before
    the generated text; ``max_tokens: 0`` generates nothing (scoring). ``prompt_logprobs`` (vLLM)
    returns each prompt token's logprob, rank and top-k in vLLM's per-choice shape."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # extension (as vLLM)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None:
            raise ValueError("each message needs a content (a string or a list of text parts)")
        return self

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content or ())


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return value


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``. An input over the model's token limit (sentence-transformers'
    max_seq_length) is a 400 unless the request asks for truncation, as sentence-transformers
    truncates: ``truncate: true`` (samebits) or vLLM's ``truncate_prompt_tokens`` (-1: the model's
    limit; k: k tokens). ``dimensions`` is accepted only as the model's own."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None  # None: "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:  # pydantic would report each union member's failure
            raise ValueError("must be a string, a list of strings, a list of token ids "
                             "(integers) or a list of token-id lists") from None


# ---- responses ------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """With ``echo``, the prompt's first token has no logprob: null in token_logprobs and
    top_logprobs (as vLLM)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: rank is 1-based in the raw distribution (tokens with logprob >= this)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    seed: int
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str
    seed: int  # the request's seed; choice i used seed + i (per prompt)


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    seed: int


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    seed: int


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 bytes


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    system_fingerprint: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "samebits"
    max_model_len: int
    system_fingerprint: str
    task: Literal["generate", "embed"] = "generate"  # extension: which endpoints serve it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
